"""Running the scripts exactly as a user does, and reading what they logged."""

import atexit
import functools
import glob
import json
import multiprocessing
import multiprocessing.forkserver
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import envpool
import numpy as np
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args, cwd, timeout=600, env=None, stop=None):
    """Runs `python script args...` in `cwd` (its runs/ folder lands there), with `env` added to the environment;
    returns the CompletedProcess. The script runs as `__main__` in a new process forked from a server that has already
    imported the libraries (`SERVER`): the same script, flags, environment, folder and sys.path as in a new interpreter,
    without the ~2.5 s of imports each run would pay there (most of the suite's time). A run that sets a variable read
    at an interpreter's or a library's start (`startup_variables`), or IMPALA_TESTS_NEW_INTERPRETER=1, gets a new
    interpreter. With `stop`, a function of the run's stdout so far, checked every second: once it returns True the
    run gets SIGTERM, as from a user's `kill` (it saves its checkpoint and exits)."""
    command = [sys.executable, os.path.join(ROOT, script), *map(str, args)]
    env = {**os.environ, **(env or {})}
    new_interpreter = env.get("IMPALA_TESTS_NEW_INTERPRETER") == "1"
    new_interpreter = new_interpreter or startup_variables(env) != startup_variables(server_environment())
    with tempfile.TemporaryDirectory() as outputs:
        out, err = os.path.join(outputs, "stdout"), os.path.join(outputs, "stderr")
        if new_interpreter:
            with open(out, "w") as f_out, open(err, "w") as f_err:
                process = Popen(command, cwd=cwd, stdout=f_out, stderr=f_err, env=env)
        else:
            process = SERVER.Process(target=run_as_main, args=(command[1:], str(cwd), env, interpreter_path(), out, err))
            process.start()
        deadline = time.monotonic() + timeout
        stopped = False
        while process.is_alive() and time.monotonic() < deadline:
            process.join(min(1.0, max(deadline - time.monotonic(), 0.0)))
            if stop is not None and not stopped and process.is_alive():
                with open(out) as f_out:
                    stopped = stop(f_out.read())
                if stopped:
                    os.kill(process.pid, signal.SIGTERM)
        return collect(process, command, timeout, out, err, kill=process.kill)


def collect(process, command, timeout, out, err, kill):
    """A run's CompletedProcess, from its output files `out` and `err`; if it is still running (past `timeout`), it is
    ended with `kill()` first and TimeoutExpired is raised, with its output."""
    timed_out = process.is_alive()
    if timed_out:
        kill()
        process.join()
    with open(out) as f_out, open(err) as f_err:
        stdout, stderr = f_out.read(), f_err.read()
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, process.exitcode, stdout, stderr)


class Popen(subprocess.Popen):
    """A new interpreter's run, waited on as a forked one (`multiprocessing.Process`'s names), so that `run` treats both
    alike."""

    def is_alive(self):
        return self.poll() is None

    def join(self, timeout=None):
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    @property
    def exitcode(self):
        return self.poll()


# The server that forks the runs, and the libraries it imports once: the scripts' and this module's (the forked
# process imports this module by name, to call run_as_main).
SERVER = multiprocessing.get_context("forkserver")
SERVER.set_forkserver_preload(
    [
        "ale_py",
        "envpool",
        "tensorboard.backend.event_processing.event_accumulator",
        "torch.distributed",
        "torch.multiprocessing",
        "torch.utils.tensorboard",
        "tyro",
    ]
)


def startup_variables(env):
    """The variables an interpreter, its loader or the OpenMP and BLAS runtimes of the preloaded libraries read once,
    at their start: a run that sets them otherwise than the server's start did needs a new interpreter. (The suite's
    collection imports impala_mono, which sets OMP_NUM_THREADS=1 for itself, before the server starts: every run,
    forked or not, then starts with it.)"""
    prefixes = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "LD_")
    return {name: value for name, value in env.items() if name.startswith(prefixes) and name != "PYTHONPATH"}


@functools.cache
def server_environment():
    """Starts the server, at the first run, and returns the environment it started with (later changes to this
    process's environment do not reach it)."""
    multiprocessing.forkserver.ensure_running()
    return dict(os.environ)


