"""Both scripts' `learn`: one optimizer step per batch, the learning rate's horizon, the stats it accepts, and its
promise that a batch is applied whole or not at all (a non-finite gradient, a step that blows the weights up, or any
error after the step restores the parameters and the optimizer state from before the batch)."""

import copy
import os
import random

import pytest
import torch
from torch.nn.utils import parameters_to_vector

import impala_mono
import impala_poly
from helpers import CARTPOLE_FLAGS as FLAGS
from helpers import edited_copy, error_line, run, scalars, steps_to_return, train
from test_loss import A, rollout_batch

SCRIPTS = [impala_mono, impala_poly]
IDS = ["mono", "poly"]


def setup(script, **flags):
    torch.manual_seed(0)
    args = script.Args(env_id="CartPole-v1", **flags)
    agent = script.Agent((4,), A)
    return args, agent, script.make_optimizer(args, agent), rollout_batch(agent)


def state(agent, optimizer):
    """Copies of the parameters and of the optimizer's per-parameter state, to compare after `learn`."""
    params = [p.detach().clone() for p in agent.parameters()]
    optimizer_state = [{key: value.clone() for key, value in s.items()} for s in optimizer.state.values()]
    return params, optimizer_state


def assert_same_state(before, after):
    (params0, opt0), (params1, opt1) = before, after
    assert all(torch.equal(p0, p1) for p0, p1 in zip(params0, params1, strict=True))
    assert len(opt0) == len(opt1)
    assert all(s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0) for s0, s1 in zip(opt0, opt1))


def counting_loss(script, monkeypatch, bad_call=None, extra=None):
    """Wraps the script's compute_loss: the stat "stats/call" is its call number (1, 2, ...), the loss of call
    `bad_call` is infinite, and `extra(call)` may add stats."""
    calls = []
    compute_loss = script.compute_loss

    def wrapped(agent, batch, args):
        calls.append(batch["obs"].shape[1])
        loss, stats = compute_loss(agent, batch, args)
        stats["stats/call"] = torch.tensor(float(len(calls)))
        if extra is not None:
            stats.update(extra(len(calls)))
        if len(calls) == bad_call:
            loss = loss * float("inf")
            stats["losses/loss"] = loss
        return loss, stats

    monkeypatch.setattr(script, "compute_loss", wrapped)
    return calls


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_one_step_on_the_whole_batch(script, monkeypatch):
    """An update is one loss on all B = 3 rollouts and one optimizer step; its stats are that loss's."""
    args, agent, optimizer, batch = setup(script)
    calls = counting_loss(script, monkeypatch)
    before = state(agent, optimizer)
    stats = script.learn(agent, optimizer, batch, args, global_step=0)
    assert calls == [3]
    assert stats["stats/call"] == 1.0
    assert optimizer.state[next(agent.parameters())]["step"].item() == 1
    assert not torch.equal(before[0][0], next(agent.parameters()))


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
@pytest.mark.parametrize("global_step, horizon, rate", [(0, 1000, 6e-4), (500, 1000, 3e-4), (500, 4000, 5.25e-4),
                                                        (5000, 4000, 0.0), (25_000_000, None, 3e-4)])  # fmt: skip
