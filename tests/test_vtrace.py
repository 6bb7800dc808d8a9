"""Tests for vtrace.py against a NumPy ground truth written from the paper's definition.

IMPALA (Espeholt et al. 2018, https://arxiv.org/abs/1802.01561), section 4:
    v_s = V(x_s) + sum_{t=s}^{T-1} (prod_{k=s}^{t-1} gamma_k) (prod_{i=s}^{t-1} c_i) delta_t,
    delta_t = min(rho_bar, rho_t) (r_t + gamma_t V(x_{t+1}) - V(x_t)),  c_i = lambda min(1, rho_i).
The ground truth evaluates this sum directly (not the backward recursion vtrace.py uses).

Run: python -m pytest tests/test_vtrace.py
"""

import numpy as np
import pytest
import torch

import vtrace

SHAPES = [(1, 1), (1, 4), (6, 1), (5, 3), (20, 2), (6, 2, 3)]  # [T, B, ...]
CLIPS = [(1.0, 1.0), (None, None), (0.5, 2.0), (3.7, 2.2)]  # (clip_rho, clip_pg_rho)
LAMBDAS = [1.0, 0.5, 0.0]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-10)}


def ground_truth(log_rhos, discounts, rewards, values, bootstrap_value, clip_rho, clip_pg_rho, lambda_):
    """vs and pg_advantages in float64, from the n-step sum with n running to the end of the unroll."""
    T = values.shape[0]
    rhos = np.exp(np.asarray(log_rhos, np.float64))  # log_rho = -inf gives rho = 0
    clipped_rhos = rhos if clip_rho is None else np.minimum(clip_rho, rhos)
    cs = lambda_ * np.minimum(1.0, rhos)
    values_t_plus_1 = np.concatenate([values[1:], bootstrap_value[None]])  # V(x_{t+1}), V(x_T) = bootstrap
    deltas = clipped_rhos * (rewards + discounts * values_t_plus_1 - values)

    # [T, N] with N running over every batch element (and trailing dims).
    g, c, d, v = (np.asarray(x, np.float64).reshape(T, -1) for x in (discounts, cs, deltas, values))
    vs = np.empty_like(v)
    for s in range(T):
        for b in range(v.shape[1]):
            vs[s, b] = v[s, b] + sum(np.prod(g[s:t, b]) * np.prod(c[s:t, b]) * d[t, b] for t in range(s, T))
    vs = vs.reshape(values.shape)

    vs_t_plus_1 = np.concatenate([vs[1:], bootstrap_value[None]])
    clipped_pg_rhos = rhos if clip_pg_rho is None else np.minimum(clip_pg_rho, rhos)
    pg_advantages = clipped_pg_rhos * (rewards + discounts * vs_t_plus_1 - values)
    return vs, pg_advantages


def make_inputs(shape, seed=0):
    """Seeded float64 arrays: wide log_rhos so clipping is active, discounts with zeros (episode ends)."""
    rng = np.random.default_rng(seed)
    return dict(
        log_rhos=rng.normal(0.0, 2.0, shape),
        discounts=rng.choice([0.0, 0.9, 0.99], size=shape, p=[0.2, 0.4, 0.4]),
        rewards=rng.normal(0.0, 1.0, shape),
        values=rng.normal(0.0, 1.0, shape),
        bootstrap_value=rng.normal(0.0, 1.0, shape[1:]),
    )


def to_torch(arrays, dtype, device="cpu"):
    return {k: torch.tensor(v, dtype=dtype, device=device) for k, v in arrays.items()}


def check_close(actual, expected, dtype):
    np.testing.assert_allclose(actual.detach().cpu().double().numpy(), expected, **TOL[dtype])


