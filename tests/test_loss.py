"""Both scripts' `compute_loss` against a reference written from the paper's definitions, apart from vtrace.py.

IMPALA (Espeholt et al. 2018, https://arxiv.org/abs/1802.01561), section 4, for one episode's steps s = t .. e - 1:
    v_s = V(x_s) + sum_{u=s}^{e-1} gamma^{u-s} (prod_{i=s}^{u-1} c_i) delta_u,
    delta_u = min(rho_bar, rho_u) (r_{u+1} + gamma V(x_{u+1}) - V(x_u)),  c_i = lambda min(1, rho_i),
    policy gradient: min(pg_rho_bar, rho_s) (r_{s+1} + gamma v_{s+1} - V(x_s)) grad log pi(a_s | x_s),
or with a clip epsilon (APPO: PPO's clipped surrogate, Schulman et al. 2017, on V-trace's advantages) the gradient of
    min(rho_s A_s, clip(rho_s, 1 - epsilon, 1 + epsilon) A_s),  A_s = r_{s+1} + gamma v_{s+1} - V(x_s),
where x_e is the episode's final obs (V(x_e) = 0 if it terminated, V(x_e) itself if the time limit truncated it) or the
rollout's last obs x_T (the bootstrap). An env ignores the action on a final obs and returns the reset obs: that step is
no transition of any episode and gives no loss. The losses are summed over time and batch (as TorchBeast does): policy
-sum A_s log pi, value 0.5 sum (v_s - V(x_s))^2, entropy bonus over the steps of episodes.

The reference walks each rollout episode by episode with plain loops in float64, and gets its gradients from autograd
on that loop; the scripts' logits and values are taken from their forward (a hook), so both sides see the same network
outputs.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import impala_mono
import impala_poly

T, B, A = 8, 3, 3


def rollout_batch(agent, seed=0):
    """A learner batch [T + 1, B, ...] built by hand. Column 0: a termination at obs 3 (reset obs 4, reward 0);
    column 1: a truncation at obs 5 (reset obs 6, given a stray reward 2.5 that must be ignored) and a termination at
    the last obs; column 2: a final obs first (step 0 is a reset step), then a termination at obs 6. Rewards reach
    +-3 (so reward clipping matters); behavior logits are far from the agent's (so both rho clips bite)."""
    g = torch.Generator().manual_seed(seed)
    terminated = torch.zeros(T + 1, B, dtype=torch.bool)
    truncated = torch.zeros(T + 1, B, dtype=torch.bool)
    terminated[3, 0] = terminated[T, 1] = terminated[6, 2] = True
    truncated[5, 1] = truncated[0, 2] = True
    reward = (torch.rand(T + 1, B, generator=g) * 6 - 3).round(decimals=1)
    reward[0] = 0.0
    reward[4, 0], reward[6, 1], reward[1, 2], reward[7, 2] = 0.0, 2.5, 0.0, 0.0
    batch = {
        "obs": torch.randn(T + 1, B, 4, generator=g),
        "action": torch.randint(A, (T + 1, B), generator=g),
        "reward": reward,
        "terminated": terminated,
        "truncated": truncated,
        "logits": 2.0 * torch.randn(T + 1, B, A, generator=g),
    }
    if agent.lstm is not None:
        batch["core_state"] = 0.1 * torch.randn(2, B, agent.lstm.hidden_size, generator=g)
    return batch


def reference_loss(logits, values, batch, args):
    """The loss terms of one batch, from the definitions in the module docstring. logits [T + 1, B, A] and values
    [T + 1, B] are float64 leaves; the V-trace targets and advantages are constants (no gradient), as in the paper."""
    log_pi = F.log_softmax(logits, dim=-1)
    log_mu = F.log_softmax(batch["logits"].double(), dim=-1)
    V = values.detach().tolist()  # V[t][b]
    gamma, lam = args.gamma, args.vtrace_lambda
    policy_loss = value_loss = entropy = 0.0
    num_steps = 0
    for b in range(B):
        terminated, truncated = batch["terminated"][:, b].tolist(), batch["truncated"][:, b].tolist()
        action = batch["action"][:, b].tolist()
        # r[u]: received on the transition from x_u to x_{u+1}; rho[u] = pi(a_u | x_u) / mu(a_u | x_u).
        r = [batch["reward"][u + 1, b].item() for u in range(T)]
        r = [max(-1.0, min(1.0, r_u)) for r_u in r] if args.reward_clip else r
        rho = [math.exp(log_pi[u, b, action[u]].item() - log_mu[u, b, action[u]].item()) for u in range(T)]
        t = 0
        while t < T:
            if terminated[t] or truncated[t]:  # x_t is a final obs: the env resets, no transition
                t += 1
                continue
            e = next((k for k in range(t + 1, T + 1) if terminated[k] or truncated[k]), T)  # the episode's last obs here
            end_value = 0.0 if terminated[e] else V[e][b]
            next_value = {u: V[u + 1][b] if u + 1 < e else end_value for u in range(t, e)}  # V(x_{u+1})
            vs = {}
            for s in range(t, e):
                vs[s] = V[s][b]
                coef = 1.0
                for u in range(s, e):
                    delta = min(args.clip_rho_threshold, rho[u]) * (r[u] + gamma * next_value[u] - V[u][b])
                    vs[s] += coef * delta
                    coef *= gamma * lam * min(1.0, rho[u])
            for s in range(t, e):
                v_next = vs[s + 1] if s + 1 < e else end_value
                advantage = r[s] + gamma * v_next - V[s][b]
                if args.clip_coef is None:
                    advantage *= min(args.clip_pg_rho_threshold, rho[s])
                    policy_loss = policy_loss - advantage * log_pi[s, b, action[s]]
                else:
                    ratio = (log_pi[s, b, action[s]] - log_mu[s, b, action[s]]).exp()  # APPO: rho[s], with its gradient
                    clipped = ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)
                    policy_loss = policy_loss - torch.min(ratio * advantage, clipped * advantage)
                value_loss = value_loss + 0.5 * (vs[s] - values[s, b]) ** 2
                entropy = entropy - (log_pi[s, b].exp() * log_pi[s, b]).sum()
                num_steps += 1
            t = e
    loss = policy_loss + args.vf_coef * value_loss - args.ent_coef * entropy
    return {
        "losses/policy_loss": policy_loss,
        "losses/value_loss": value_loss,
        "losses/entropy": entropy / num_steps,
        "losses/loss": loss,
    }