def test_learning_rate_anneals_over_its_horizon(script, global_step, horizon, rate):
    """--anneal-lr takes --learning-rate (6e-4 here) linearly to 0 over --anneal-lr-timesteps, whatever
    --total-timesteps (1000 here), and stays at 0 past it. By default over 50M steps: the paper's 200M Atari frames."""
    flags = dict(learning_rate=6e-4)
    if horizon is not None:
        flags["anneal_lr_timesteps"] = horizon
    args, agent, optimizer, batch = setup(script, total_timesteps=1000, **flags)
    stats = script.learn(agent, optimizer, batch, args, global_step=global_step)
    assert stats["charts/learning_rate"] == pytest.approx(rate)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(rate)


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_a_non_finite_loss_applies_nothing_of_the_batch(script, monkeypatch):
    """An infinite loss: no step, the parameters and the optimizer state stay those from before the batch (an earlier
    batch's, here), and the error names what was not finite."""
    args, agent, optimizer, batch = setup(script)
    script.learn(agent, optimizer, batch, args, global_step=0)  # an optimizer state to keep
    before = state(agent, optimizer)
    counting_loss(script, monkeypatch, bad_call=1)
    with pytest.raises(FloatingPointError, match=r"^not finite \(loss\)$"):
        script.learn(agent, optimizer, batch, args, global_step=0)
    assert_same_state(before, state(agent, optimizer))


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_any_error_after_the_step_applies_nothing_of_the_batch(script, monkeypatch):
    """Another error than a non-finite one (out of memory, a lost peer in an all-reduce) after the optimizer's step:
    the batch is undone as well, so the checkpoint the run saves as it stops holds no half of it."""
    args, agent, optimizer, batch = setup(script)
    script.learn(agent, optimizer, batch, args, global_step=0)
    before = state(agent, optimizer)
    steps = []

    def failing(agent, batch):
        steps.append(optimizer.state[next(agent.parameters())]["step"].item())
        raise RuntimeError("out of memory")

    monkeypatch.setattr(script, "outputs_finite", failing)
    with pytest.raises(RuntimeError, match="^out of memory$"):
        script.learn(agent, optimizer, batch, args, global_step=0)
    assert steps == [2]  # the step was taken before the error
    assert_same_state(before, state(agent, optimizer))


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_a_step_that_blows_the_weights_up_is_undone(script):
    """A finite gradient times a learning rate of 1e30 gives finite weights whose outputs overflow: not applied."""
    args, agent, optimizer, batch = setup(script, learning_rate=1e30, anneal_lr=False)
    before = state(agent, optimizer)
    with pytest.raises(FloatingPointError) as error:
        script.learn(agent, optimizer, batch, args, global_step=0)
    assert str(error.value) == "not finite after its step (the network's outputs: the step blew the weights up)"
    assert_same_state(before, state(agent, optimizer))


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_stats_may_be_floats_ints_or_0d_tensors(script, monkeypatch):
    extra = lambda call: {"stats/float": 0.5 * call, "stats/int": call, "stats/bool": torch.tensor(call == 1)}  # noqa: E731
    args, agent, optimizer, batch = setup(script)
    counting_loss(script, monkeypatch, extra=extra)
    stats = script.learn(agent, optimizer, batch, args, global_step=0)
    assert (stats["stats/float"], stats["stats/int"], stats["stats/bool"]) == (0.5, 1.0, 1.0)
    assert all(type(value) is float for value in stats.values())


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
@pytest.mark.parametrize(
    "value, kind",
    [(torch.zeros(3), "Tensor (3,)"), (torch.zeros(1, 1), "Tensor (1, 1)"), ("high", "str 'high'")],
    ids=["vector", "1x1", "str"],
)
def test_a_stat_of_another_shape_is_one_error_before_any_step(script, monkeypatch, value, kind):
    args, agent, optimizer, batch = setup(script)
    counting_loss(script, monkeypatch, extra=lambda call: {"stats/mine": value})
    before = state(agent, optimizer)
    with pytest.raises(ValueError) as error:
        script.learn(agent, optimizer, batch, args, global_step=0)
    assert str(error.value) == (
        f"compute_loss's stat 'stats/mine' is {kind}: a stat must be a float, an int or a 0-d tensor (reduce it, e.g. "
        "with .mean())"
    )
    assert_same_state(before, state(agent, optimizer))


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(anneal_lr_timesteps=0), "error: --anneal-lr-timesteps must be positive, got 0"),
        (
            dict(total_timesteps=2000, anneal_lr_timesteps=1000),
            "error: --total-timesteps 2000 runs past --anneal-lr-timesteps 1000, after which the learning rate is 0: "
            "raise --anneal-lr-timesteps, or pass --no-anneal-lr",
        ),
        (dict(clip_coef=0.0), "error: --clip-coef must be positive, got 0.0"),
        (
            dict(clip_coef=1.0),
            "error: --clip-coef 1.0 leaves the ratio no lower bound (1 - clip <= 0): pass a value below 1 (PPO: 0.1-0.2)",
        ),
        (
            dict(clip_coef=0.2, clip_pg_rho_threshold=2.0),
            "error: --clip-pg-rho-threshold 2.0 clips IMPALA's policy gradient, which --clip-coef 0.2 replaces with "
            "the clipped surrogate: pass one of the two",
        ),
        (dict(replay_proportion=-1), "error: --replay-proportion must be 0 (no replay) or more, got -1"),
        (dict(replay_buffer=0), "error: --replay-buffer must be positive, got 0"),
        (
            dict(replay_proportion=3, replay_buffer=2),
            "error: --replay-buffer 2 holds fewer batches than --replay-proportion 3 draws for each update: raise "
            "--replay-buffer",
        ),
        (dict(learning_rate=0.0), "error: --learning-rate must be positive, got 0.0"),
        (dict(rmsprop_eps=0.0), "error: --rmsprop-eps must be positive, got 0.0"),
        (dict(max_grad_norm=0.0), "error: --max-grad-norm must be positive, got 0.0"),
        (dict(max_grad_norm=-40.0), "error: --max-grad-norm must be positive, got -40.0"),
        (dict(clip_rho_threshold=0.0), "error: --clip-rho-threshold must be positive, got 0.0"),
        (dict(clip_pg_rho_threshold=-1.0), "error: --clip-pg-rho-threshold must be positive, got -1.0"),
        (
            dict(resume="a/checkpoint.pt", eval_checkpoint="b/checkpoint.pt"),
            "error: --resume and --eval-checkpoint both name a checkpoint: pass --resume to train on, or "
            "--eval-checkpoint to evaluate",
        ),
    ],
    ids=[
        "horizon",
        "past-horizon",
        "clip-coef",
        "clip-coef-1",
        "two-policy-clips",
        "replay-proportion",
        "replay-buffer",
        "replay-buffer-small",
        "learning-rate",
        "rmsprop-eps",
        "max-grad-norm-0",
        "max-grad-norm-negative",
        "rho-bar-0",
        "pg-rho-bar-negative",
        "resume-and-eval",
    ],
)
def test_bad_learning_flags_are_one_error_before_anything_starts(script, flags, message):
    with pytest.raises(SystemExit) as exit:
        script.check_args(script.Args(env_id="CartPole-v1", **flags))
    assert exit.value.code == message


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_the_first_step_of_the_optimizer(script):
    """The optimizer's rule, checked on its first step from fresh state against its closed form on the clipped gradient
    g: RMSProp's lr * g / (sqrt(1 - alpha) |g| + eps) (torch's: eps outside the root, the paper's epsilon 0.01)."""
    lr = 1e-3
    args, agent, optimizer, batch = setup(script, learning_rate=lr)
    assert type(optimizer) is torch.optim.RMSprop
    twin = copy.deepcopy(agent)
    loss, _ = script.compute_loss(twin, batch, args)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), args.max_grad_norm)
    g = parameters_to_vector(p.grad for p in twin.parameters())
    expected = lr * g / ((1 - args.rmsprop_alpha) ** 0.5 * g.abs() + args.rmsprop_eps)
    before = parameters_to_vector(agent.parameters()).detach()
    script.learn(agent, optimizer, batch, args, global_step=0)
    moved = before - parameters_to_vector(agent.parameters()).detach()
    torch.testing.assert_close(moved, expected, rtol=1e-3, atol=1e-6)
    assert expected.abs().max() > 0.5 * lr  # steps of the learning rate's size, well above the tolerance