def test_ground_truth_matches_hand_worked_example():
    # T=2, B=1, rho = [2, 0.5], rho_bar = pg_rho_bar = 1, lambda = 0.5, V(x_2) = bootstrap = 3.
    # clipped rho = [1, 0.5]; c_0 = 0.5 * min(1, 2) = 0.5.
    # delta_0 = 1   * (1   + 0.5 * 2 - 1) = 1.0
    # delta_1 = 0.5 * (0.5 + 0.9 * 3 - 2) = 0.6
    # v_1 = 2 + 0.6 = 2.6;   v_0 = 1 + delta_0 + gamma_0 c_0 delta_1 = 1 + 1 + 0.5 * 0.5 * 0.6 = 2.15
    # pg_0 = min(1, 2)   * (1   + 0.5 * v_1 - 1) = 1.3
    # pg_1 = min(1, 0.5) * (0.5 + 0.9 * 3   - 2) = 0.6
    arrays = dict(
        log_rhos=np.log([[2.0], [0.5]]),
        discounts=np.array([[0.5], [0.9]]),
        rewards=np.array([[1.0], [0.5]]),
        values=np.array([[1.0], [2.0]]),
        bootstrap_value=np.array([3.0]),
    )
    expected_vs, expected_pg = [[2.15], [2.6]], [[1.3], [0.6]]
    vs, pg = ground_truth(**arrays, clip_rho=1.0, clip_pg_rho=1.0, lambda_=0.5)
    np.testing.assert_allclose(vs, expected_vs, rtol=1e-12)
    np.testing.assert_allclose(pg, expected_pg, rtol=1e-12)
    out = vtrace.from_importance_weights(**to_torch(arrays, torch.float64), lambda_=0.5)
    check_close(out.vs, expected_vs, torch.float64)
    check_close(out.pg_advantages, expected_pg, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lambda_", LAMBDAS)
@pytest.mark.parametrize("clip_rho,clip_pg_rho", CLIPS)
@pytest.mark.parametrize("shape", SHAPES)
def test_from_importance_weights_matches_ground_truth(shape, clip_rho, clip_pg_rho, lambda_, dtype):
    arrays = make_inputs(shape)
    expected_vs, expected_pg = ground_truth(**arrays, clip_rho=clip_rho, clip_pg_rho=clip_pg_rho, lambda_=lambda_)
    out = vtrace.from_importance_weights(
        **to_torch(arrays, dtype), clip_rho_threshold=clip_rho, clip_pg_rho_threshold=clip_pg_rho, lambda_=lambda_
    )
    assert out.vs.shape == shape and out.pg_advantages.shape == shape
    assert out.vs.dtype == dtype and out.pg_advantages.dtype == dtype
    check_close(out.vs, expected_vs, dtype)
    check_close(out.pg_advantages, expected_pg, dtype)


def log_softmax_np(logits):
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def action_log_probs_np(logits, actions):
    return np.take_along_axis(log_softmax_np(logits), actions[..., None], -1)[..., 0]


def run_from_logits(shape, clip_rho, clip_pg_rho, lambda_, dtype, device="cpu", num_actions=4):
    """Call vtrace.from_logits on seeded inputs; check every output against NumPy; return the call."""
    T, B = shape
    rng = np.random.default_rng(1)
    behavior_logits = rng.normal(0.0, 1.5, (T, B, num_actions))
    target_logits = rng.normal(0.0, 1.5, (T, B, num_actions))
    actions = rng.integers(0, num_actions, (T, B))
    arrays = {k: v for k, v in make_inputs(shape, seed=2).items() if k != "log_rhos"}

    behavior_log_probs = action_log_probs_np(behavior_logits, actions)
    target_log_probs = action_log_probs_np(target_logits, actions)
    log_rhos = target_log_probs - behavior_log_probs
    expected_vs, expected_pg = ground_truth(log_rhos, **arrays, clip_rho=clip_rho, clip_pg_rho=clip_pg_rho, lambda_=lambda_)

    target_logits_t = torch.tensor(target_logits, dtype=dtype, device=device, requires_grad=True)
    out = vtrace.from_logits(
        behavior_policy_logits=torch.tensor(behavior_logits, dtype=dtype, device=device),
        target_policy_logits=target_logits_t,
        actions=torch.tensor(actions, device=device),
        **to_torch(arrays, dtype, device),
        clip_rho_threshold=clip_rho,
        clip_pg_rho_threshold=clip_pg_rho,
        lambda_=lambda_,
    )
    check_close(out.behavior_action_log_probs, behavior_log_probs, dtype)
    check_close(out.target_action_log_probs, target_log_probs, dtype)
    check_close(out.log_rhos, log_rhos, dtype)
    check_close(out.vs, expected_vs, dtype)
    check_close(out.pg_advantages, expected_pg, dtype)
    return out, target_logits_t, target_logits, actions


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lambda_", [1.0, 0.5])
@pytest.mark.parametrize("clip_rho,clip_pg_rho", CLIPS)
@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (20, 2)])
def test_from_logits_matches_ground_truth(shape, clip_rho, clip_pg_rho, lambda_, dtype):
    run_from_logits(shape, clip_rho, clip_pg_rho, lambda_, dtype)


