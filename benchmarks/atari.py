"""Reproduces an Atari benchmark with one command: every game x seed trained by one script, resumable, then curves, a
results table with human-normalized scores (HNS) and the Atari-5 estimate of the Atari-57 median HNS.

    python benchmarks/atari.py                                               # 8 games x 3 seeds x 10M frames
    python benchmarks/atari.py --env-ids Pong-v5 Qbert-v5 --jobs 2 -- --num-envs 16  # flags after -- go to every run
    python benchmarks/atari.py --report-only                                 # redraw results/atari from its CSVs

Run `{env_id}__{script}__{seed}__atari` starts in `--runs-dir`, so it writes `{runs_dir}/runs/{run_name}/` (events and
checkpoint.pt) and appends its output to `{runs_dir}/{run_name}.log`. A run whose checkpoint is short of the budget is
continued with --resume, also one trained for a shorter budget (its learning rate anneals over --anneal-lr-timesteps,
whatever the budget); a run whose rate annealed over its own budget (from before that flag) is not. A finished run's
curve is merged into `{out}/curves.csv` and the run (with its precision, the CPU that finished it and the flags after
--) into `{out}/runs.csv`: the out folder (committed) alone says which runs are done, even when the run folders are
gone. An out folder holds one configuration: a runner given other flags after -- than its runs.csv records refuses it.
The table scores every run recorded with at least the budget's steps at the budget, and notes a run trained for a
longer one.
"""

import argparse
import csv
import os
import platform
import shlex
import signal
import subprocess
import sys
import time

import envpool
import numpy as np

import plot_curves  # this folder's: it draws the curves and reads the runs' events

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Three games with public curves to compare with, then the five of Atari-5.
GAMES = [
    "Pong-v5",
    "Breakout-v5",
    "BeamRider-v5",
    "BattleZone-v5",
    "DoubleDunk-v5",
    "NameThisGame-v5",
    "Phoenix-v5",
    "Qbert-v5",
]
# precision and cpu: what the run's network computed in and the machine that finished it, since wall time depends on both.
RUN_FIELDS = ["env_id", "script", "seed", "total_timesteps", "global_step", "hours", "episodes", "precision", "cpu", "flags"]
NOT_RECORDED = "not recorded"  # the flags of a row from before runs.csv had the column
WINDOW = 100  # games in each seed's final score

