"""Ctrl-C and SIGTERM, once or in bursts, at any moment: the run stops once, saves its checkpoint and exits cleanly.

A burst is what a user's double Ctrl-C, GNU `timeout` (the child, then its group), a scheduler or torchrun sends: the
signals back to back, to the process or to its whole process group (mono's actor processes included). Each run must
exit within a bound, print one "interrupted" and one "saved" line and no traceback, and leave a checkpoint that loads,
at the step the "saved" line names.
"""

import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import impala_mono
import impala_poly
from helpers import CARTPOLE_FLAGS, ROOT, handles_sigterm, run_with_signals, train

SCRIPTS = ["impala_mono.py", "impala_poly.py"]
ENDLESS = ["--env-id", "CartPole-v1", "--total-timesteps", 10**9, "--anneal-lr-timesteps", 10**9]  # a signal ends it


def started(pid, stdout):
    """The script's handlers are in place (its first act): the run is still setting up."""
    return handles_sigterm(pid)


def training(delay):
    """The run has printed its first line (set up, threads starting) `delay` seconds ago."""
    seen = []

    def moment(pid, stdout):
        if not seen and stdout:
            seen.append(time.monotonic())
        return bool(seen) and time.monotonic() - seen[0] >= delay

    return moment


def interrupted(pid, stdout):
    """The run has printed its "interrupted" line: it is shutting down and about to save."""
    return "interrupted at global_step=" in stdout


def check_stopped_once(result, tmp_path):
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, result.stderr[-3000:]
    stops = re.findall(r"^interrupted at global_step=(\d+)$", result.stdout, re.M)
    saves = re.findall(r"^saved (\S+) at global_step=(\d+) ", result.stdout, re.M)
    assert len(stops) == 1 and len(saves) == 1, result.stdout
    path, step = saves[0]
    assert int(step) >= int(stops[0])
    checkpoint = torch.load(os.path.join(tmp_path, path), weights_only=True)
    assert checkpoint["global_step"] == int(step)


def bursts(seed, count):
    """`count` plans of signals, drawn at random: (moment, signals, to_group) as run_with_signals takes them, where
    the moment is at start-up, in training, or right after the "interrupted" line that a first signal caused."""
    rng = random.Random(seed)
    plans = []
    for _ in range(count):
        signals = [rng.choice([signal.SIGINT, signal.SIGTERM]) for _ in range(rng.choice([2, 3, 10]))]
        to_group = rng.random() < 0.5
        kind = rng.choice(["started", "training", "interrupted"])
        if kind == "started":
            plans.append([(started, signals, to_group)])
        elif kind == "training":
            plans.append([(training(rng.uniform(0.0, 1.5)), signals, to_group)])
        else:
            plans.append([(training(rng.uniform(0.0, 1.0)), [signal.SIGTERM], False), (interrupted, signals, to_group)])
    return plans


FAST = {  # functions: a `training` moment keeps its own state, so each run gets a new one
    "start-up": lambda: [(started, [signal.SIGINT, signal.SIGINT], False)],  # Ctrl-C twice while the run sets up
    "training": lambda: [(training(0.5), [signal.SIGINT, signal.SIGINT], True)],  # timeout -s INT: child, then group
    "shutdown": lambda: [(training(0.3), [signal.SIGTERM], False), (interrupted, [signal.SIGINT, signal.SIGTERM] * 5, True)],
}


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("plan", FAST)
def test_signals_stop_the_run_once(tmp_path, script, plan):
    result = run_with_signals(script, *ENDLESS, *CARTPOLE_FLAGS[script], cwd=tmp_path, bursts=FAST[plan]())
    check_stopped_once(result, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("index", range(20))
def test_random_bursts_stop_the_run_once(tmp_path, script, index):
    plan = bursts(seed=1000 * SCRIPTS.index(script) + index, count=20)[index]
    result = run_with_signals(script, *ENDLESS, *CARTPOLE_FLAGS[script], cwd=tmp_path, bursts=plan)
    check_stopped_once(result, tmp_path)


@pytest.mark.parametrize("script", [impala_mono, impala_poly], ids=["mono", "poly"])
def test_from_the_third_signal_on_each_says_what_the_run_waits_for(script, capfd):
    """The handler itself, called as the interpreter calls it: it counts, never raises, and from the third signal on
    writes one line naming what the shutdown waits for (straight to stderr: the signal may land inside a print)."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        signals = script.StopSignals()
        assert signal.getsignal(signal.SIGTERM) == signals.handle
        signals.waiting_for = "the checkpoint to be written to runs/x/checkpoint.pt"
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGINT, signal.SIGTERM):
            signals.handle(signum, None)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    assert signals.received == 4
    assert capfd.readouterr().err.splitlines() == [
        f"{name}: stopping; waiting for the checkpoint to be written to runs/x/checkpoint.pt (SIGKILL stops without saving)"
        for name in ("SIGINT", "SIGTERM")
    ]


@pytest.mark.slow
def test_torchrun_group_signalled(tmp_path):
    """torchrun signalled as a job is (its process group, a burst): it passes the stop to both ranks (each in a session
    of its own), which stop at the same update; rank 0 saves parameters identical on both."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    flags = [*ENDLESS, *CARTPOLE_FLAGS["impala_poly.py"]]
    process = subprocess.Popen(
        [*command, os.path.join(ROOT, "impala_poly.py"), *map(str, flags)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    first_line = process.stdout.readline()
    assert ": training on 2 x cpu" in first_line, first_line
    time.sleep(1.0)
    for signum in [signal.SIGTERM, signal.SIGINT, signal.SIGTERM] * 3:
        os.killpg(process.pid, signum)
    try:
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    stdout = first_line + stdout
    stops = re.findall(r"^interrupted at global_step=(\d+)$", stdout, re.M)
    saves = re.findall(r"^saved (\S+) at global_step=(\d+), parameters identical on all 2 ranks ", stdout, re.M)
    assert len(stops) == 1 and len(saves) == 1, stdout + stderr[-3000:]
    checkpoint = torch.load(os.path.join(tmp_path, saves[0][0]), weights_only=True)
    assert checkpoint["global_step"] == int(saves[0][1])
    # torchrun reports the signal it got (its own traceback); the ranks raise nothing
    assert "impala_poly.py" not in "".join(re.findall(r"Traceback.*?(?=\n\S)", stderr, re.S)), stderr[-3000:]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_signal_stops_an_evaluation_after_the_games_played(tmp_path, script):
    run_dir = train(script, "CartPole-v1", 80, CARTPOLE_FLAGS[script], tmp_path)
    flags = ["--env-id", "CartPole-v1", "--eval-checkpoint", os.path.join(run_dir, "checkpoint.pt"), "--eval-episodes", 10**6]
    plan = [(lambda pid, stdout: handles_sigterm(pid) and time.sleep(4.0) is None, [signal.SIGINT] * 3, True)]  # 4 s: games
    result = run_with_signals(script, *flags, *CARTPOLE_FLAGS[script], cwd=tmp_path, bursts=plan)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (played,) = re.findall(r"^interrupted after (\d+) of 1000000 games$", result.stdout, re.M)
    assert int(played) > 0
    assert re.search(rf"^CartPole-v1: mean return \S+ \+- \S+ over {played} games ", result.stdout, re.M), result.stdout
