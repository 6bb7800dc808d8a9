"""benchmarks/plot_curves.py on tensorboard runs written here with known steps, times and returns."""

import csv
import os
import subprocess
import sys

import pytest
from torch.utils.tensorboard import SummaryWriter

from helpers import ROOT, error_line

SCRIPT = os.path.join(ROOT, "benchmarks", "plot_curves.py")


def plot(*args, cwd):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def log_returns(run_dir, points, purge_step=None):
    """Writes (step, wall_time, return) points as one session, the way the scripts log them."""
    writer = SummaryWriter(run_dir, purge_step=purge_step)
    for step, wall_time, value in points:
        writer.add_scalar("charts/episodic_return", value, step, walltime=wall_time)
    writer.close()


@pytest.fixture
def runs(tmp_path):
    # Pong, seed 1: a session of 4 games, then a resume from a checkpoint at step 250 a day later: the games
    # logged at 300 and 400 in the first session are purged, and the 86,000 s gap does not count as training.
    pong = str(tmp_path / "runs" / "Pong-v5__impala_poly__1__100")
    log_returns(pong, [(100, 1000.0, -21), (200, 1360.0, -20), (300, 1720.0, -19), (400, 2080.0, -18)])
    log_returns(pong, [(350, 90000.0, -10), (450, 90360.0, -5)], purge_step=251)
    # A run stopped before its first full game has nothing to draw.
    with SummaryWriter(str(tmp_path / "runs" / "Breakout-v5__impala_poly__1__100")) as writer:
        writer.add_scalar("charts/SPS", 900, 10)
    # CartPole, two seeds.
    log_returns(str(tmp_path / "runs" / "CartPole-v1__impala_mono__1__100"), [(10 * i, 7.2 * i, i) for i in range(1, 6)])
    log_returns(str(tmp_path / "runs" / "CartPole-v1__impala_mono__2__100"), [(10 * i, 3.6 * i, 10 * i) for i in range(1, 4)])
    return tmp_path


def read_csv(path):
    with open(path) as f:
        return [
            (
                r["env_id"],
                r["script"],
                int(r["seed"]),
                int(r["global_step"]),
                round(float(r["hours"]), 6),
                float(r["episodic_return"]),
            )
            for r in csv.DictReader(f)
        ]


def test_csv_table_and_redraw(runs):
    result = plot(
        "runs", "--out", "results", "--window", "2", "--target", "CartPole-v1=3", "--target", "Pong-v5=-12", cwd=runs
    )
    assert result.returncode == 0, result.stderr
    # Pong hours: session 1 lasted 2080 - 1000 s (its purged games included); session 2 starts after it.
    assert read_csv(runs / "results" / "curves.csv") == [
        ("CartPole-v1", "impala_mono", 1, 10 * i, round(7.2 * (i - 1) / 3600, 6), i) for i in range(1, 6)
    ] + [("CartPole-v1", "impala_mono", 2, 10 * i, round(3.6 * (i - 1) / 3600, 6), 10 * i) for i in range(1, 4)] + [
        ("Pong-v5", "impala_poly", 1, 100, 0.0, -21),
        ("Pong-v5", "impala_poly", 1, 200, 0.1, -20),
        ("Pong-v5", "impala_poly", 1, 350, 0.3, -10),
        ("Pong-v5", "impala_poly", 1, 450, 0.4, -5),
    ]
    table = (runs / "results" / "results.md").read_text().splitlines()
    # Means of 2: CartPole seed 1 [1, 1.5, 2.5, 3.5, 4.5] first >= 3 at step 40; seed 2 [10, 15, 25] at step 20
    # (the first game alone is not a full window); Pong [-21, -20.5, -15, -7.5] first >= -12 at step 450 = 1800 frames.
    assert table[2:] == [
        "| CartPole-v1 | impala_mono | 1 | 50 | 0.5 min | 5 | 4.5 | 3 | 40 | 0.4 min |",
        "| CartPole-v1 | impala_mono | 2 | 30 | 0.1 min | 3 | 25.0 | 3 | 20 | 0.1 min |",
        "| Pong-v5 | impala_poly | 1 | 1800 | 24.0 min | 4 | -7.5 | -12 | 1800 | 24.0 min |",
    ]
    assert sorted(os.listdir(runs / "results")) == ["CartPole-v1.png", "Pong-v5.png", "curves.csv", "results.md"]

    # The CSV alone redraws the same table and figures.
    os.rename(runs / "results", runs / "saved")
    result = plot(
        "--csv",
        "saved/curves.csv",
        "--out",
        "redrawn",
        "--window",
        "2",
        "--target",
        "CartPole-v1=3",
        "--target",
        "Pong-v5=-12",
        cwd=runs,
    )
    assert result.returncode == 0, result.stderr
    assert (runs / "redrawn" / "results.md").read_text().splitlines() == table
    assert sorted(os.listdir(runs / "redrawn")) == ["CartPole-v1.png", "Pong-v5.png", "results.md"]


def test_bad_input(tmp_path):
    assert (
        error_line(plot("--target", "Pong-v5", cwd=tmp_path))
        == "error: --target 'Pong-v5' is not ENV_ID=RETURN (e.g. Pong-v5=18)"
    )
    assert error_line(plot("runs", cwd=tmp_path)).startswith("error: no episodic returns in 'runs'")
