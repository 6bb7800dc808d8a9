"""benchmarks/plot_curves.py on tensorboard runs written here with known steps, times and returns."""

import csv
import os
import sys

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

from helpers import ROOT, error_line, run

SCRIPT = os.path.join(ROOT, "benchmarks", "plot_curves.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import plot_curves  # noqa: E402  (by path: benchmarks/ is not a package)


def plot(*args, cwd):
    return run(SCRIPT, *args, cwd=cwd, timeout=300)


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


def test_carried():
    """Curves of different spans on one grid: from where all have a point (20) to where the longest ends (70), each
    interpolated within its span and holding its last value past its end."""
    curves = [
        (np.array([10, 20, 30, 40, 50]), np.array([1.0, 1.5, 2.5, 3.5, 4.5])),
        (np.array([10, 20, 30]), np.array([10.0, 15.0, 25.0])),
        (np.array([20, 40, 70]), np.array([2.0, 6.0, 12.0])),
    ]
    grid, ys = plot_curves.carried(curves, points=6)
    np.testing.assert_allclose(grid, [20, 30, 40, 50, 60, 70])
    np.testing.assert_allclose(
        ys,
        [
            [1.5, 2.5, 3.5, 4.5, 4.5, 4.5],
            [15, 25, 25, 25, 25, 25],
            [2, 4, 6, 8, 10, 12],  # 8 and 10: a third and two thirds of the way from 6 at 40 to 12 at 70
        ],
    )


def curve_rows(script, seed, steps, hours, returns):
    return [
        dict(env_id="CartPole-v1", script=script, seed=seed, global_step=step, hours=h, episodic_return=r)
        for step, h, r in zip(steps, hours, returns)
    ]


def means(ax):
    """{legend label: line} of a panel's thick lines, the means; the thin per-seed lines carry no label."""
    return {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}


def test_figure_seeds_and_machines():
    """CartPole (1 frame a step), window 2. impala_mono: seed 1 ends at step 50, seed 2 at 30, seed 3 starts at 20 and
    ends at 70; seeds 1 and 2 ran on machine A, seed 3 on B. impala_poly's one seed has no machine recorded."""
    steps = {1: [10, 20, 30, 40, 50], 2: [10, 20, 30], 3: [20, 30, 40, 50, 60, 70]}
    rows = (
        curve_rows("impala_mono", 1, steps[1], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5])
        + curve_rows("impala_mono", 2, steps[2], [0.5, 1, 1.5], [10, 20, 30])
        + curve_rows("impala_mono", 3, steps[3], [2, 3, 4, 5, 6, 7], [2, 4, 6, 8, 10, 12])
        + curve_rows("impala_poly", 1, [10, 20], [1, 2], [0, 2])
    )
    # Running means of 2 games, by hand.
    mono = {1: [1, 1.5, 2.5, 3.5, 4.5], 2: [10, 15, 25], 3: [2, 3, 5, 7, 9, 11]}
    machines = {("CartPole-v1", "impala_mono", 1): "A", ("CartPole-v1", "impala_mono", 2): "A"}
    machines["CartPole-v1", "impala_mono", 3] = "B"
    frames, hours = plot_curves.figure(rows, 2, machines).axes

    # Frames: every seed whole, as a thin line in its script's colour, and one mean per script over all machines that
    # runs to the longest seed's last step, where it is the mean of the seeds' last values (the shorter ones carried).
    assert sorted(means(frames)) == ["impala_mono: 3 seeds", "impala_poly: 1 seed"]
    mean = means(frames)["impala_mono: 3 seeds"]
    thin = [line for line in frames.get_lines() if line.get_color() == mean.get_color() and line is not mean]
    assert len(thin) == 3
    for line, seed in zip(thin, [1, 2, 3]):
        np.testing.assert_allclose(line.get_xdata(), np.array(steps[seed]) / 1e6)
        np.testing.assert_allclose(line.get_ydata(), mono[seed])
        assert line.get_alpha() < 1 and line.get_linewidth() < mean.get_linewidth()
    np.testing.assert_allclose(mean.get_xdata()[[0, -1]], [20e-6, 70e-6])
    np.testing.assert_allclose(mean.get_ydata()[[0, -1]], [(1.5 + 15 + 2) / 3, (4.5 + 25 + 11) / 3])
    assert means(frames)["impala_poly: 1 seed"].get_color() != mean.get_color()

    # Hours: one mean per script and machine, labelled with it, never averaged across machines.
    lines = means(hours)
    assert sorted(lines) == ["impala_mono, A: 2 seeds", "impala_mono, B: 1 seed", "impala_poly, machine not recorded: 1 seed"]
    a, b = lines["impala_mono, A: 2 seeds"], lines["impala_mono, B: 1 seed"]
    np.testing.assert_allclose(a.get_xdata()[[0, -1]], [1, 5])  # seed 1's first game to its last, seed 2's carried
    np.testing.assert_allclose(a.get_ydata()[[0, -1]], [(1 + 15) / 2, (4.5 + 25) / 2])
    np.testing.assert_allclose(b.get_xdata()[[0, -1]], [2, 7])
    np.testing.assert_allclose(b.get_ydata()[[0, -1]], [2, 11])
    assert a.get_color() == b.get_color() == mean.get_color()
    assert a.get_linestyle() != b.get_linestyle()
    assert len(hours.get_lines()) == 4 + 3  # a thin line per seed, a thick one per mean

    # Without machines (the CLI's runs, all from this machine), the hours panel has one mean per script.
    hours = plot_curves.figure(rows, 2).axes[1]
    assert sorted(means(hours)) == ["impala_mono: 3 seeds", "impala_poly: 1 seed"]
    np.testing.assert_allclose(means(hours)["impala_mono: 3 seeds"].get_xdata()[[0, -1]], [2, 7])
    np.testing.assert_allclose(means(hours)["impala_mono: 3 seeds"].get_ydata()[-1], (4.5 + 25 + 11) / 3)
