"""benchmarks/throughput.py runs against the scripts as they are: it drives poly's actor loop and acting policy
directly, so a change of their interface must reach it (it hung once on one, waiting for batches that never came)."""

import math
import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import throughput  # noqa: E402


@pytest.mark.slow
def test_throughput_prints_a_figure_for_every_entry(tmp_path):
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "throughput.py"), "--env-ids", "CartPole-v1"]
    flags = ["--seconds", "2", "--warmup", "2", "--num-envs", "8", "--scripts", "impala_poly.py", "--precisions", "float32"]
    after = ["--", "--replay-proportion", "1"]  # a configuration, timed beside the defaults
    result = subprocess.run([*command, *flags, *after], cwd=tmp_path, capture_output=True, text=True, timeout=120)
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
        "impala_poly.py, the flags after --",
    ], result.stdout
    assert all(math.isfinite(value) and value > 0 for value in figures.values()), result.stdout
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("impala_poly.py with")]
    match = re.fullmatch(
        r"impala_poly.py with --replay-proportion 1: (\d+\.\d\d) \(float32\) of its default flags' steps/s", line
    )
    assert match, line
    ratio = figures["impala_poly.py, the flags after --"] / figures["impala_poly.py, default flags"]
    assert float(match.group(1)) == pytest.approx(ratio, abs=0.01), line  # the table's figures are rounded


def test_a_script_that_refuses_its_flags_ends_the_measurement_with_its_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with pytest.raises(SystemExit) as stopped:
        throughput.script_sps("impala_poly.py", "CartPole-v1", 2, 0, ["--replay-proportion", "-1"])
    assert str(stopped.value) == (
        "error: impala_poly.py --replay-proportion -1 exited with 1 before it was timed: "
        "error: --replay-proportion must be 0 (no replay) or more, got -1"
    )
