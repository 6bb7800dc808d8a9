"""benchmarks/atari.py: tiny real runs (start, skip, resume), the results table recomputed by hand from a CSV written
here, the HNS and Atari-5 formulas against hand-computed values, and the error for an unknown game."""

import csv
import glob
import math
import os
import shlex
import sys

import envpool
import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

from helpers import ROOT, error_line, run

SCRIPT = os.path.join(ROOT, "benchmarks", "atari.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import atari  # noqa: E402  (by path: benchmarks/ is not a package)

# A run of 200 steps is 10 updates of 2 rollouts x 10 steps from a pool of 4 envs: startup dominates its few seconds.
TINY = [
    "--",
    "--num-envs",
    "4",
    "--env-batch-size",
    "2",
    "--num-threads",
    "1",
    "--num-torch-threads",
    "1",
    "--unroll-length",
    "10",
    "--batch-size",
    "2",
]
# (random, human) as given by the standard table (Badia et al. 2020), written out here apart from atari.py's.
SCORES = {
    "BattleZone": (2360, 37187.5),
    "DoubleDunk": (-18.55, -16.4),
    "NameThisGame": (2292.35, 8049),
    "Phoenix": (761.4, 7242.6),
    "Qbert": (163.88, 13455),
    "Pong": (-20.71, 14.6),
    "Breakout": (1.72, 30.5),
    "BeamRider": (363.88, 16926.5),
}
WEIGHTS = {"BattleZone": 0.3820, "DoubleDunk": 0.0679, "NameThisGame": 0.3108, "Phoenix": 0.1241, "Qbert": 0.0805}


def bench(*args, cwd):
    return run(SCRIPT, *args, cwd=cwd, timeout=300)


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def checkpoint(cwd, run_name):
    return torch.load(os.path.join(cwd, "runs", "atari", "runs", run_name, "checkpoint.pt"), weights_only=True)


def run_files(cwd):
    """{path: modification time} of every file the runs wrote."""
    return {path: os.path.getmtime(path) for path in glob.glob(os.path.join(cwd, "runs", "atari", "**"), recursive=True)}


@pytest.mark.slow
def test_runs_skip_and_resume(tmp_path):
    games = ["--env-ids", "Pong-v5", "Breakout-v5", "--seeds", 1, 2, "--total-timesteps", 200]
    result = bench(*games, "--jobs", 2, *TINY, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    names = [f"{env_id}__impala_poly__{seed}__atari" for env_id in ("Pong-v5", "Breakout-v5") for seed in (1, 2)]
    for i, name in enumerate(names, 1):
        env_id, _, seed, _ = name.split("__")
        assert f"[{i}/4] {env_id} seed {seed}: started" in result.stdout.splitlines(), result.stdout
        assert f"[{i}/4] {env_id} seed {seed}: finished in " in result.stdout, result.stdout
        assert checkpoint(tmp_path, name)["global_step"] == 200
    runs = read_csv(tmp_path / "results" / "atari" / "runs.csv")
    curves = read_csv(tmp_path / "results" / "atari" / "curves.csv")
    assert [(r["env_id"], r["seed"], r["total_timesteps"], r["global_step"]) for r in runs] == [
        ("Breakout-v5", "1", "200", "200"),
        ("Breakout-v5", "2", "200", "200"),
        ("Pong-v5", "1", "200", "200"),
        ("Pong-v5", "2", "200", "200"),
    ]
    with open("/proc/cpuinfo") as f:  # the CPU that finished each run: this one, with its bf16 feature (test_cpu_label)
        cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    for r in runs:  # hours: training time from the events, the episodes those in curves.csv
        assert 0 < float(r["hours"]) < 0.1
        assert int(r["episodes"]) == sum(c["env_id"] == r["env_id"] and c["seed"] == r["seed"] for c in curves)
        bf16 = checkpoint(tmp_path, f"{r['env_id']}__impala_poly__{r['seed']}__atari")["args"]["bf16"]
        assert (r["precision"], r["cpu"]) == ("bfloat16" if bf16 else "float32", atari.this_cpu())
        assert r["cpu"].startswith(f"{cpu} ({os.cpu_count()} cores, ")
        assert r["flags"] == shlex.join(TINY[1:])  # the flags after --, as given
    # Pong's games last thousands of steps: no score, said in the table.
    table = (tmp_path / "results" / "atari" / "results.md").read_text()
    assert "| Pong-v5 | impala_poly | 2 | - | - | " in table
    assert "seed 1: no full game (not scored); seed 2: no full game (not scored) |" in table

    # Pong seed 1 was trained for 200 steps, its learning rate annealed over --anneal-lr-timesteps: a runner asked for
    # 400 continues it. Seed 2's checkpoint becomes one from before that flag, its rate annealed to 0 over its budget of
    # 200: continuing it would restart the rate, so it fails untouched. Seed 3's folder holds events but no checkpoint,
    # so it fails without being started (its events would mix with a new run's). The other run still goes on.
    annealed = checkpoint(tmp_path, names[1])
    annealed["args"]["anneal_lr_timesteps"] = None
    torch.save(annealed, tmp_path / "runs" / "atari" / "runs" / names[1] / "checkpoint.pt")
    with SummaryWriter(str(tmp_path / "runs" / "atari" / "runs" / "Pong-v5__impala_poly__3__atari")) as writer:
        writer.add_scalar("charts/SPS", 100, 20)
    seed_2 = {path: time for path, time in run_files(tmp_path).items() if names[1] in path}
    result = bench("--env-ids", "Pong-v5", "--seeds", 1, 2, 3, "--total-timesteps", 400, *TINY, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "[1/3] Pong-v5 seed 1: resumed at global_step 200" in lines, result.stdout
    assert any(line.startswith("[1/3] Pong-v5 seed 1: finished in ") for line in lines), result.stdout
    assert (
        f"[2/3] Pong-v5 seed 2: failed, runs/atari/runs/{names[1]} was trained for --total-timesteps 200 (its learning "
        "rate anneals to 0 there): a budget of 400 needs its own --runs-dir and --out"
    ) in lines, result.stdout
    assert {path: time for path, time in run_files(tmp_path).items() if names[1] in path} == seed_2
    assert any(line.startswith("[3/3] Pong-v5 seed 3: failed, ") for line in lines), result.stdout
    resumed = checkpoint(tmp_path, names[0])
    run_dir = tmp_path / "runs" / "atari" / "runs" / names[0]
    assert (resumed["global_step"], resumed["args"]["resume"]) == (400, str(run_dir / "checkpoint.pt"))
    assert len(glob.glob(str(run_dir / "events.out.tfevents.*"))) == 2  # one per session
    log = (tmp_path / "runs" / "atari" / f"{names[0]}.log").read_text()
    assert [line.endswith(f"--resume {run_dir / 'checkpoint.pt'}") for line in log.splitlines() if line.startswith("###")] == [
        False,
        True,
    ]
    runs = read_csv(tmp_path / "results" / "atari" / "runs.csv")
    pong = runs[2]  # rows in (env_id, script, seed) order
    assert (pong["env_id"], pong["seed"], pong["total_timesteps"], pong["global_step"]) == ("Pong-v5", "1", "400", "400")
    curves = read_csv(tmp_path / "results" / "atari" / "curves.csv")  # the run's rows replaced, not added to
    assert int(pong["episodes"]) == sum(c["env_id"] == "Pong-v5" and c["seed"] == "1" for c in curves)
    table = (tmp_path / "results" / "atari" / "results.md").read_text()
    assert "- Pong-v5 impala_poly seed 2: recorded at global_step 200; checkpoint at global_step 200" in table
    assert "- Pong-v5 impala_poly seed 3: no checkpoint" in table

    # The first command again: everything is done per runs.csv, nothing starts and no run file changes.
    before = run_files(tmp_path)
    result = bench(*games, "--jobs", 2, *TINY, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    for i, name in enumerate(names, 1):
        env_id, _, seed, _ = name.split("__")
        step = 400 if i == 1 else 200
        skipped = f"[{i}/4] {env_id} seed {seed}: skipped, finished at global_step {step} (results/atari/runs.csv)"
        assert skipped in result.stdout.splitlines(), result.stdout
    assert "started" not in result.stdout
    assert run_files(tmp_path) == before
    # Scored at 200 steps, seed 1 says it was trained for 400 (its learning rate had not annealed to 0 at 200).
    table = (tmp_path / "results" / "atari" / "results.md").read_text()
    assert "| Pong-v5 | impala_poly | 2 | - | - | " in table
    assert "seed 1: trained for 400 steps; seed 1: no full game (not scored); seed 2: no full game (not scored) |" in table


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_table_by_hand(tmp_path):
    """A synthetic out folder: the Atari-5 games with seed 1 (150 games, returns base + scale * i) and seed 2 (120 games,
    base + 2 * scale * i), plus games past the budget that must not count; Pong seed 1 finished without a full game,
    seed 2 recorded short of the budget; Breakout seed 1 with 30 games, seed 2 never run."""
    budget = 200_000
    curves, runs = [], []
    bases = {
        "BattleZone": (3000, 40),
        "DoubleDunk": (-18, 0.01),
        "NameThisGame": (2500, 20),
        "Phoenix": (800, 10),
        "Qbert": (200, 30),
    }
    for name, (base, scale) in bases.items():
        for seed, n, step_scale in [(1, 150, 1), (2, 120, 2)]:
            curves += [
                dict(
                    env_id=f"{name}-v5",
                    script="impala_poly",
                    seed=seed,
                    global_step=1000 * (i + 1),
                    hours=i / 1000,
                    episodic_return=base + step_scale * scale * i,
                )
                for i in range(n)
            ]
            runs.append(
                dict(
                    env_id=f"{name}-v5",
                    script="impala_poly",
                    seed=seed,
                    total_timesteps=budget,
                    global_step=budget + 500,
                    hours={1: 1.5, 2: 0.5}[seed],
                    episodes=n,
                )
            )
        curves += [
            dict(env_id=f"{name}-v5", script="impala_poly", seed=1, global_step=budget + 100 * j, hours=1, episodic_return=1e6)
            for j in range(1, 4)
        ]
    curves += [
        dict(env_id="Breakout-v5", script="impala_poly", seed=1, global_step=5000 * (i + 1), hours=i / 100, episodic_return=i)
        for i in range(30)
    ]
    runs += [
        dict(
            env_id="Pong-v5", script="impala_poly", seed=1, total_timesteps=budget, global_step=budget, hours=0.25, episodes=0
        ),
        dict(
            env_id="Pong-v5", script="impala_poly", seed=2, total_timesteps=100_000, global_step=100_000, hours=0.1, episodes=0
        ),
        dict(
            env_id="Breakout-v5",
            script="impala_poly",
            seed=1,
            total_timesteps=budget,
            global_step=budget,
            hours=2,
            episodes=30,
        ),
    ]
    os.makedirs(tmp_path / "out")
    write_csv(tmp_path / "out" / "curves.csv", curves)
    write_csv(tmp_path / "out" / "runs.csv", runs)
    report_only = ["--report-only", "--out", "out", "--runs-dir", "nowhere", "--total-timesteps", budget]
    result = bench(
        *report_only,
        "--seeds",
        1,
        2,
        "--env-ids",
        "Pong-v5",
        "Breakout-v5",
        *[f"{name}-v5" for name in bases],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "out" / "results.md").read_text().splitlines()
    assert table[0] == "# Atari benchmark: 200,000 steps (0.8M frames) per run"

    per_seed_hns = {1: {}, 2: {}}
    for name, (base, scale) in bases.items():
        random, human = SCORES[name]
        mean1 = base + scale * (50 + 149) / 2  # seed 1: the last 100 of i = 0..149 are i = 50..149
        mean2 = base + 2 * scale * (20 + 119) / 2  # seed 2: i = 20..119
        mean, std = (mean1 + mean2) / 2, abs(mean1 - mean2) / math.sqrt(2)  # sample std of two values
        hns1, hns2 = (mean1 - random) / (human - random), (mean2 - random) / (human - random)
        per_seed_hns[1][name], per_seed_hns[2][name] = hns1, hns2
        hns_mean, hns_std = (hns1 + hns2) / 2, abs(hns1 - hns2) / math.sqrt(2)
        # Wall time: the mean of 1.5 and 0.5 h.
        row = f"| {name}-v5 | impala_poly | 2 | {mean:.1f} ± {std:.1f} | {hns_mean:.3f} ± {hns_std:.3f} | 1.00 h |  |"
        assert row in table
    breakout_hns = (14.5 - 1.72) / (30.5 - 1.72)  # Breakout seed 1: the mean of its 30 games 0..29
    assert f"| Breakout-v5 | impala_poly | 1 | 14.5 | {breakout_hns:.3f} | 2.00 h | seed 1: 30 games |" in table
    assert "| Pong-v5 | impala_poly | 1 | - | - | 15.0 min | seed 1: no full game (not scored) |" in table
    assert "- Pong-v5 impala_poly seed 2: recorded at global_step 100000; no checkpoint" in table
    assert "- Breakout-v5 impala_poly seed 2: no checkpoint" in table
    assert not any(line.startswith(("Every run", "Machines")) for line in table)  # rows that predate the machine columns

    def predict(hns_by_game):  # Atari-5 with HNS in percent, as the regression was fitted
        total = 0.0
        for name, weight in WEIGHTS.items():
            total += weight * math.log10(1 + max(100 * hns_by_game[name], 0))
        return (10**total - 1) / 100

    estimate = predict({name: (per_seed_hns[1][name] + per_seed_hns[2][name]) / 2 for name in WEIGHTS})
    p1, p2 = predict(per_seed_hns[1]), predict(per_seed_hns[2])
    line = (
        f"- impala_poly: {estimate:.3f} from the mean-over-seeds HNS of each game; per seed (seeds 1, 2): "
        f"{p1:.3f}, {p2:.3f}; mean {(p1 + p2) / 2:.3f} ± {abs(p1 - p2) / math.sqrt(2):.3f}"
    )
    assert line in table
    pngs = sorted(["curves.csv", "runs.csv", "results.md", "Breakout-v5.png"] + [f"{name}-v5.png" for name in bases])
    assert sorted(os.listdir(tmp_path / "out")) == pngs

    # Asked for one game and seed (a runner started on a few games), the report keeps every recorded run's row and the
    # Atari-5 estimate; only the list of unfinished runs narrows to what was asked.
    result = bench(*report_only, "--seeds", 1, "--env-ids", "Qbert-v5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    narrow = (tmp_path / "out" / "results.md").read_text().splitlines()
    rows = sorted(row for row in table if row.startswith("| ") and "-v5 |" in row)
    assert len(rows) == 7
    assert sorted(row for row in narrow if row.startswith("| ") and "-v5 |" in row) == rows
    assert line in narrow
    assert not any(row.startswith("Not finished") for row in narrow)
    assert sorted(os.listdir(tmp_path / "out")) == pngs


def test_wall_time_per_machine(tmp_path):
    """Runs finished on two machines: each row's wall time is the mean over its runs on each machine, labelled; one
    machine needs no labels."""
    epyc, xeon = ("AMD EPYC (2 cores)", "float32"), ("Intel Xeon (2 cores)", "bfloat16")
    runs = [
        dict(env_id="Breakout-v5", seed=1, hours=1.0, machine=epyc),
        dict(env_id="Breakout-v5", seed=2, hours=0.25, machine=xeon),
        dict(env_id="Breakout-v5", seed=3, hours=2.0, machine=epyc),
        dict(env_id="Pong-v5", seed=1, hours=0.5, machine=epyc),
    ]
    os.makedirs(tmp_path / "out")
    for r in runs:
        cpu, precision = r.pop("machine")
        r.update(script="impala_poly", total_timesteps=1000, global_step=1000, episodes=0, precision=precision, cpu=cpu)
    write_csv(tmp_path / "out" / "runs.csv", runs)
    report_only = ["--report-only", "--out", "out", "--runs-dir", "nowhere", "--total-timesteps", 1000, "--seeds", 1, 2, 3]
    result = bench(*report_only, "--env-ids", "Breakout-v5", "Pong-v5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "out" / "results.md").read_text().splitlines()
    assert any(row.startswith("| Breakout-v5 | impala_poly | 3 | - | - | 1.50 h (A), 15.0 min (B) | ") for row in table)
    assert any(row.startswith("| Pong-v5 | impala_poly | 1 | - | - | 30.0 min (A) | ") for row in table)
    start = table.index("Machines (CPU, the network's precision):")
    assert table[start + 2 : start + 4] == [
        "- A: AMD EPYC (2 cores), float32; 3 runs",
        "- B: Intel Xeon (2 cores), bfloat16; 1 run",
    ]

    write_csv(tmp_path / "out" / "runs.csv", [r for r in runs if r["cpu"] == epyc[0]])
    result = bench(*report_only, "--env-ids", "Breakout-v5", "Pong-v5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "out" / "results.md").read_text().splitlines()
    assert any(row.startswith("| Breakout-v5 | impala_poly | 2 | - | - | 1.50 h | ") for row in table)
    assert "Every run on one machine: AMD EPYC (2 cores), float32." in table
    assert not any(row.startswith("Machines") for row in table)


def test_curves_per_machine(tmp_path, monkeypatch):
    """The report's figures: the frames panel has one mean over every seed of a script; the hours panel one mean per
    machine (CPU and precision, as runs.csv records them), labelled with it."""
    epyc, xeon = ("AMD EPYC (2 cores, avx512_bf16)", "float32"), ("Intel Xeon (2 cores, amx_bf16)", "bfloat16")
    runs, curves = [], []
    for seed, (cpu, precision), hours in [(1, epyc, 1.0), (2, xeon, 0.25), (3, epyc, 2.0)]:
        runs.append(
            dict(
                env_id="Breakout-v5",
                script="impala_poly",
                seed=seed,
                total_timesteps=1000,
                global_step=1000,
                hours=hours,
                episodes=4,
                precision=precision,
                cpu=cpu,
            )
        )
        curves += [
            dict(
                env_id="Breakout-v5",
                script="impala_poly",
                seed=seed,
                global_step=250 * i,
                hours=hours * i / 4,
                episodic_return=seed * i,
            )
            for i in range(1, 5)
        ]
    os.makedirs(tmp_path / "out")
    write_csv(tmp_path / "out" / "curves.csv", curves)
    write_csv(tmp_path / "out" / "runs.csv", runs)
    figures = []
    draw_figure = atari.plot_curves.figure

    def recorded_figure(*positional, **keywords):  # the report's figures, kept to inspect
        figures.append(draw_figure(*positional, **keywords))
        return figures[-1]

    monkeypatch.setattr(atari.plot_curves, "figure", recorded_figure)
    args, script, _ = atari.parse_args(
        ["--report-only", "--out", str(tmp_path / "out"), "--runs-dir", str(tmp_path / "nowhere")]
        + ["--total-timesteps", "1000", "--seeds", "1", "2", "3", "--env-ids", "Breakout-v5"]
    )
    assert atari.report(args, script)[1:] == [str(tmp_path / "out" / "Breakout-v5.png")]
    frames, hours = figures[0].axes
    assert [line.get_label() for line in frames.get_lines() if not line.get_label().startswith("_")] == [
        "impala_poly: 3 seeds"
    ]
    means = {line.get_label(): line for line in hours.get_lines() if not line.get_label().startswith("_")}
    assert sorted(means) == [
        "impala_poly, AMD EPYC (2 cores, avx512_bf16), float32: 2 seeds",
        "impala_poly, Intel Xeon (2 cores, amx_bf16), bfloat16: 1 seed",
    ]
    # The EPYC's mean ends where seed 3 ends, at 2 h, on the mean of its seeds' last running means (a window of 100
    # holds all 4 games): seed 1's 2.5 carried from 1 h, seed 3's 7.5.
    epyc_mean = means["impala_poly, AMD EPYC (2 cores, avx512_bf16), float32: 2 seeds"]
    assert epyc_mean.get_xdata()[-1] == pytest.approx(2.0)
    assert epyc_mean.get_ydata()[-1] == pytest.approx((2.5 + 7.5) / 2)
    xeon_mean = means["impala_poly, Intel Xeon (2 cores, amx_bf16), bfloat16: 1 seed"]
    assert (xeon_mean.get_xdata()[-1], xeon_mean.get_ydata()[-1]) == pytest.approx((0.25, 5.0))  # seed 2: 2, 4, 6, 8


def test_hns_and_atari5():
    assert math.isclose(atari.hns("Pong-v5", 0), (0 + 20.71) / (14.6 + 20.71))
    assert math.isclose(atari.hns("Breakout-v5", 30.5), 1.0)
    assert atari.hns("Pooyan-v5", 100) is None  # an EnvPool game outside the 57
    for name, (random, human) in SCORES.items():
        assert atari.HUMAN_RANDOM[name] == (random, human)
    assert len(atari.HUMAN_RANDOM) == 57
    assert {f"{name}-v5" for name in atari.HUMAN_RANDOM} <= set(envpool.list_all_envs())
    # Human level on all five: log10(1 + median%) = 0.9653 * log10(101), so median% = 101 ** 0.9653 - 1.
    assert math.isclose(sum(WEIGHTS.values()), 0.9653)
    assert math.isclose(atari.atari5_median(dict.fromkeys(WEIGHTS, 1.0)), (101**0.9653 - 1) / 100)
    # HNS 0.5, 2, -1 (clipped to 0), 0, 3.5 -> percents 50, 200, 0, 0, 350; step by step:
    log_median = (
        0.3820 * math.log10(51)
        + 0.0679 * math.log10(201)
        + 0.3108 * math.log10(1)
        + 0.1241 * math.log10(1)
        + 0.0805 * math.log10(351)
    )
    hns_values = {"BattleZone": 0.5, "DoubleDunk": 2.0, "NameThisGame": -1.0, "Phoenix": 0.0, "Qbert": 3.5}
    assert math.isclose(atari.atari5_median(hns_values), (10**log_median - 1) / 100)


def test_cpu_label():
    """The CPU label from /proc/cpuinfo's text: the first processor's model, the cores, and the bf16 feature."""

    def cpuinfo(model, flags):  # two processors, as /proc/cpuinfo lists them, with the lines around the two we read
        block = f"processor\t: 0\nvendor_id\t: x\nmodel name\t: {model}\nflags\t\t: fpu sse2 {flags}\nbugs\t\t: spectre_v1\n"
        return block + "\n" + block.replace("processor\t: 0", "processor\t: 1")

    intel = "Intel(R) Xeon(R) Platinum 8480+"
    assert atari.cpu_label(cpuinfo(intel, "avx512f avx512_bf16 amx_bf16 amx_tile"), 2) == f"{intel} (2 cores, amx_bf16)"
    assert atari.cpu_label(cpuinfo("AMD EPYC", "avx512f avx512_bf16 avx512_vnni"), 2) == "AMD EPYC (2 cores, avx512_bf16)"
    assert atari.cpu_label(cpuinfo("AMD EPYC", "avx2 avx512f avx512bw"), 4) == "AMD EPYC (4 cores, no bf16)"
    assert atari.cpu_label(cpuinfo("AMD EPYC", ""), 4) == "AMD EPYC (4 cores, no bf16)"
    assert atari.cpu_label("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd bf16\n", 4) is None  # no model


def test_unknown_game(tmp_path):
    assert (
        error_line(bench("--env-ids", "Pong-v5", "Pongg-v5", cwd=tmp_path))
        == "error: unknown game 'Pongg-v5': pass EnvPool Atari ids such as Pong-v5 or Qbert-v5"
    )
    assert os.listdir(tmp_path) == []  # nothing started


def test_one_configuration_per_out(tmp_path):
    """runs.csv records the flags given after `--`; a runner given other flags refuses the out folder before anything
    starts (its table and Atari-5 estimate would mix configurations), a folder without the column (older) is not
    checked, and --report-only redraws whatever the folder holds, naming the flags in results.md."""
    os.makedirs(tmp_path / "out")
    run_row = dict(
        env_id="Breakout-v5",
        script="impala_poly",
        seed=1,
        total_timesteps=100,
        global_step=100,
        hours=0.5,
        episodes=1,
        precision="float32",
        cpu="AMD EPYC (2 cores, no bf16)",
    )
    write_csv(
        tmp_path / "out" / "curves.csv",
        [dict(env_id="Breakout-v5", script="impala_poly", seed=1, global_step=50, hours=0.1, episodic_return=3.0)],
    )
    write_csv(tmp_path / "out" / "runs.csv", [dict(run_row, flags="--clip-coef 0.1 --replay-proportion 3")])
    asked = ["--env-ids", "Breakout-v5", "--seeds", 1, "--total-timesteps", 100, "--out", "out", "--runs-dir", "runs"]
    before = {path: (tmp_path / "out" / path).read_bytes() for path in os.listdir(tmp_path / "out")}
    assert error_line(bench(*asked, "--", "--clip-coef", "0.2", cwd=tmp_path)) == (
        "error: out/runs.csv holds runs trained with '--clip-coef 0.1 --replay-proportion 3' after --, these would have "
        "'--clip-coef 0.2': give each configuration its own --out and --runs-dir"
    )
    assert error_line(bench(*asked, cwd=tmp_path)) == (
        "error: out/runs.csv holds runs trained with '--clip-coef 0.1 --replay-proportion 3' after --, these would have "
        "none: give each configuration its own --out and --runs-dir"
    )
    assert {path: (tmp_path / "out" / path).read_bytes() for path in os.listdir(tmp_path / "out")} == before
    assert not os.path.exists(tmp_path / "runs")  # nothing started

    # The same flags: Breakout seed 1 is done per runs.csv, so it is skipped; the table names the flags.
    result = bench(*asked, "--", "--clip-coef", "0.1", "--replay-proportion", "3", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "[1/1] Breakout-v5 seed 1: skipped, finished at global_step 100 (out/runs.csv)" in result.stdout
    table = (tmp_path / "out" / "results.md").read_text().splitlines()
    assert "Flags given to the runs (after `--`): `--clip-coef 0.1 --replay-proportion 3`." in table

    # --report-only trains nothing, so other flags do not matter: it redraws the table as the folder holds it.
    result = bench(*asked, "--report-only", "--", "--clip-coef", "0.2", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    table = (tmp_path / "out" / "results.md").read_text().splitlines()
    assert "Flags given to the runs (after `--`): `--clip-coef 0.1 --replay-proportion 3`." in table

    # A folder from before the column: no check, and no flags named.
    write_csv(tmp_path / "out" / "runs.csv", [run_row])
    result = bench(*asked, "--", "--clip-coef", "0.2", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert not any(line.startswith("Flags") for line in (tmp_path / "out" / "results.md").read_text().splitlines())
