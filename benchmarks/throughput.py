"""Steps/s of the scripts next to raw environment stepping, measured side by side in one run.

    python benchmarks/throughput.py --env-ids Breakout-v5 Pong-v5 CartPole-v1 --seconds 60

Prints, per env, raw gymnasium/ale-py (one env, random actions), raw EnvPool (random actions, async, at poly's pool
settings) and poly's actor loop on that pool with a policy that costs nothing, then a table with a column per network
precision (float32, bf16 autocast): the default network's inference alone and learner alone (batch building and the
copy to the device included), their bare compute (inference of every step plus the learner's update, no env), the
ceiling that compute and EnvPool allow (sharing the cores; with a GPU, side by side), and impala_mono.py and
impala_poly.py with their default flags (poly with --num-envs) and --no-bf16 / --bf16; each figure with its ratio to
that precision's ceiling, and the bf16 / float32 speed-up. Scripts are timed from their own progress lines after a
warm-up, so start-up does not count. Which row is lowest says what limits a box: the envs, the acting loop, or the
learner.

    python benchmarks/throughput.py --env-ids BattleZone-v5 --scripts impala_poly.py --precisions bf16 \
        -- --replay-proportion 3 --clip-coef 0.1 --learning-rate 7.5e-4

Flags after `--` add a row per script run with them (the APPO configuration above), measured beside its default
flags, and a line with their ratio: the one figure that compares a configuration's cost across machines.
"""

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import envpool
import gymnasium as gym
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def raw_gymnasium(env_id, seconds):
    """One gymnasium env (ale-py for Atari: frame skip 4 inside ALE), random actions."""
    import ale_py

    gym.register_envs(ale_py)
    if f"ALE/{env_id}" in gym.registry:
        env = gym.make(f"ALE/{env_id}", repeat_action_probability=0.0)
    else:
        env = gym.make(env_id)
    env.reset(seed=0)
    steps, start = 0, time.time()
    while time.time() - start < seconds:
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        steps += 1
        if terminated or truncated:
            env.reset()
    return steps / (time.time() - start)


def make_pool(env_id, num_envs, batch_size, num_threads):
    return envpool.make(
        env_id, env_type="gymnasium", num_envs=num_envs, batch_size=batch_size, num_threads=num_threads, seed=0
    )


def raw_envpool(env_id, seconds, num_envs, batch_size, num_threads):
    """EnvPool in async mode (recv/send), random actions."""
    pool = make_pool(env_id, num_envs, batch_size, num_threads)
    pool.async_reset()
    rng = np.random.default_rng(0)
    steps, start = 0, time.time()
    while time.time() - start < seconds:
        obs, _, _, _, info = pool.recv()
        pool.send(rng.integers(pool.action_space.n, size=len(info["env_id"])), info["env_id"])
        steps += len(info["env_id"])
    sps = steps / (time.time() - start)
    pool.close()  # its threads must not compete with the scripts measured next
    return sps


def acting_loop_sps(env_id, seconds, num_envs, batch_size, num_threads):
    """Poly's own actor loop (the real `actor_loop`: GameTracker, RolloutAssembler, batching and the queue) on the
    same pool as `raw_envpool`, driven by a policy that costs nothing (uniform random actions, zero logits), with a consumer
    that drops the batches: the most the acting side of poly allows, next to raw EnvPool. Counts the steps in the
    batches taken off the queue after a warm-up of a quarter of `seconds`."""
    sys.path.insert(0, ROOT)
    import collections
    import queue
    import threading
    from types import SimpleNamespace

    import torch

    from impala_poly import Args, actor_loop

    args = Args(env_id=env_id, num_envs=num_envs, env_batch_size=batch_size, num_threads=num_threads)
    envs = make_pool(env_id, num_envs, batch_size, num_threads)
    num_actions = envs.action_space.n

    class FreePolicy:
        agent, version = SimpleNamespace(initial_state=lambda n: ()), 0

        def act(self, obs, first, core_state):
            n = len(first)
            return torch.randint(num_actions, (n,)), {"logits": torch.zeros(n, num_actions)}, core_state, 0

    batch_queue, stop = queue.Queue(maxsize=args.queue_size), threading.Event()
    thread = threading.Thread(
        target=actor_loop, args=(args, envs, FreePolicy(), batch_queue, [], collections.Counter(), stop, torch.device("cpu"))
    )
    thread.start()
    steps, start, counted = 0, time.time(), None
    while time.time() - start < seconds * 1.25:
        batch_queue.get()
        if counted is None and time.time() - start >= seconds / 4:
            counted = time.time()
        elif counted is not None:
            steps += args.unroll_length * args.batch_size
    sps = steps / (time.time() - counted)
    stop.set()
    thread.join()
    envs.close()
    return sps


