"""impala_poly.py under torch.distributed: one update on two ranks (gloo), each learning from its own batch, equals a
single-process update with the mean of the two ranks' gradients, computed here."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from test_loss import A, rollout_batch

import impala_poly

ARGS = {"env_id": "CartPole-v1", "max_grad_norm": 1000.0}  # no clipping: clipped, a sum and a mean would agree


def make_agent():
    torch.set_num_threads(1)  # the same float rounding in every process
    torch.manual_seed(0)
    agent = impala_poly.Agent((4,), A)
    args = impala_poly.Args(**ARGS)
    optimizer = torch.optim.RMSprop(agent.parameters(), lr=args.learning_rate, alpha=args.rmsprop_alpha, eps=args.rmsprop_eps)
    return agent, optimizer, args


def one_update(agent, optimizer, args, batch, world_size):
    """The learner's update as impala_poly.py does it: loss, backward, all-reduce across ranks, clip, step."""
    loss, _ = impala_poly.compute_loss(agent, batch, args)
    optimizer.zero_grad()
    loss.backward()
    if world_size > 1:
        assert not impala_poly.all_reduce_gradients(agent, False, world_size)
    torch.nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
    optimizer.step()


def rank_main(rank, world_size, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        agent, optimizer, args = make_agent()
        one_update(agent, optimizer, args, rollout_batch(agent, seed=rank), world_size)
        torch.save(agent.state_dict(), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def gradients(batch):
    """The gradient of the loss on `batch` at the initial parameters, one tensor per parameter."""
    agent, _, args = make_agent()
    loss, _ = impala_poly.compute_loss(agent, batch, args)
    return torch.autograd.grad(loss, list(agent.parameters()))


def update_with(grads):
    """The initial parameters after one RMSProp step with the gradients `grads`."""
    agent, optimizer, _ = make_agent()
    for p, g in zip(agent.parameters(), grads):
        p.grad = g.clone()
    optimizer.step()
    return agent.state_dict()


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_two_ranks_average_their_gradients(tmp_path, one_thread):
    mp.start_processes(rank_main, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]

    agent, _, args = make_agent()
    per_rank = [gradients(rollout_batch(agent, seed=r)) for r in range(2)]
    mean = [(g0 + g1) / 2 for g0, g1 in zip(*per_rank)]
    total = [g0 + g1 for g0, g1 in zip(*per_rank)]
    assert torch.cat([g.flatten() for g in total]).norm() < args.max_grad_norm  # so no clipping hides the scale
    initial = agent.state_dict()
    expected, summed, own = update_with(mean), update_with(total), update_with(per_rank[0])

    def distance(a, b):  # the largest difference between two updates, over all parameters
        return max((a[key] - b[key]).abs().max().item() for key in a)

    step = distance(expected, initial)
    # One torch thread everywhere, so the same float rounding: equal (with threads of their own, the processes' gradients
    # differed by float32 rounding, which RMSProp turned into 4e-4 of the largest step).
    assert all(distance(rank, expected) <= 1e-6 * step for rank in ranks), [distance(rank, expected) / step for rank in ranks]
    # What the test tells apart: a sum (RMSProp's epsilon keeps the step scale-dependent) and one rank's own batch.
    assert distance(summed, expected) > 0.05 * step and distance(own, expected) > 0.05 * step
