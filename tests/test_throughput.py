"""benchmarks/throughput.py runs against the scripts as they are: it drives poly's actor loop and acting policy
directly, so a change of their interface must reach it (it hung once on one, waiting for batches that never came)."""

import math
import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT


@pytest.mark.slow
def test_throughput_prints_a_figure_for_every_entry(tmp_path):
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "throughput.py"), "--env-ids", "CartPole-v1"]
    flags = ["--seconds", "2", "--warmup", "2", "--num-envs", "8", "--scripts", "impala_poly.py", "--precisions", "float32"]
    result = subprocess.run([*command, *flags], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("CartPole-v1 (")]
    figures = [float(x) for x in re.findall(r": (\d+) steps/s", line)]
    assert len(figures) == 3 and all(x > 0 for x in figures), line  # gymnasium, EnvPool, poly's actor loop
    rows = [row.split("|")[1:3] for row in result.stdout.splitlines() if row.startswith("| ") and "(/ ceiling)" not in row]
    figures = {name.strip(): float(cell.split()[0]) for name, cell in rows}
    assert list(figures) == [
        "inference alone, batches of 4",
        "learner alone (incl. batching and copy)",
        "bare compute: inference + learner, no env",
        "ceiling: 1 / (1 / EnvPool + 1 / compute)",
        "impala_poly.py, default flags",
    ], result.stdout
    assert all(math.isfinite(value) and value > 0 for value in figures.values()), result.stdout