def network_sps(env_id, seconds, env_batch_size, num_threads, bf16):
    """Steps/s of the default network alone, no env, on the scripts' device (CUDA where there is one): (inference,
    learner). Inference is the acting copy's `act` on batches of `env_batch_size` observations, from numpy to the
    actions back in numpy; the learner is poly's: `stack_rollouts` of B rollouts of T steps (the defaults), the copy to the
    device, `compute_loss`, backward and the RMSProp step. Each gets half of `seconds`, with `num_threads` torch threads."""
    sys.path.insert(0, ROOT)
    import torch

    from impala_poly import ActingPolicy, Agent, Args, compute_loss, stack_rollouts

    torch.set_num_threads(num_threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = envpool.make_spec(env_id)
    args, obs_shape, num_actions = Args(env_id=env_id), spec.observation_space.shape, spec.action_space.n
    T, B = args.unroll_length, args.batch_size
    agent = Agent(obs_shape, num_actions, bf16=bf16).to(device)
    policy = ActingPolicy(agent)
    optimizer = torch.optim.RMSprop(agent.parameters(), lr=args.learning_rate, alpha=args.rmsprop_alpha, eps=args.rmsprop_eps)
    dtype = np.uint8 if len(obs_shape) == 3 else np.float32
    rollouts = [
        dict(
            obs=np.zeros((T + 1, *obs_shape), dtype),
            reward=np.zeros(T + 1, np.float32),
            terminated=np.zeros(T + 1, bool),
            truncated=np.zeros(T + 1, bool),
            action=np.zeros(T + 1, np.int64),
            logits=np.zeros((T + 1, num_actions), np.float32),
            policy_version=np.int64(0),
        )
        for _ in range(B)
    ]
    obs, first = np.zeros((env_batch_size, *obs_shape), dtype), torch.zeros(env_batch_size, dtype=torch.bool, device=device)

    def rate(step, steps_per_call):
        step()  # warm-up: the first call allocates
        calls, start = 0, time.time()
        while time.time() - start < seconds / 2:
            step()
            calls += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        return calls * steps_per_call / (time.time() - start)

    def act():
        action, recorded, _, _ = policy.act(torch.from_numpy(obs).to(device), first, ())
        action.cpu().numpy(), recorded["logits"].cpu().numpy()

    def learn():
        batch = {
            key: value.to(device, non_blocking=True)
            for key, value in stack_rollouts(rollouts, pin_memory=device.type == "cuda").items()
        }
        loss, _ = compute_loss(agent, batch, args)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return rate(act, env_batch_size), rate(learn, T * B)


def script_sps(script, env_id, seconds, warmup, extra=()):
    """Runs a training script and returns its steps/s between the end of the warm-up and `seconds` later; exits with
    the script's own error where it stops before that (a flag it refuses, say)."""
    extra = list(extra)
    with tempfile.TemporaryFile(mode="w+") as stderr:  # a file, not a pipe: a chatty script cannot fill it and stall
        process = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, script), "--env-id", env_id, *extra],
            cwd=os.environ.get("TMPDIR", "/tmp"),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        points = []  # (time, global_step)
        start = time.time()
        exited = None  # still training when the measurement ended
        try:
            for line in process.stdout:
                match = re.match(r"global_step=(\d+) ", line)
                if match and time.time() - start >= warmup:
                    points.append((time.time(), int(match.group(1))))
                    if points[-1][0] - points[0][0] >= seconds:
                        break
            else:  # its output ended: it stopped on its own
                exited = process.wait()
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait()
        if exited:
            stderr.seek(0)
            last = ([line for line in stderr.read().splitlines() if line.strip()] or ["no output on stderr"])[-1]
            sys.exit(f"error: {script} {shlex.join(extra)} exited with {exited} before it was timed: {last}")
    if len(points) < 2:
        return float("nan")
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


