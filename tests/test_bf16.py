"""bfloat16 autocast: one learner update agrees with float32, and the flag's automatic choice is the hardware's."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import impala_mono
import impala_poly
from helpers import breakout_batch, cpu_has_bf16


def computed_in(agent):
    """The dtypes the agent's convolutions, linear layers and LSTM cell output, recorded as it runs: the precision it
    really computes in, whatever decides it."""
    dtypes = set()

    def hook(module, inputs, output):
        dtypes.add((output[0] if isinstance(output, tuple) else output).dtype)

    for module in agent.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear, nn.LSTMCell)):
            module.register_forward_hook(hook)
    return dtypes


@pytest.mark.parametrize("script", [impala_mono, impala_poly], ids=["mono", "poly"])
@pytest.mark.parametrize("use_lstm", [False, True], ids=["cnn", "lstm"])
def test_bf16_update_matches_float32(script, use_lstm):
    """The same parameters and batch in both precisions: the loss terms agree within 0.5%, and the gradient (float32 in
    both) points the same way (cosine >= 0.995) and differs by less than 0.3 x what another batch of the same data
    changes it by: bf16 perturbs an update much less than sampling does. (Measured: 0.1%, 0.998, 0.19.)"""
    torch.manual_seed(0)
    agent32 = script.Agent((4, 84, 84), 4, use_lstm=use_lstm)
    agent16 = script.Agent((4, 84, 84), 4, use_lstm=use_lstm, bf16=True)
    agent16.load_state_dict(agent32.state_dict())
    assert (agent32.dtype, agent16.dtype) == (torch.float32, torch.bfloat16)
    args = script.Args(env_id="Breakout-v5", use_lstm=use_lstm)

    def update(agent, batch):
        loss, stats = script.compute_loss(agent, batch, args)
        agent.zero_grad()
        loss.backward()
        grad = torch.cat([p.grad.flatten() for p in agent.parameters()])
        assert loss.dtype == grad.dtype == torch.float32 and all(p.dtype == torch.float32 for p in agent.parameters())
        return {key: value.item() for key, value in stats.items()}, grad

    batch, other_batch = breakout_batch(agent32, seed=0), breakout_batch(agent32, seed=1)
    dtypes32, dtypes16 = computed_in(agent32), computed_in(agent16)
    (stats32, grad32), (stats16, grad16) = update(agent32, batch), update(agent16, batch)
    _, other_grad32 = update(agent32, other_batch)
    assert dtypes32 == {torch.float32} and torch.bfloat16 in dtypes16  # the reference cannot run in bf16 by accident
    for key in (key for key in stats32 if key.startswith("losses/")):  # the loss terms
        assert stats16[key] == pytest.approx(stats32[key], rel=0.005), (key, stats16[key], stats32[key])
    assert not torch.equal(grad16, grad32)  # bf16 did run
    assert torch.nn.functional.cosine_similarity(grad16, grad32, dim=0) >= 0.995
    assert (grad16 - grad32).norm() < 0.3 * (other_grad32 - grad32).norm()


def test_poly_acting_copy_is_bf16_and_agrees():
    """poly's acting copy holds bf16 parameters (no weight cast per inference batch) and picks from the same
    distribution as the float32 network: logits within 0.05."""
    torch.manual_seed(0)
    agent = impala_poly.Agent((4, 84, 84), 4, bf16=True)
    policy = impala_poly.ActingPolicy(agent)
    assert all(p.dtype == torch.bfloat16 for p in policy.agent.parameters())
    assert all(p.dtype == torch.float32 for p in agent.parameters())  # the learner's stay float32
    reference = copy.deepcopy(agent)
    reference.dtype = torch.float32
    batch = breakout_batch(reference, T=1, B=16)
    obs, first = batch["obs"][0], torch.zeros(16, dtype=torch.bool)
    acting_dtypes, reference_dtypes = computed_in(policy.agent), computed_in(reference)
    _, recorded, _, _ = policy.act(obs, first, ())
    logits = recorded["logits"]
    with torch.no_grad():
        expected = reference(obs[None], first[None], ())["logits"]
    assert (acting_dtypes, reference_dtypes) == ({torch.bfloat16}, {torch.float32})
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected[0], atol=0.05, rtol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's choice")
@pytest.mark.parametrize("script", [impala_mono, impala_poly], ids=["mono", "poly"])
def test_default_follows_the_cpu(script):
    """The default is on exactly where the kernel lists AVX512-BF16 or AMX-BF16 (a ground truth apart from torch's)."""
    assert script.bf16_native() == cpu_has_bf16()
    assert script.Args().bf16 == script.bf16_native()


@pytest.mark.parametrize("script", [impala_mono, impala_poly], ids=["mono", "poly"])
def test_diagnostics(script):
    """stats/value is the mean baseline over the batch's steps; stats/dead_units_i the share of the units of the torso's
    i-th ReLU layer (channels of a conv) that are 0 on every step: all of them when the layer is biased far below 0,
    none when biased far above; a dead first conv layer leaves the layers after it only their biases (dead at 0)."""
    torch.manual_seed(0)
    agent = script.Agent((4, 84, 84), 4)
    args = script.Args(env_id="Breakout-v5")
    batch = breakout_batch(agent)
    layers = [m for m in agent.torso if isinstance(m, (nn.Conv2d, nn.Linear))]  # in the shallow net, each ReLU follows one
    with torch.no_grad():
        values = agent(batch["obs"], torch.zeros(21, 8, dtype=torch.bool), ())["values"]
        x, expected = batch["obs"].flatten(0, 1).float() / 255.0, []
        for layer in layers:
            x = F.relu(layer(x.flatten(1) if isinstance(layer, nn.Linear) else x))  # [N, C, H, W] or [N, units]
            unit_max = x.amax(dim=[d for d in range(x.dim()) if d != 1])  # a unit's largest output over all steps
            expected.append((unit_max <= 0).float().mean().item())
    _, stats = script.compute_loss(agent, batch, args)
    n = len(layers)
    assert stats["stats/value"].item() == pytest.approx(values[:-1].mean().item(), rel=1e-5)
    assert [stats[f"stats/dead_units_{i}"].item() for i in range(1, n + 1)] == pytest.approx(expected)
    assert f"stats/dead_units_{n + 1}" not in stats and 0 < expected[-1] < 1
    first, last = layers[0], layers[-1]
    for layer, bias, dead in ((last, -1e3, [*expected[:-1], 1]), (first, -1e3, [1] * n), (last, 1e3, [1] * (n - 1) + [0])):
        with torch.no_grad():
            layer.bias.fill_(bias)
        stats = script.compute_loss(agent, batch, args)[1]
        assert [stats[f"stats/dead_units_{i}"].item() for i in range(1, n + 1)] == pytest.approx(dead)