# (random, human) scores of the 57 games, keyed by EnvPool's name: the standard table of the Agent57 and R2D2 papers
# (Badia et al. 2020), as the Atari-5 author's Atari-Human.csv (github.com/maitchison/PPO) gives it. DeepMind's DQN Zoo
# (dqn_zoo/atari_data.py) has the same values to one decimal, except VideoPinball's random score (16256.9 there).
# SpaceInvaders' random score is 148.0 as in DQN Zoo: that CSV's 148.3 matches no other copy.
HUMAN_RANDOM = {
    "Alien": (227.75, 7127.7),
    "Amidar": (5.77, 1719.5),
    "Assault": (222.39, 742.0),
    "Asterix": (210.0, 8503.3),
    "Asteroids": (719.1, 47388.7),
    "Atlantis": (12850.0, 29028.1),
    "BankHeist": (14.2, 753.1),
    "BattleZone": (2360.0, 37187.5),
    "BeamRider": (363.88, 16926.5),
    "Berzerk": (123.65, 2630.4),
    "Bowling": (23.11, 160.7),
    "Boxing": (0.05, 12.1),
    "Breakout": (1.72, 30.5),
    "Centipede": (2090.87, 12017.0),
    "ChopperCommand": (811.0, 7387.8),
    "CrazyClimber": (10780.5, 35829.4),
    "Defender": (2874.5, 18688.9),
    "DemonAttack": (152.07, 1971.0),
    "DoubleDunk": (-18.55, -16.4),
    "Enduro": (0.0, 860.5),
    "FishingDerby": (-91.71, -38.7),
    "Freeway": (0.01, 29.6),
    "Frostbite": (65.2, 4334.7),
    "Gopher": (257.6, 2412.5),
    "Gravitar": (173.0, 3351.4),
    "Hero": (1026.97, 30826.4),
    "IceHockey": (-11.15, 0.9),
    "Jamesbond": (29.0, 302.8),
    "Kangaroo": (52.0, 3035.0),
    "Krull": (1598.05, 2665.5),
    "KungFuMaster": (258.5, 22736.3),
    "MontezumaRevenge": (0.0, 4753.3),
    "MsPacman": (307.3, 6951.6),
    "NameThisGame": (2292.35, 8049.0),
    "Phoenix": (761.4, 7242.6),
    "Pitfall": (-229.44, 6463.7),
    "Pong": (-20.71, 14.6),
    "PrivateEye": (24.94, 69571.3),
    "Qbert": (163.88, 13455.0),
    "Riverraid": (1338.5, 17118.0),
    "RoadRunner": (11.5, 7845.0),
    "Robotank": (2.16, 11.9),
    "Seaquest": (68.4, 42054.7),
    "Skiing": (-17098.09, -4336.9),
    "Solaris": (1236.3, 12326.7),
    "SpaceInvaders": (148.0, 1668.7),
    "StarGunner": (664.0, 10250.0),
    "Surround": (-9.99, 6.53),
    "Tennis": (-23.84, -8.3),
    "TimePilot": (3568.0, 5229.2),
    "Tutankham": (11.43, 167.6),
    "UpNDown": (533.4, 11693.2),
    "Venture": (0.0, 1187.5),
    "VideoPinball": (0.0, 17667.9),
    "WizardOfWor": (563.5, 4756.5),
    "YarsRevenge": (3092.91, 54576.9),
    "Zaxxon": (32.5, 9173.3),
}
# Atari-5 (Aitchison, Sweetser, Hutter 2023; github.com/maitchison/Atari-5): a regression without intercept from five
# games' log scores to the log Atari-57 median, on HNS in percent; its 10-fold cross-validated error is 10.4% of the
# median. Weights rounded from the author's AtariScoreNormalizer (maitchison/PPO, tools/plot_util.py).
ATARI5_WEIGHTS = {"BattleZone": 0.3820, "DoubleDunk": 0.0679, "NameThisGame": 0.3108, "Phoenix": 0.1241, "Qbert": 0.0805}
REFERENCES = [
    "CleanRL `ppo_atari_envpool`, 40M frames: Pong 20.45, Breakout 211, BeamRider 2502.",
    "CleanRL `ppo_atari_envpool_xla_jax_scan`, 40M frames: Pong 20.52, Breakout 424, BeamRider 2861.",
    "RLlib IMPALA, 40M frames (32 workers): Breakout 385, BeamRider 2071, Qbert 4068, SpaceInvaders 719.",
    "RLlib advertises Pong 18 in 3.5M steps (14M frames) for IMPALA.",
]


def game(env_id):
    return env_id.rsplit("-v", 1)[0]


def hns(env_id, score):
    """Human-normalized score: 0 plays like a random agent, 1 like the human tester. None for a game outside the 57."""
    if game(env_id) not in HUMAN_RANDOM:
        return None
    random, human = HUMAN_RANDOM[game(env_id)]
    return (score - random) / (human - random)


def atari5_median(hns_by_game):
    """Predicted Atari-57 median HNS from the five games' HNS ({game: HNS}): log10(1 + median) = sum of
    w_i log10(1 + max(HNS_i, 0)). The fit used HNS in percent (100 = human), so the sum is taken on percents."""
    log_median = sum(w * np.log10(1 + max(100 * hns_by_game[name], 0)) for name, w in ATARI5_WEIGHTS.items())
    return (10**log_median - 1) / 100