if __name__ == "__main__":
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []  # passed verbatim to each script, as atari.py does
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env-ids", nargs="+", default=["Breakout-v5", "Pong-v5", "CartPole-v1"])
    parser.add_argument("--seconds", type=float, default=60.0, help="measuring time of each entry")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds a script runs before it is timed")
    parser.add_argument("--num-envs", type=int, default=32, help="EnvPool pool size (raw and poly)")
    parser.add_argument("--scripts", nargs="+", default=["impala_mono.py", "impala_poly.py"])
    parser.add_argument("--precisions", nargs="+", default=["float32", "bf16"], choices=["float32", "bf16"])
    args = parser.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()  # the network runs on the GPU, EnvPool on the cores: side by side, not sharing
    CEILING = "ceiling: min(EnvPool, compute)" if gpu else "ceiling: 1 / (1 / EnvPool + 1 / compute)"
    for env_id in args.env_ids:
        gym_sps = raw_gymnasium(env_id, args.seconds)
        envpool_sps = raw_envpool(env_id, args.seconds, args.num_envs, args.num_envs // 2, os.cpu_count())
        acting_sps = acting_loop_sps(env_id, args.seconds, args.num_envs, args.num_envs // 2, os.cpu_count())
        rows = {}  # what -> {precision: steps/s}
        for precision in args.precisions:
            inference, learner = network_sps(env_id, args.seconds, args.num_envs // 2, os.cpu_count(), precision == "bf16")
            compute = 1 / (1 / inference + 1 / learner)
            rows.setdefault(f"inference alone, batches of {args.num_envs // 2}", {})[precision] = inference
            rows.setdefault("learner alone (incl. batching and copy)", {})[precision] = learner
            rows.setdefault("bare compute: inference + learner, no env", {})[precision] = compute
            rows.setdefault(CEILING, {})[precision] = min(envpool_sps, compute) if gpu else 1 / (1 / envpool_sps + 1 / compute)
            for script in args.scripts:
                if os.path.exists(os.path.join(ROOT, script)):
                    extra = ["--num-envs", args.num_envs] if script == "impala_poly.py" else []
                    extra.append("--bf16" if precision == "bf16" else "--no-bf16")
                    sps = script_sps(script, env_id, args.seconds, args.warmup, map(str, extra))
                    rows.setdefault(f"{script}, default flags", {})[precision] = sps
                    if flags:
                        sps = script_sps(script, env_id, args.seconds, args.warmup, [*map(str, extra), *flags])
                        rows.setdefault(f"{script}, the flags after --", {})[precision] = sps
        print(
            f"\n{env_id} ({os.cpu_count()} cores): gymnasium + ale-py, 1 env, random actions: {gym_sps:.0f} steps/s; "
            f"EnvPool async, {args.num_envs} envs, random actions: {envpool_sps:.0f} steps/s; poly's actor loop on "
            f"that pool with a free policy: {acting_sps:.0f} steps/s ({acting_sps / envpool_sps:.2f} of raw EnvPool)"
        )
        ceiling = rows[CEILING]
        header = "".join(f" {p + ' (/ ceiling)':>20} |" for p in args.precisions)
        ratio = len(args.precisions) == 2
        print(f"| {'steps/s':<45} |{header}" + (f" {'bf16 / float32':>14} |" if ratio else ""))
        print(f"|{'-' * 47}|" + f"{'-' * 21}:|" * len(args.precisions) + (f"{'-' * 15}:|" if ratio else ""))
        for name, by_precision in rows.items():
            cells = "".join(f" {f'{by_precision[p]:.0f} ({by_precision[p] / ceiling[p]:.2f})':>20} |" for p in args.precisions)
            speedup = f" {by_precision['bf16'] / by_precision['float32']:>14.2f} |" if ratio else ""
            print(f"| {name:<45} |{cells}{speedup}", flush=True)
        for script in args.scripts:
            if f"{script}, the flags after --" in rows:
                with_flags, default = rows[f"{script}, the flags after --"], rows[f"{script}, default flags"]
                ratios = ", ".join(f"{with_flags[p] / default[p]:.2f} ({p})" for p in args.precisions)
                print(f"{script} with {shlex.join(flags)}: {ratios} of its default flags' steps/s", flush=True)