def test_from_logits_gradient_flows_only_through_target_log_probs():
    out, target_logits_t, target_logits, actions = run_from_logits((5, 3), 1.0, 1.0, 1.0, torch.float64)
    assert not out.vs.requires_grad and not out.pg_advantages.requires_grad
    assert out.target_action_log_probs.requires_grad
    out.target_action_log_probs.sum().backward()
    # d/dlogits sum_t log softmax(logits_t)[a_t] = onehot(a_t) - softmax(logits_t)
    expected_grad = np.eye(target_logits.shape[-1])[actions] - np.exp(log_softmax_np(target_logits))
    check_close(target_logits_t.grad, expected_grad, torch.float64)


def test_from_importance_weights_outputs_carry_no_gradient():
    inputs = to_torch(make_inputs((5, 3)), torch.float32)
    for tensor in inputs.values():
        tensor.requires_grad_(True)
    out = vtrace.from_importance_weights(**inputs)
    assert not out.vs.requires_grad and not out.pg_advantages.requires_grad
    assert out.vs.grad_fn is None and out.pg_advantages.grad_fn is None


@pytest.mark.parametrize("lambda_", LAMBDAS)
def test_zero_importance_weight_cuts_the_trace(lambda_):
    arrays = make_inputs((6, 2), seed=3)
    arrays["discounts"][:] = 0.9  # no episode ends, so only rho = 0 can cut the trace
    arrays["log_rhos"][2, 0] = -np.inf
    expected_vs, expected_pg = ground_truth(**arrays, clip_rho=1.0, clip_pg_rho=1.0, lambda_=lambda_)
    out = vtrace.from_importance_weights(**to_torch(arrays, torch.float64), lambda_=lambda_)
    check_close(out.vs, expected_vs, torch.float64)
    check_close(out.pg_advantages, expected_pg, torch.float64)
    assert out.vs[2, 0].item() == arrays["values"][2, 0]
    assert out.pg_advantages[2, 0].item() == 0.0

    # Steps before the cut see V(x_2) through delta_1 but nothing from r_2 or later.
    perturbed = {k: v.copy() for k, v in arrays.items()}
    perturbed["rewards"][2:, 0] += 10.0
    perturbed["values"][3:, 0] -= 10.0
    perturbed["bootstrap_value"][0] += 10.0
    perturbed["log_rhos"][3:, 0] += 1.0
    out_perturbed = vtrace.from_importance_weights(**to_torch(perturbed, torch.float64), lambda_=lambda_)
    torch.testing.assert_close(out_perturbed.vs[:3, 0], out.vs[:3, 0], rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_matches_ground_truth(dtype):
    arrays = make_inputs((6, 2, 3))
    expected_vs, expected_pg = ground_truth(**arrays, clip_rho=3.7, clip_pg_rho=2.2, lambda_=0.5)
    out = vtrace.from_importance_weights(
        **to_torch(arrays, dtype, "cuda"), clip_rho_threshold=3.7, clip_pg_rho_threshold=2.2, lambda_=0.5
    )
    assert out.vs.device.type == "cuda" and out.pg_advantages.device.type == "cuda"
    check_close(out.vs, expected_vs, dtype)
    check_close(out.pg_advantages, expected_pg, dtype)
    run_from_logits((5, 3), 1.0, 1.0, 1.0, dtype, device="cuda")
