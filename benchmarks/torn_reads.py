"""How often an impala_mono.py actor acts with a half-copied policy, and what it records when it does.

The learner copies new weights into the actors' shared-memory agent with `load_state_dict` while actor processes may be
in a forward pass, with no lock. This script rebuilds that race: one actor process runs the acting forward (4 envs of
Atari frames, as --num-envs-per-actor 4) on the shared agent in a loop while this process copies two weight sets A and B
into it in turn, one copy every --interval seconds (an update's time). Each forward's logits are compared bit for bit
with A's and B's: neither is a torn read. Printed: forwards, copies, torn reads and their share.

    python benchmarks/torn_reads.py                  # one copy per 0.1 s, as a learner update on 2 CPU cores
    python benchmarks/torn_reads.py --interval 0     # copies back to back: the worst case
"""

import argparse
import copy
import os
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import impala_mono  # noqa: E402


def actor(shared, states, obs, stop, counts):
    torch.set_num_threads(1)
    first = torch.zeros(1, obs.shape[1], dtype=torch.bool)
    references = []
    private = copy.deepcopy(shared)
    for state in states:
        private.load_state_dict(state)
        with torch.no_grad():
            references.append(private(obs, first, ())["logits"])
    forwards = torn = 0
    while not stop.is_set():
        with torch.no_grad():
            logits = shared(obs, first, ())["logits"]
        forwards += 1
        torn += not any(torch.equal(logits, reference) for reference in references)
    counts[0], counts[1] = forwards, torn


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between weight copies")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=impala_mono.bf16_native())
    args = parser.parse_args()
    torch.manual_seed(0)
    agent = impala_mono.Agent((4, 84, 84), 6, bf16=args.bf16)
    state_a = copy.deepcopy(agent.state_dict())
    with torch.no_grad():  # B: every weight moved a little, as an update moves them
        for p in agent.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    state_b = copy.deepcopy(agent.state_dict())
    shared = copy.deepcopy(agent).to(agent.dtype).share_memory()
    shared.load_state_dict(state_a)
    states = [{k: v.to(agent.dtype) for k, v in s.items()} for s in (state_a, state_b)]
    obs = torch.randint(0, 256, (1, 4, 4, 84, 84), dtype=torch.uint8)
    ctx = mp.get_context("fork")
    stop, counts = ctx.Event(), ctx.Array("q", 2)
    process = ctx.Process(target=actor, args=(shared, states, obs, stop, counts))
    process.start()
    time.sleep(2.0)  # the actor's references first
    copies, copy_time, start = 0, 0.0, time.time()
    while time.time() - start < args.seconds:
        copy_start = time.time()
        shared.load_state_dict(state_b if copies % 2 == 0 else state_a)
        copy_time += time.time() - copy_start
        copies += 1
        time.sleep(args.interval)
    stop.set()
    process.join()
    forwards, torn = counts[0], counts[1]
    print(
        f"interval {args.interval} s, {'bf16' if args.bf16 else 'float32'}: {copies} copies of {copy_time / copies * 1e3:.2f} "
        f"ms, {forwards} forwards, {torn} torn ({torn / max(forwards, 1):.2%})"
    )


if __name__ == "__main__":
    main()
