"""Learning curves from the scripts' tensorboard runs: PNGs, the CSV they were drawn from, and a results table.

    python benchmarks/plot_curves.py runs --out results --target Pong-v5=18   # read runs/, write CSV, PNGs, table
    python benchmarks/plot_curves.py --csv results/curves.csv --out results   # redraw from the CSV alone

Run folders are named `{env_id}__{script}__{seed}__{time}` (as both scripts name them). The runs of one env and
script are drawn together, against environment frames (an Atari step is `frame_skip` = 4 frames) and against hours of
training: each seed's running mean of the last `--window` full-game returns as a thin line over its whole length, and
the mean over seeds as a thick line up to the longest run, a finished seed's last value carried. A resumed run writes
one events file per session; the time between sessions is not counted.
"""

import argparse
import csv
import glob
import os
from collections import defaultdict

import envpool
import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

FIELDS = ["env_id", "script", "seed", "global_step", "hours", "episodic_return"]


def frames_per_step(env_id):
    return getattr(envpool.make_spec(env_id).config, "frame_skip", 1)


def sessions(run_dir):
    """(first, last) wall time of each events file of a run, in time order: one per session (a resume starts one)."""
    spans = []
    for path in sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))):
        accumulator = EventAccumulator(path, size_guidance={"scalars": 0}).Reload()
        wall_times = [e.wall_time for tag in accumulator.Tags()["scalars"] for e in accumulator.Scalars(tag)]
        if wall_times:
            spans.append((min(wall_times), max(wall_times)))
    return sorted(spans)


def read_run(run_dir):
    """[(global_step, hours of training, return)] of one run. Steps come from the folder's events as tensorboard
    shows them (a resume purges what was logged after its checkpoint); time counts only within each session."""
    spans = sessions(run_dir)
    starts = np.array([first for first, _ in spans])
    offsets = np.cumsum([0.0] + [last - first for first, last in spans[:-1]])  # seconds trained before each session
    accumulator = EventAccumulator(run_dir, size_guidance={"scalars": 0}).Reload()
    if "charts/episodic_return" not in accumulator.Tags()["scalars"]:  # stopped before its first full game
        return []
    rows = []
    for event in accumulator.Scalars("charts/episodic_return"):
        session = np.searchsorted(starts, event.wall_time, side="right") - 1
        rows.append((event.step, (offsets[session] + event.wall_time - starts[session]) / 3600, event.value))
    return rows


def read_runs(runs_dir):
    """CSV rows of every run under `runs_dir`."""
    rows = []
    for run_dir in sorted(glob.glob(os.path.join(runs_dir, "*__*__*__*"))):
        env_id, script, seed, _ = os.path.basename(run_dir).split("__")
        rows += [
            dict(env_id=env_id, script=script, seed=int(seed), global_step=step, hours=hours, episodic_return=ret)
            for step, hours, ret in read_run(run_dir)
        ]
    return rows


def running_mean(values, window):
    """Mean of the last `window` values (fewer at the start) at each index."""
    sums = np.cumsum(np.insert(np.asarray(values, dtype=np.float64), 0, 0.0))
    index = np.arange(1, len(values) + 1)
    return (sums[index] - sums[np.maximum(index - window, 0)]) / np.minimum(index, window)


def group(rows):
    """{(env_id, script): {seed: (global_step, hours, return) arrays in step order}}."""
    groups = defaultdict(lambda: defaultdict(list))
    for row in rows:
        groups[row["env_id"], row["script"]][int(row["seed"])].append(
            (int(row["global_step"]), float(row["hours"]), float(row["episodic_return"]))
        )
    return {key: {seed: np.array(sorted(points)).T for seed, points in seeds.items()} for key, seeds in groups.items()}


def summarize(rows, window, targets):
    """One table row per run: frames, hours, mean of the last `window` returns, and the frames and hours at which the
    mean of `window` returns first reached the env's target (`targets`: {env_id: return})."""
    table = []
    for (env_id, script), seeds in sorted(group(rows).items()):
        frame_skip = frames_per_step(env_id)
        for seed, (steps, hours, returns) in sorted(seeds.items()):
            frames = steps * frame_skip
            means = running_mean(returns, window)
            reached = np.nonzero((np.arange(len(returns)) >= window - 1) & (means >= targets.get(env_id, np.inf)))[0]
            table.append(
                dict(
                    env_id=env_id,
                    script=script,
                    seed=seed,
                    frames=int(frames[-1]),
                    hours=hours[-1],
                    episodes=len(returns),
                    final=means[-1],
                    target=targets.get(env_id),
                    frames_to_target=int(frames[reached[0]]) if len(reached) else None,
                    hours_to_target=hours[reached[0]] if len(reached) else None,
                )
            )
    return table


def count(frames):
    return f"{frames / 1e6:.1f}M" if frames >= 100_000 else str(frames)


def duration(hours):
    return f"{hours:.2f} h" if hours >= 1 else f"{hours * 60:.1f} min"


def markdown(table, window):
    lines = [
        f"| env | script | seed | frames | wall time | episodes | mean of last {window} | target | frames to target "
        "| time to target |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        reached = (
            (count(r["frames_to_target"]), duration(r["hours_to_target"])) if r["frames_to_target"] is not None else ("-", "-")
        )
        target = "-" if r["target"] is None else f"{r['target']:g}"
        lines.append(
            f"| {r['env_id']} | {r['script']} | {r['seed']} | {count(r['frames'])} | {duration(r['hours'])} | "
            f"{r['episodes']} | {r['final']:.1f} | {target} | {reached[0]} | {reached[1]} |"
        )
    return "\n".join(lines)


