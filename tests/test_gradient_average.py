"""impala_poly.py under torch.distributed: one `learn` update on two ranks (gloo), each learning from its own batch,
equals a single-process update with the mean of the two ranks' gradients, computed here. The agent has a head that
only rank 0's forward uses (no gradient on rank 1) and a parameter no rank uses (no gradient anywhere)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import impala_poly
from test_loss import A, rollout_batch

ARGS = {"env_id": "CartPole-v1", "max_grad_norm": 1000.0}  # no clipping: clipped, a sum and a mean would agree


class AuxAgent(impala_poly.Agent):
    """The script's agent with an extra policy head that only some ranks use, and a parameter that none uses."""

    def __init__(self, use_head):
        super().__init__((4,), A)
        self.head = nn.Linear(4, A)
        self.unused = nn.Parameter(torch.ones(2))
        self.use_head = use_head

    def forward(self, obs, first, core_state):
        output = super().forward(obs, first, core_state)
        if self.use_head:
            output["logits"] = output["logits"] + self.head(obs)
        return output


def make_agent(use_head):
    torch.set_num_threads(1)  # the same float rounding in every process
    torch.manual_seed(0)
    agent = AuxAgent(use_head)
    args = impala_poly.Args(**ARGS)
    return agent, impala_poly.make_optimizer(args, agent), args


def rank_main(rank, world_size, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        agent, optimizer, args = make_agent(use_head=rank == 0)
        impala_poly.learn(agent, optimizer, rollout_batch(agent, seed=rank), args, global_step=0, world_size=world_size)
        torch.save({"model": agent.state_dict(), "optimizer": optimizer.state_dict()}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def gradients(rank):
    """Rank `rank`'s gradient at the initial parameters, one tensor per parameter (zeros where it has none)."""
    agent, _, args = make_agent(use_head=rank == 0)
    loss, _ = impala_poly.compute_loss(agent, rollout_batch(agent, seed=rank), args)
    grads = torch.autograd.grad(loss, list(agent.parameters()), allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(agent.parameters(), grads)]


def update_with(grads):
    """The initial parameters after one RMSProp step with the gradients `grads` (None: the parameter has none)."""
    agent, optimizer, _ = make_agent(use_head=False)
    for p, g in zip(agent.parameters(), grads):
        p.grad = None if g is None else g.clone()
    optimizer.step()
    return agent.state_dict()


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_two_ranks_average_their_gradients(tmp_path, one_thread):
    mp.start_processes(rank_main, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]

    agent, _, args = make_agent(use_head=False)
    names = [name for name, _ in agent.named_parameters()]
    per_rank = [gradients(r) for r in range(2)]
    used = [i for i, name in enumerate(names) if name != "unused"]
    assert all(per_rank[0][i].abs().sum() > 0 for i in used) and per_rank[1][names.index("head.weight")].abs().sum() == 0
    mean = [(g0 + g1) / 2 for g0, g1 in zip(*per_rank)]
    mean[names.index("unused")] = None  # no rank has a gradient for it: as in one process, no step and no state
    total = [g0 + g1 for g0, g1 in zip(*per_rank)]
    assert torch.cat([g.flatten() for g in total]).norm() < args.max_grad_norm  # so no clipping hides the scale
    initial = agent.state_dict()
    expected, summed, own = update_with(mean), update_with(total), update_with(per_rank[0])

    def distance(a, b):  # the largest difference between two updates, over all parameters
        return max((a[key] - b[key]).abs().max().item() for key in a)

    step = distance(expected, initial)
    # One torch thread everywhere, so the same float rounding: equal (with threads of their own, the processes' gradients
    # differed by float32 rounding, which RMSProp turned into 4e-4 of the largest step).
    for rank in ranks:
        assert distance(rank["model"], expected) <= 1e-6 * step, distance(rank["model"], expected) / step
        assert torch.equal(rank["model"]["unused"], initial["unused"])
        assert len(rank["optimizer"]["state"]) == len(names) - 1  # no RMSProp state for the unused parameter
    # What the test tells apart: a sum (RMSProp's epsilon keeps the step scale-dependent) and one rank's own batch.
    assert distance(summed, expected) > 0.05 * step and distance(own, expected) > 0.05 * step