@functools.cache
def interpreter_path():
    """sys.path of a new interpreter, less its first entry (the script's folder) and PYTHONPATH's entries."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    probe = subprocess.run(
        [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"], env=env, capture_output=True
    )
    return json.loads(probe.stdout)


def run_as_main(argv, cwd, env, path, out, err):
    """In the forked process: what `python argv...` does in `cwd` under `env`, stdout and stderr written to the files
    `out` and `err`; exits with the script's exit status."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, name in ((1, out), (2, err)):
        with open(name, "wb") as f:
            os.dup2(f.fileno(), fd)
    python_path = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *python_path, *path]
    sys.argv = argv
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException as error:  # printed as the interpreter prints it: from the script's frame on, not runpy's
        frames = error.__traceback__  # (none for a script that does not compile)
        while frames is not None and frames.tb_frame.f_code.co_filename != argv[0]:
            frames = frames.tb_next
        traceback.print_exception(type(error), error, frames)
        code = 1
    threading._shutdown()  # then as the interpreter ends: wait for the threads, run the atexit functions, flush
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_as_main_in_own_group(*args):
    """run_as_main in a process group of its own (as a shell gives each job): signals sent to the group reach the run
    and the processes it forks, not the server or the tests."""
    os.setpgid(0, 0)
    run_as_main(*args)