def outputs_of(agent):
    """Records the forward's logits and values (with their gradients kept) as compute_loss calls it."""
    recorded = {}

    def hook(module, inputs, output):
        logits, values = output["logits"], output["values"]
        logits.retain_grad()
        values.retain_grad()
        recorded.update(logits=logits, values=values)

    agent.register_forward_hook(hook)
    return recorded


@pytest.mark.parametrize("script", [impala_mono, impala_poly], ids=["mono", "poly"])
@pytest.mark.parametrize("use_lstm", [False, True], ids=["mlp", "lstm"])
@pytest.mark.parametrize("reward_clip", [True, False], ids=["clip", "no-clip"])
@pytest.mark.parametrize(
    "vtrace_lambda, clips, clip_coef",
    [(1.0, (1.0, 1.0), None), (0.6, (1.0, 1.0), None), (0.6, (2.0, 0.5), None), (0.6, (1.0, 1.0), 0.2)],
    ids=["lambda1", "lambda0.6", "lambda0.6-rho2-pg0.5", "lambda0.6-surrogate0.2"],
)
def test_compute_loss_matches_reference(script, use_lstm, reward_clip, vtrace_lambda, clips, clip_coef):
    torch.manual_seed(0)
    agent = script.Agent((4,), A, use_lstm=use_lstm)
    args = script.Args(
        env_id="CartPole-v1",
        use_lstm=use_lstm,
        reward_clip=reward_clip,
        vtrace_lambda=vtrace_lambda,
        clip_rho_threshold=clips[0],
        clip_pg_rho_threshold=clips[1],
        clip_coef=clip_coef,
        gamma=0.9,
        vf_coef=0.7,
        ent_coef=0.05,
    )
    batch = rollout_batch(agent)
    recorded = outputs_of(agent)
    loss, stats = script.compute_loss(agent, batch, args)
    loss.backward()

    logits = recorded["logits"].detach().double().requires_grad_()
    values = recorded["values"].detach().double().requires_grad_()
    expected = reference_loss(logits, values, batch, args)
    expected["losses/loss"].backward()
    for key, value in expected.items():
        assert stats[key].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-6), key
    assert loss.item() == pytest.approx(expected["losses/loss"].item(), rel=1e-5)
    torch.testing.assert_close(recorded["logits"].grad.double(), logits.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(recorded["values"].grad.double(), values.grad, rtol=1e-4, atol=1e-6)

    # The batch exercises what it is built for: rhos on both sides of each clip, rewards outside [-1, 1].
    log_rhos = F.log_softmax(logits.detach()[:-1], -1) - F.log_softmax(batch["logits"][:-1].double(), -1)
    rhos = log_rhos.gather(-1, batch["action"][:-1, :, None]).exp()
    assert (rhos > 2.0).any() and (rhos < 0.5).any()
    assert (batch["reward"].abs() > 1).sum() >= 5
    if clip_coef is not None:  # the surrogate's clip bites on some steps, not all: its share counted apart
        done = batch["terminated"][:-1] | batch["truncated"][:-1]
        log_ratios = F.log_softmax(logits.detach()[:-1], -1) - F.log_softmax(batch["logits"][:-1].double(), -1)
        ratios = log_ratios.gather(-1, batch["action"][:-1, :, None]).squeeze(-1).exp()
        outside = ((ratios - 1).abs() > clip_coef)[~done].double().mean().item()
        assert 0 < outside < 1
        assert stats["stats/surrogate_clipped"].item() == pytest.approx(outside)