def carried(curves, points=200):
    """Curves [(x, y)] on one grid of `points` x values, from where every curve has a point to where the longest ends.
    Within its own x range a curve is interpolated; past its end it keeps its last value (as np.interp does), so that
    the mean over curves reaches the longest one. Returns the grid [points] and the curves' values [len(curves), points].
    """
    grid = np.linspace(max(x[0] for x, _ in curves), max(x[-1] for x, _ in curves), points)
    return grid, np.array([np.interp(grid, x, y) for x, y in curves])


def draw(ax, curves, color, linestyle, label):
    """Each curve [(x, y)] as a thin line, and their mean (`carried`) as a thick one with the legend's `label`."""
    for x, y in curves:
        ax.plot(x, y, color=color, linestyle=linestyle, linewidth=0.8, alpha=0.35)
    grid, ys = carried(curves)
    ax.plot(grid, ys.mean(axis=0), color=color, linestyle=linestyle, linewidth=2, label=label)


def figure(rows, window, machines=None):
    """The figure of one env's rows: returns against frames (left) and hours of training (right). Each seed's running
    mean is a thin line in its script's colour, the mean over seeds (`carried`) a thick one; the frames panel has one
    mean per script. Hours depend on the machine: with `machines` ({(env_id, script, seed): label}; "machine not
    recorded" for a seed it lacks), the hours panel has one mean per script and machine instead, labelled with the
    machine and drawn in the machine's line style. Returns a matplotlib Figure."""
    from matplotlib.figure import Figure  # here, not at the top: seconds to import, and a runner that only trains never draws

    (env_id,) = {row["env_id"] for row in rows}
    frame_skip = frames_per_step(env_id)
    seeds_by_script = {script: seeds for (_, script), seeds in sorted(group(rows).items())}
    colors = {script: f"C{i}" for i, script in enumerate(seeds_by_script)}
    in_minutes = max(points[1][-1] for seeds in seeds_by_script.values() for points in seeds.values()) < 1
    hour_scale = 60 if in_minutes else 1

    def machine(script, seed):  # None without `machines`: one hours line per script
        return None if machines is None else machines.get((env_id, script, seed), "machine not recorded")

    names = sorted({machine(script, seed) for script, seeds in seeds_by_script.items() for seed in seeds}, key=str)
    styles = {name: ["-", "--", ":", "-."][i % 4] for i, name in enumerate(names)}
    fig = Figure(figsize=(11, 5.5))
    axes = fig.subplots(1, 2, sharey=True)
    for script, seeds in seeds_by_script.items():
        frames = [(points[0] * frame_skip / 1e6, running_mean(points[2], window)) for _, points in sorted(seeds.items())]
        draw(axes[0], frames, colors[script], "-", f"{script}: {len(frames)} seed{'s' * (len(frames) > 1)}")
        hours = {}  # {machine: [(hours, running mean) of each seed that ran on it]}
        for seed, points in sorted(seeds.items()):
            hours.setdefault(machine(script, seed), []).append((points[1] * hour_scale, running_mean(points[2], window)))
        for name in sorted(hours, key=str):
            where = "" if name is None else f", {name}"
            label = f"{script}{where}: {len(hours[name])} seed{'s' * (len(hours[name]) > 1)}"
            draw(axes[1], hours[name], colors[script], styles[name], label)
    axes[0].set_xlabel(f"environment {'frames' if frame_skip > 1 else 'steps'} (millions)")
    axes[1].set_xlabel(f"{'minutes' if in_minutes else 'hours'} of training")
    axes[0].set_ylabel(f"episodic return (mean of last {window})")
    for ax in axes:  # below the panels, where a long machine name covers no curve
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.suptitle(f"{env_id}: thin lines each seed; thick the mean over seeds, a finished seed's last value carried")
    fig.tight_layout()
    return fig


def plot(rows, window, out, machines=None):
    """Writes one PNG per env (`figure`) into `out`; returns their paths. `machines`: as `figure` takes it."""
    paths = []
    for env_id in sorted({row["env_id"] for row in rows}):
        fig = figure([row for row in rows if row["env_id"] == env_id], window, machines)
        paths.append(os.path.join(out, f"{env_id}.png"))
        fig.savefig(paths[-1], dpi=100)
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="?", default="runs", help="folder of run folders (ignored with --csv)")
    parser.add_argument("--csv", help="redraw from this CSV instead of reading runs")
    parser.add_argument("--out", default="results", help="folder for curves.csv, the PNGs and results.md")
    parser.add_argument("--window", type=int, default=100, help="episodes in the running mean")
    parser.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="ENV_ID=RETURN",
        help="report frames and hours until the running mean first reaches RETURN (repeatable)",
    )
    args = parser.parse_args()
    targets = {}
    for target in args.target:
        env_id, _, value = target.partition("=")
        try:
            targets[env_id] = float(value)
        except ValueError:
            parser.exit(2, f"error: --target {target!r} is not ENV_ID=RETURN (e.g. Pong-v5=18)\n")
    if args.csv:
        with open(args.csv) as f:
            rows = list(csv.DictReader(f))
    else:
        rows = read_runs(args.runs)
    if not rows:
        parser.exit(
            1,
            f"error: no episodic returns in {args.csv or args.runs!r}: expected run folders named "
            "{env_id}__{script}__{seed}__{time} with tensorboard events\n",
        )
    os.makedirs(args.out, exist_ok=True)
    if not args.csv:
        with open(os.path.join(args.out, "curves.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, FIELDS)
            writer.writeheader()
            writer.writerows(rows)
    table = markdown(summarize(rows, args.window, targets), args.window)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    for path in plot(rows, args.window, args.out):
        print("wrote", path)