def handles_sigterm(pid):
    """Whether the process has a handler for SIGTERM (from /proc: its caught-signals mask)."""
    with open(f"/proc/{pid}/status") as f:
        caught = int(next(line.split()[1] for line in f if line.startswith("SigCgt:")), 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def run_with_signals(script, *args, cwd, bursts, timeout=60):
    """Runs `python script args...` in `cwd`, as `run` does but in a process group of its own, and sends it bursts of
    signals: `bursts` is a list of (moment, signals, to_group), sent in order, each once `moment(pid, stdout so far)`
    holds (checked every 5 ms), its signals back to back to the process or (to_group) to its whole group. Returns the
    CompletedProcess; raises TimeoutExpired if the run is not over `timeout` seconds after its start."""
    command = [sys.executable, os.path.join(ROOT, script), *map(str, args)]
    with tempfile.TemporaryDirectory() as outputs:
        out, err = os.path.join(outputs, "stdout"), os.path.join(outputs, "stderr")
        open(out, "w").close()
        process = SERVER.Process(
            target=run_as_main_in_own_group, args=(command[1:], str(cwd), dict(os.environ), interpreter_path(), out, err)
        )
        process.start()
        deadline, pending = time.monotonic() + timeout, list(bursts)
        while process.is_alive() and time.monotonic() < deadline:
            if pending:
                moment, signals, to_group = pending[0]
                with open(out) as f_out:
                    if moment(process.pid, f_out.read()):
                        for signum in signals:
                            (os.killpg if to_group else os.kill)(process.pid, signum)
                        pending.pop(0)
            process.join(0.005)
        return collect(process, command, timeout, out, err, kill=lambda: os.killpg(process.pid, signal.SIGKILL))


def run_dirs(cwd):
    return sorted(glob.glob(os.path.join(cwd, "runs", "*")))


def scalars(run_dir, tag):
    """[(step, value)] logged under `tag` in a run's tensorboard events."""
    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def cpu_has_bf16():
    """Whether the kernel lists native bfloat16 (AVX512-BF16 or AMX-BF16) among this CPU's flags: a ground truth apart
    from torch's own detection, for the scripts' default --bf16."""
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


# (use_lstm, flags, the precision the run must report) for the scripts' updates-then-eval tests on Atari: the
# default precision follows the CPU, --no-bf16 is float32.
DEFAULT_PRECISION = "bfloat16" if cpu_has_bf16() else "float32"
UPDATES_THEN_EVAL_CASES = [
    (False, [], DEFAULT_PRECISION),
    (True, [], DEFAULT_PRECISION),
    (False, ["--no-bf16"], "float32"),
]


# Two updates of 4 envs x 10 steps on CartPole-v1 (mono: 1 actor x 4 envs; poly: a pool of 4), for the tests that run
# both scripts alike.
CARTPOLE_FLAGS = {
    "impala_mono.py": ["--num-actors", 1, "--num-envs-per-actor", 4, "--unroll-length", 10, "--batch-size", 4],
    "impala_poly.py": ["--num-envs", 4, "--num-threads", 1, "--unroll-length", 10, "--batch-size", 4],
}


def error_line(result):
    """The one line a bad-input error must print: stderr, stripped of library warnings."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, result.stderr
    return lines[0]


def train(script, env_id, total_timesteps, flags, cwd, timeout=600, precision=None, env=None, stop=None):
    """Trains `script` on `env_id` for `total_timesteps` steps in `cwd` (which holds no run yet), or until `stop` (see
    `run`); returns its run folder. With `precision`, checks that the run's first line reports that the network's
    forward runs in it."""
    flags = ["--env-id", env_id, "--total-timesteps", total_timesteps, *flags]
    result = run(script, *flags, cwd=cwd, timeout=timeout, env=env, stop=stop)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(cwd)
    first_line = result.stdout.splitlines()[0]
    assert first_line.startswith(os.path.join("runs", os.path.basename(run_dir)) + ": "), first_line
    if precision is not None:
        assert first_line.endswith(f"network forward in {precision}"), first_line
    return run_dir


def steps_to_return(script, env_id, total_timesteps, flags, cwd, threshold, n=20):
    """Trains `script` on `env_id` for `total_timesteps` steps; returns the step at which the mean of `n` consecutive
    full-game returns first reached `threshold` (None if it never did), and the last `n` returns. The run stops early
    once a progress line (every 5 s) shows the mean of its last 20 games at the threshold: those are 20 consecutive
    games of the events too, so the steps after it could not change the answer."""

    def reached_in_progress(stdout):
        means = re.findall(r"episodic_return\(last 20\)=(\S+)\n", stdout)  # whole lines only
        return bool(means) and float(means[-1]) >= threshold

    stop = reached_in_progress if n == 20 else None  # the progress lines speak of 20 games
    run_dir = train(script, env_id, total_timesteps, flags, cwd, timeout=900, stop=stop)
    logged = scalars(run_dir, "charts/episodic_return")
    assert len(logged) >= n, logged
    returns = [value for _, value in logged]
    reached = [step for i, (step, _) in enumerate(logged) if i >= n - 1 and np.mean(returns[i - n + 1 : i + 1]) >= threshold]
    return (reached[0] if reached else None), returns[-n:]


def check_run(run_dir, updates, steps_per_update):
    """The checkpoint and the loss curve of a run that made `updates` updates of `steps_per_update` steps."""
    checkpoint = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)
    assert (checkpoint["global_step"], checkpoint["num_updates"]) == (steps_per_update * updates, updates)
    assert [step for step, _ in scalars(run_dir, "losses/loss")] == [steps_per_update * (i + 1) for i in range(updates)]
    assert all(np.isfinite(value) for _, value in scalars(run_dir, "losses/loss"))


def train_then_eval(script, env_id, flags, cwd, steps_per_update, updates, precision):
    """Trains for `updates` updates, checks the run and that it reports the forward in `precision`, then plays one full
    game in eval mode from its checkpoint. Returns that game's return."""
    run_dir = train(script, env_id, steps_per_update * updates, flags, cwd, precision=precision)
    check_run(run_dir, updates, steps_per_update)
    result = run(
        script,
        "--env-id",
        env_id,
        *flags,
        "--eval-checkpoint",
        os.path.join(run_dir, "checkpoint.pt"),
        "--eval-episodes",
        1,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith(f"{env_id}: mean return "), line
    return float(line.split()[3])


def breakout_batch(agent, T=20, B=8, seed=0):
    """A learner batch [T + 1, B, ...] of real Breakout-v5 frames under random actions (EnvPool, synchronous, after 50
    steps), with behavior logits near the agent's own. Random play scores too rarely to exercise the loss, so rewards
    (+-1, 1 in 10) and episode ends (1 in 20) are drawn at random."""
    envs = envpool.make("Breakout-v5", env_type="gymnasium", num_envs=B, seed=seed)
    rng = np.random.default_rng(seed)
    envs.reset()
    for _ in range(50):
        obs, *_ = envs.step(rng.integers(4, size=B))
    frames, actions = [obs], rng.integers(4, size=(T + 1, B))
    for t in range(T):
        frames.append(envs.step(actions[t])[0])
    envs.close()
    batch = dict(
        obs=torch.from_numpy(np.stack(frames)),
        action=torch.from_numpy(actions),
        reward=torch.from_numpy(rng.choice([-1.0, 0.0, 1.0], p=[0.05, 0.9, 0.05], size=(T + 1, B))).float(),
        terminated=torch.from_numpy(rng.random((T + 1, B)) < 0.05),
        truncated=torch.zeros(T + 1, B, dtype=torch.bool),
    )
    with torch.no_grad():
        logits = agent(batch["obs"], torch.zeros(T + 1, B, dtype=torch.bool), agent.initial_state(B))["logits"]
    batch["logits"] = logits + 0.3 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed))
    if agent.lstm is not None:
        batch["core_state"] = 0.1 * torch.randn(2, B, agent.lstm.hidden_size, generator=torch.Generator().manual_seed(seed))
    return batch


def edited_copy(tmp_path, script, old, new):
    """A copy of `script` (and vtrace.py beside it) in tmp_path/code with each `old` replaced by its `new` (lists for
    several edits; each `old` must occur once): a user's edit. Returns the copy's path."""
    os.makedirs(tmp_path / "code", exist_ok=True)
    with open(os.path.join(ROOT, script)) as f:
        source = f.read()
    edits = [(old, new)] if isinstance(old, str) else list(zip(old, new, strict=True))
    for before, after in edits:
        assert source.count(before) == 1, before
        source = source.replace(before, after)
    with open(tmp_path / "code" / script, "w") as f:
        f.write(source)
    shutil.copy(os.path.join(ROOT, "vtrace.py"), tmp_path / "code")
    return str(tmp_path / "code" / script)