@pytest.mark.slow
@pytest.mark.parametrize("script", ["impala_mono.py", "impala_poly.py"])
def test_resuming_with_a_blowing_up_learning_rate_keeps_the_checkpoint(tmp_path, script):
    """Resuming a good checkpoint under --learning-rate 1e30: the first update's step is finite but its weights overflow
    the network's outputs. One error line naming it, no traceback, exit 1, and checkpoint.pt keeps the good weights."""
    run_dir = train(script, "CartPole-v1", 80, FLAGS[script], tmp_path)
    path = os.path.join(run_dir, "checkpoint.pt")
    good = torch.load(path, weights_only=True)
    flags = [*FLAGS[script], "--learning-rate", 1e30, "--resume", path]
    result = run(script, "--env-id", "CartPole-v1", "--total-timesteps", 160, *flags, cwd=tmp_path)
    assert error_line(result) == (
        "error: update 3 at global_step=80 is not finite after its step (the network's outputs: the step blew "
        "the weights up): not applied, the checkpoint keeps the parameters before it; lower --learning-rate or check the "
        "rewards; stopping the run"
    )
    checkpoint = torch.load(path, weights_only=True)
    assert (checkpoint["global_step"], checkpoint["num_updates"]) == (80, 2)
    assert all(torch.equal(checkpoint["model"][key], good["model"][key]) for key in good["model"])
    for saved, kept in zip(checkpoint["optimizer"]["state"].values(), good["optimizer"]["state"].values(), strict=True):
        assert all(torch.equal(saved[key], kept[key]) for key in kept)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["impala_mono.py", "impala_poly.py"])
