"""Running the scripts exactly as a user does, and reading what they logged."""

import glob
import os
import subprocess
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args, cwd, timeout=600):
    """Runs `python script args...` in `cwd` (its runs/ folder lands there); returns the CompletedProcess."""
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def run_dirs(cwd):
    return sorted(glob.glob(os.path.join(cwd, "runs", "*")))


def scalars(run_dir, tag):
    """[(step, value)] logged under `tag` in a run's tensorboard events."""
    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def error_line(result):
    """The one line a bad-input error must print: stderr, stripped of library warnings."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, result.stderr
    return lines[0]