def read_csv(path):
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_csv(path, fields, rows):
    """Written to a temporary file and renamed, so an interrupt never leaves half a CSV."""
    with open(path + ".tmp", "w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(path + ".tmp", path)


def key(row):
    return row["env_id"], row["script"], int(row["seed"])


def interrupt(signum, frame):
    raise KeyboardInterrupt(signum)


def read_checkpoint(path):
    """A run's checkpoint: its "global_step" says how far it got, its "args" the budget its learning rate anneals over
    (total_timesteps) and its precision (bf16). None without one."""
    if not os.path.exists(path):
        return None
    import torch  # here, not at the top: seconds to import, and a runner that skips or starts runs never needs it

    return torch.load(path, map_location="cpu", weights_only=True)


def cpu_label(cpuinfo, cores):
    """A CPU as runs.csv records it, from the text of /proc/cpuinfo: its model, core count and the bf16 feature that
    decides the network's precision and much of its speed: "amx_bf16" (Intel AMX), else "avx512_bf16", else
    "no bf16". E.g. 'AMD EPYC (2 cores, avx512_bf16)'. None where the text names no model."""
    lines = cpuinfo.splitlines()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    if not names:
        return None
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    bf16 = next((flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags), "no bf16")
    return f"{names[0]} ({cores} cores, {bf16})"


def this_cpu():
    """This machine's CPU, as runs.csv records it (`cpu_label`); where /proc/cpuinfo names no model (not Linux, or some
    ARM CPUs), the platform's processor name and the core count alone."""
    cpuinfo = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    return cpu_label(cpuinfo, os.cpu_count()) or f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def last_mean(returns):
    return f"mean of last {len(returns[-WINDOW:])} = {np.mean(returns[-WINDOW:]):.1f}" if len(returns) else "no full game yet"


def record(out, run_dir, checkpoint, env_id, script, seed, total_timesteps, flags):
    """Merges a finished run's curve into curves.csv (replacing its old rows) and the run, with its checkpoint's step,
    precision and the flags given after `--`, into runs.csv; returns its returns. Hours count training time only: the
    sum of its sessions (plot_curves.sessions)."""
    curve = plot_curves.read_run(run_dir)
    rows = [
        dict(env_id=env_id, script=script, seed=seed, global_step=step, hours=round(hours, 6), episodic_return=value)
        for step, hours, value in curve
    ]  # hours to 3.6 ms: the CSV is committed
    os.makedirs(out, exist_ok=True)
    curves = [r for r in read_csv(os.path.join(out, "curves.csv")) if key(r) != (env_id, script, seed)] + rows
    write_csv(
        os.path.join(out, "curves.csv"), plot_curves.FIELDS, sorted(curves, key=lambda r: (*key(r), int(r["global_step"])))
    )
    hours = sum(last - first for first, last in plot_curves.sessions(run_dir)) / 3600
    run = dict(
        env_id=env_id,
        script=script,
        seed=seed,
        total_timesteps=total_timesteps,
        global_step=checkpoint["global_step"],
        hours=round(hours, 4),
        episodes=len(rows),
        precision="bfloat16" if checkpoint["args"].get("bf16") else "float32",
        cpu=this_cpu(),
        flags=flags,
    )
    runs = [r for r in read_csv(os.path.join(out, "runs.csv")) if key(r) != (env_id, script, seed)] + [run]
    for r in runs:
        r.setdefault("flags", NOT_RECORDED)
    write_csv(os.path.join(out, "runs.csv"), RUN_FIELDS, sorted(runs, key=key))
    return [value for _, _, value in curve]


def run_all(args, script, extra):
    """Trains every (game, seed) not finished yet, `--jobs` at a time; returns the process exit code."""
    name = os.path.splitext(os.path.basename(script))[0]
    flags = shlex.join(extra)  # as runs.csv records them
    done = {key(r): int(r["global_step"]) for r in read_csv(os.path.join(args.out, "runs.csv"))}
    todo = [(env_id, seed) for env_id in args.env_ids for seed in args.seeds]
    pending, running, failed = [], {}, 0
    for i, (env_id, seed) in enumerate(todo, 1):
        tag = f"[{i}/{len(todo)}] {env_id} seed {seed}"
        run_name = f"{env_id}__{name}__{seed}__atari"
        run_dir = os.path.join(args.runs_dir, "runs", run_name)
        if done.get((env_id, name, seed), -1) >= args.total_timesteps:
            print(f"{tag}: skipped, finished at global_step {done[env_id, name, seed]} ({args.out}/runs.csv)", flush=True)
            continue
        checkpoint = read_checkpoint(os.path.join(run_dir, "checkpoint.pt"))
        step = checkpoint["global_step"] if checkpoint else None
        budget = checkpoint["args"]["total_timesteps"] if checkpoint else None
        horizon = checkpoint["args"].get("anneal_lr_timesteps") if checkpoint else None  # None: annealed over its budget
        if step is not None and horizon is None and budget != args.total_timesteps:  # resumed, its rate would jump back up
            print(
                f"{tag}: failed, {run_dir} was trained for --total-timesteps {budget} (its learning rate anneals to 0 "
                f"there): a budget of {args.total_timesteps} needs its own --runs-dir and --out",
                flush=True,
            )
            failed += 1
        elif step is not None and step >= args.total_timesteps:  # finished, but not recorded (the runner was stopped)
            returns = record(args.out, run_dir, checkpoint, env_id, name, seed, args.total_timesteps, flags)
            print(
                f"{tag}: skipped, finished at global_step {step} per its checkpoint: recorded, {last_mean(returns)}",
                flush=True,
            )
        elif step is None and plot_curves.sessions(run_dir):  # its events would mix with a fresh run's: never reuse them
            print(
                f"{tag}: failed, {run_dir} has no checkpoint to resume (another runner's run, or one that died before "
                "its first checkpoint): remove it to start over",
                flush=True,
            )
            failed += 1
        else:
            pending.append((tag, env_id, seed, run_name, run_dir, step))
    os.makedirs(args.runs_dir, exist_ok=True)
    # SIGTERM and Ctrl-C stop the runner the same way: the children (in their own sessions, so a terminal's Ctrl-C
    # reaches only the runner) get one SIGTERM each, on which they save a checkpoint to resume from.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    try:
        while pending or running:
            while pending and len(running) < args.jobs:
                tag, env_id, seed, run_name, run_dir, step = pending.pop(0)
                command = [
                    sys.executable,
                    script,
                    "--env-id",
                    env_id,
                    "--seed",
                    str(seed),
                    "--total-timesteps",
                    str(args.total_timesteps),
                    "--run-name",
                    run_name,
                    *extra,
                ]
                if step is not None:
                    command += ["--resume", os.path.abspath(os.path.join(run_dir, "checkpoint.pt"))]
                log_path = os.path.join(args.runs_dir, f"{run_name}.log")
                with open(log_path, "a") as log:
                    log.write(f"### {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(command)}\n")
                    log.flush()
                    process = subprocess.Popen(
                        command, cwd=args.runs_dir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                running[process] = (tag, env_id, seed, run_dir, log_path, time.time())
                print(f"{tag}: {'started' if step is None else f'resumed at global_step {step}'}", flush=True)
            time.sleep(0.2)
            for process in [p for p in running if p.poll() is not None]:
                tag, env_id, seed, run_dir, log_path, start = running.pop(process)
                checkpoint = read_checkpoint(os.path.join(run_dir, "checkpoint.pt"))
                step = checkpoint["global_step"] if checkpoint else None
                if process.returncode == 0 and step is not None and step >= args.total_timesteps:
                    returns = record(args.out, run_dir, checkpoint, env_id, name, seed, args.total_timesteps, flags)
                    minutes = (time.time() - start) / 60
                    print(f"{tag}: finished in {minutes:.1f} min, {last_mean(returns)}", flush=True)
                else:
                    failed += 1
                    stopped = f"exit {process.returncode}" if process.returncode else f"stopped at global_step {step}"
                    print(f"{tag}: failed ({stopped}), see {log_path}", flush=True)
    except KeyboardInterrupt as e:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the children's saving short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for process in running:
            process.send_signal(signal.SIGTERM)
        for process, (tag, *_) in running.items():
            process.wait()
            print(f"{tag}: stopped (exit {process.returncode}); the same command resumes it", flush=True)
        return 128 + e.args[0]
    return 1 if failed else 0


def mean_std(values, digits):
    """'mean ± sample std' (ddof=1); the mean alone for one value; '-' for none."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{np.mean(values):.{digits}f} ± {np.std(values, ddof=1):.{digits}f}"


def report(args, script):
    """Writes results.md and the per-game PNGs from the out folder's CSVs alone (the runs folder only for notes)."""
    curves = read_csv(os.path.join(args.out, "curves.csv"))
    runs = {key(r): r for r in read_csv(os.path.join(args.out, "runs.csv"))}
    returns = {}  # {(env_id, script, seed): returns up to the budget, in step order}
    for r in sorted(curves, key=lambda r: int(r["global_step"])):
        if int(r["global_step"]) <= args.total_timesteps:
            returns.setdefault(key(r), []).append(float(r["episodic_return"]))
    frames = plot_curves.count(args.total_timesteps * plot_curves.frames_per_step(args.env_ids[0]))
    name = os.path.splitext(os.path.basename(script))[0]
    scripts = [name] + sorted({s for _, s, _ in runs} - {name})
    # The table holds every recorded run, so that a runner started on a few games keeps the others' rows; the list of
    # unfinished runs covers only the games and seeds asked for.
    recorded = {e for e, _, _ in runs} - set(args.env_ids)
    env_ids = args.env_ids + [g for g in GAMES if g in recorded] + sorted(recorded - set(GAMES))
    lines = [
        f"# Atari benchmark: {args.total_timesteps:,} steps ({frames} frames) per run",
        "",
        (
            f"Each seed's score is the mean of its last {WINDOW} full-game returns at or before the budget; cells give the "
            "mean ± sample standard deviation (ddof=1) over seeds. HNS = (score - random) / (human - random) per seed "
            "(random and human scores of Badia et al. 2020), then mean ± std. Wall time: training time per run, the mean "
            "over its seeds on each machine (below the table)."
        ),
        "",
        f"| game | script | seeds | mean of last {WINDOW} returns | HNS | wall time per run | notes |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    # Wall time depends on the machine and the precision: a benchmark filled over several machines labels them A, B, ...
    finished_runs = [r for r in runs.values() if int(r["global_step"]) >= args.total_timesteps]
    machines = sorted({machine(r) for r in finished_runs})
    labels = {m: chr(ord("A") + i) for i, m in enumerate(machines)} if len(machines) > 1 else {}
    unfinished, hns_by_seed = [], {}  # hns_by_seed: {script: {seed: {game: HNS}}}
    for env_id in env_ids:
        for script_name in scripts:
            finished, scores, hns_values, notes = [], [], [], []
            seeds = sorted(set(args.seeds) | {seed for e, s, seed in runs if (e, s) == (env_id, script_name)})
            for seed in seeds:
                run = runs.get((env_id, script_name, seed))
                if run is None or int(run["global_step"]) < args.total_timesteps:
                    asked = env_id in args.env_ids and seed in args.seeds
                    if asked and (run is not None or script_name == name):  # other scripts: only their recorded runs
                        unfinished.append((env_id, script_name, seed, run))
                    continue
                finished.append(run)
                if int(run["total_timesteps"]) != args.total_timesteps:
                    notes.append(f"seed {seed}: trained for {int(run['total_timesteps']):,} steps")
                games = returns.get((env_id, script_name, seed), [])
                if len(games) < WINDOW:
                    notes.append(f"seed {seed}: {len(games)} games" if games else f"seed {seed}: no full game (not scored)")
                if games:
                    scores.append(np.mean(games[-WINDOW:]))
                if games and hns(env_id, scores[-1]) is not None:
                    hns_values.append(hns(env_id, scores[-1]))
                    hns_by_seed.setdefault(script_name, {}).setdefault(seed, {})[game(env_id)] = hns_values[-1]
            if finished:
                lines.append(
                    f"| {env_id} | {script_name} | {len(finished)} | {mean_std(scores, 1)} | "
                    f"{mean_std(hns_values, 3)} | {wall_time(finished, labels)} | {'; '.join(notes)} |"
                )
    if labels:
        lines += ["", "Machines (CPU, the network's precision):", ""]
        for m in machines:
            count = sum(machine(r) == m for r in finished_runs)
            lines.append(f"- {labels[m]}: {m}; {count} run{'s' if count > 1 else ''}")
    elif machines and machines != ["machine not recorded"]:
        lines += ["", f"Every run on one machine: {machines[0]}."]
    configurations = recorded_flags(finished_runs)
    if configurations:
        given = ", ".join(f"`{flags}`" if flags else "none (the script's defaults)" for flags in configurations)
        lines += ["", f"Flags given to the runs (after `--`): {given}."]
    lines += atari5_lines(hns_by_seed)
    if unfinished:
        lines += ["", f"Not finished at {args.total_timesteps:,} steps (not in the table):", ""]
    for env_id, script_name, seed, run in unfinished:
        checkpoint = read_checkpoint(
            os.path.join(args.runs_dir, "runs", f"{env_id}__{script_name}__{seed}__atari", "checkpoint.pt")
        )
        at = f"checkpoint at global_step {checkpoint['global_step']}" if checkpoint else "no checkpoint"
        recorded = f"recorded at global_step {run['global_step']}; " if run else ""
        lines.append(f"- {env_id} {script_name} seed {seed}: {recorded}{at}")
    lines += ["", f"## References (other budgets: ours is {frames} frames per run)", ""] + [f"- {r}" for r in REFERENCES]
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    rows = [r for r in curves if r["env_id"] in env_ids and int(r["global_step"]) <= args.total_timesteps]  # as scored
    machine_of = {run_key: machine(run) for run_key, run in runs.items()}  # the hours panel: one line per machine
    return [os.path.join(args.out, "results.md")] + (plot_curves.plot(rows, WINDOW, args.out, machine_of) if rows else [])


def machine(run):
    """The machine a run finished on (CPU, precision), as runs.csv records it; "machine not recorded" for older rows."""
    if not run.get("cpu"):
        return "machine not recorded"
    return f"{run['cpu']}, {run['precision']}"


def wall_time(finished, labels):
    """The mean training time of a table row's runs; per machine, each with its label, where there are several."""
    if not labels:
        return plot_curves.duration(np.mean([float(run["hours"]) for run in finished]))
    hours = {}
    for run in finished:
        hours.setdefault(machine(run), []).append(float(run["hours"]))
    return ", ".join(f"{plot_curves.duration(np.mean(hours[m]))} ({labels[m]})" for m in sorted(hours))


def atari5_lines(hns_by_seed):
    """The Atari-5 estimate per script holding all five games: on the mean-over-seeds HNS, and per seed."""
    lines = []
    for script_name, seeds in sorted(hns_by_seed.items()):
        by_game = {name: [s[name] for s in seeds.values() if name in s] for name in ATARI5_WEIGHTS}
        if not all(by_game.values()):
            continue
        estimate = atari5_median({name: np.mean(values) for name, values in by_game.items()})
        complete = sorted(seed for seed, s in seeds.items() if set(ATARI5_WEIGHTS) <= set(s))
        per_seed = [atari5_median(seeds[seed]) for seed in complete]
        values = ", ".join(f"{value:.3f}" for value in per_seed)
        if len(per_seed) > 1:
            values += f"; mean {mean_std(per_seed, 3)}"
        lines.append(
            f"- {script_name}: {estimate:.3f} from the mean-over-seeds HNS of each game; per seed "
            f"(seeds {', '.join(map(str, complete))}): {values}"
        )
    if not lines:
        return []
    return [
        "",
        "## Atari-5 estimate of the Atari-57 median HNS",
        "",
        (
            "Aitchison, Sweetser, Hutter 2023: log10(1 + median) = sum of w_i log10(1 + max(HNS_i, 0)) with HNS in percent, "
            f"weights {', '.join(f'{name} {w:.4f}' for name, w in ATARI5_WEIGHTS.items())}; "
            "about 10% error (cross-validated)."
        ),
        "",
    ] + lines


def recorded_flags(runs):
    """The distinct flags runs.csv rows record, sorted; rows from before the column record none."""
    return sorted({r.get("flags") for r in runs} - {None, NOT_RECORDED})


def described(flags):
    return f"'{flags}'" if flags else "none"


def parse_args(argv):
    """The runner's flags, and the flags after the first `--`, passed verbatim to every run."""
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env-ids", nargs="+", default=GAMES, help="EnvPool Atari ids")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--total-timesteps", type=int, default=2_500_000, help="steps per run (an Atari step is 4 frames)")
    parser.add_argument("--script", default="impala_poly.py", help="training script, relative to the repo root or absolute")
    parser.add_argument("--out", default="results/atari", help="curves.csv, runs.csv, results.md and the PNGs (committed)")
    parser.add_argument("--runs-dir", default="runs/atari", help="where the runs start: runs/<run_name>/ and <run_name>.log")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    parser.add_argument("--report-only", action="store_true", help="run nothing: redraw the table and curves from --out")
    args = parser.parse_args(argv)
    script = args.script if os.path.isabs(args.script) else os.path.join(ROOT, args.script)
    envpool_ids = set(envpool.list_all_envs())
    for env_id in args.env_ids:
        if env_id not in envpool_ids or "repeat_action_probability" not in envpool.make_spec(env_id).config._fields:
            parser.exit(2, f"error: unknown game {env_id!r}: pass EnvPool Atari ids such as Pong-v5 or Qbert-v5\n")
    if not os.path.isfile(script):
        parser.exit(2, f"error: --script {args.script}: no such file (give it relative to {ROOT} or absolute)\n")
    if args.jobs < 1 or args.total_timesteps < 1:
        parser.exit(2, f"error: --jobs and --total-timesteps must be positive, got {args.jobs} and {args.total_timesteps}\n")
    owned = {"--env-id", "--seed", "--total-timesteps", "--run-name", "--resume"} & {flag.split("=")[0] for flag in extra}
    if owned:
        parser.exit(2, f"error: {', '.join(sorted(owned))} after -- : the runner sets these for each run\n")
    # One configuration per out folder: its table and Atari-5 estimate must not mix runs trained with other flags.
    flags = shlex.join(extra)
    other = [f for f in recorded_flags(read_csv(os.path.join(args.out, "runs.csv"))) if f != flags]
    if other and not args.report_only:  # a report trains nothing: it redraws whatever the folder holds
        parser.exit(
            2,
            f"error: {args.out}/runs.csv holds runs trained with {described(other[0])} after --, these would have "
            f"{described(flags)}: give each configuration its own --out and --runs-dir\n",
        )
    return args, script, extra


if __name__ == "__main__":
    args, script, extra = parse_args(sys.argv[1:])
    exit_code = 0 if args.report_only else run_all(args, script, extra)
    if exit_code <= 1:  # not interrupted (128 + signal): the report covers every run that was due
        os.makedirs(args.out, exist_ok=True)
        for path in report(args, script):
            print("wrote", path)
    sys.exit(exit_code)