def test_a_stat_added_to_compute_loss_is_logged_or_named(tmp_path, script):
    """A user's edit to compute_loss: a float and an int stat reach TensorBoard with no other edit; a vector stat stops
    the run before its first update with one error line naming it."""
    old = '        "stats/value": values[:-1].mean(),\n'
    path = edited_copy(tmp_path, script, old, old + '        "stats/my_float": 0.25,\n        "stats/my_int": 3,\n')
    run_dir = train(path, "CartPole-v1", 80, FLAGS[script], tmp_path)
    assert scalars(run_dir, "stats/my_float") == [(40, 0.25), (80, 0.25)]
    assert scalars(run_dir, "stats/my_int") == [(40, 3.0), (80, 3.0)]

    path = edited_copy(tmp_path, script, old, old + '        "stats/my_vector": values.mean(0),\n')
    result = run(path, "--env-id", "CartPole-v1", "--total-timesteps", 80, *FLAGS[script], cwd=tmp_path / "code")
    assert error_line(result) == (
        "error: compute_loss's stat 'stats/my_vector' is Tensor (4,): a stat must be a float, an int or a 0-d tensor "
        "(reduce it, e.g. with .mean()); update 1 not applied; stopping the run"
    )


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_replay_learns_each_fresh_batch_with_stored_ones(script):
    """--replay-proportion 2 of --replay-buffer 3: the fresh batch comes first, then 2 distinct batches of the last 3
    fresh ones (all there are until then), whole; 0 hands the batch on as it is."""
    torch.manual_seed(0)
    random.seed(0)  # the draws
    fresh = [rollout_batch(script.Agent((4,), A), seed=seed) for seed in range(6)]
    for index, batch in enumerate(fresh):
        batch["policy_version"] = torch.full((batch["obs"].shape[1],), index)
    replay = script.Replay(proportion=2, capacity=3)
    for index, batch in enumerate(fresh):
        mixed = replay.mix(batch)
        B = batch["obs"].shape[1]
        drawn = min(2, index)
        assert mixed.keys() == batch.keys()
        assert mixed["obs"].shape[1] == mixed["policy_version"].shape[0] == (1 + drawn) * B
        for key, value in batch.items():  # along dim 1 per step, dim 0 per rollout
            assert torch.equal(value, mixed[key][:B] if value.dim() == 1 else mixed[key][:, :B])
        versions = mixed["policy_version"].view(1 + drawn, B)
        assert (versions == versions[:, :1]).all()  # whole batches
        drawn_versions = versions[1:, 0].tolist()
        assert len(set(drawn_versions)) == drawn and all(max(0, index - 3) <= v < index for v in drawn_versions)
        for k, v in enumerate(drawn_versions, 1):
            assert torch.equal(mixed["obs"][:, k * B : (k + 1) * B], fresh[v]["obs"])
    assert script.Replay(proportion=0, capacity=8).mix(fresh[0]) is fresh[0]


@pytest.mark.learning
@pytest.mark.parametrize("script", ["impala_mono.py", "impala_poly.py"], ids=IDS)
def test_replay_learns_cartpole(tmp_path, script):
    """Experience replay with APPO's clip (`--replay-proportion 3 --clip-coef 0.1`: each batch learned with 3 stored
    ones) learns CartPole-v1 sooner than the defaults: the mean of 20 consecutive full-game returns reaches 400 within
    150k steps. Seeds 1 and 2 reached it after 57k and 52k steps (mono) and 63k and 74k (poly); the defaults after
    111k-132k (mono) and 148k-178k (poly), seeds 1-5."""
    flags = ["--seed", 1, "--replay-proportion", 3, "--clip-coef", 0.1]
    reached, last = steps_to_return(script, "CartPole-v1", 150_000, flags, tmp_path, threshold=400)
    assert reached is not None and reached <= 150_000, (reached, last)
