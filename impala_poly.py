"""IMPALA with EnvPool: an async env pool stepped by batched inference, a learner thread, torchrun for many GPUs or nodes.

Paper: https://arxiv.org/abs/1802.01561 (Espeholt et al. 2018). The acting side follows CleanRL's envpool scripts
and Cleanba (async EnvPool, one bounded queue to the learner); the agent and the V-trace loss are impala_mono.py's.

    python impala_poly.py --env-id Breakout-v5
    python impala_poly.py --env-id CartPole-v1 --total-timesteps 1000000 --num-envs 16
    python impala_poly.py --env-id Breakout-v5 --eval-checkpoint runs/<run_name>/checkpoint.pt
    # one machine, 8 GPUs: a pool and a learner per GPU, gradients averaged over them
    torchrun --standalone --nproc-per-node 8 impala_poly.py --env-id Breakout-v5
    # two machines: the same command on each, with --node-rank 1 on the second
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr <first machine> impala_poly.py --env-id Breakout-v5
"""

import ast
import collections
import contextlib
import copy
import importlib.util
import inspect
import os
import queue
import random
import shutil
import signal
import sys
import textwrap
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Literal, Optional

import envpool
import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import tyro
from torch.utils.tensorboard import SummaryWriter

import vtrace


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (actor and environment seeds are offset from it)"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled, the learner runs on CUDA when it is available"""
    track: bool = False
    """if toggled, this experiment will be tracked with Weights and Biases"""
    wandb_project_name: str = "impala"
    """the wandb's project name"""
    wandb_entity: Optional[str] = None
    """the entity (team) of wandb's project"""
    capture_video: bool = False
    """Atari: record games as MP4s under videos/<run_name>/: every game in eval mode, one every `video_interval` in training"""
    video_interval: float = 10.0
    """minutes between the games recorded in training with --capture-video"""
    bf16: bool = field(default_factory=lambda: bf16_native())
    """run the Atari network's forward in bfloat16 (autocast; parameters, optimizer and loss stay float32); default: on
    where the hardware runs bf16 natively. Classic-control MLPs always run in float32 (bf16 made them slower)"""
    env_id: str = "Pong-v5"
    """an Atari id as in EnvPool (`Pong-v5`, `Breakout-v5`, ...) or a gymnasium classic-control id (`CartPole-v1`):
    EnvPool's envs only (impala_mono.py runs any gymnasium env)"""
    total_timesteps: int = 50_000_000
    """total environment steps over all envs and ranks (an Atari step is 4 frames)"""

    # Algorithm specific arguments
    num_envs: int = 64
    """the number of environments in the EnvPool pool of each rank"""
    env_batch_size: Optional[int] = None
    """the number of envs each `recv()` returns (EnvPool's async batch); default: num_envs // 2"""
    num_threads: Optional[int] = None
    """EnvPool worker threads of each rank; default: the CPU cores over the ranks on this machine (classic control: 1)"""
    queue_size: int = 2
    """the most batches waiting for the learner; when it is full the envs wait, which bounds the policy lag"""
    num_torch_threads: Optional[int] = None
    """torch intra-op threads (inference and learner); default: as `num_threads`'s default, half of it with bf16"""

    # Learning arguments: the same names, defaults and docs in both scripts (tests/test_twins.py)
    unroll_length: int = 20
    """the number of steps in each rollout (T)"""
    batch_size: int = 8
    """the number of rollouts (trajectories) in each learner update (B); the paper's 32 learned slower per frame (README)"""
    learning_rate: float = 9e-4
    """the optimizer's learning rate; 1.5 times the paper's 6e-4, which learned slower per frame (README)"""
    anneal_lr: bool = True
    """linearly anneal the learning rate to 0 over `anneal_lr_timesteps`"""
    anneal_lr_timesteps: int = 50_000_000
    """the steps over which --anneal-lr takes the learning rate linearly to 0: the paper's 200M Atari frames, whatever
    --total-timesteps, so that a shorter run learns as the first steps of a full one (README)"""
    replay_proportion: int = 0
    """replayed batches learned with each fresh one, drawn at random from the last `replay_buffer` (LASER, RLlib; 0: off)"""
    replay_buffer: int = 8
    """the fresh batches --replay-proportion draws from: the last this many"""
    clip_coef: Optional[float] = None
    """APPO: PPO's clipped surrogate on V-trace's advantages, the ratio to the acting policy within 1 +- this"""
    rmsprop_alpha: float = 0.99
    """RMSProp smoothing constant"""
    rmsprop_eps: float = 0.01
    """RMSProp epsilon"""
    gamma: float = 0.99
    """the discount factor"""
    ent_coef: float = 0.01
    """coefficient of the entropy bonus"""
    vf_coef: float = 0.5
    """coefficient of the value (baseline) loss"""
    max_grad_norm: float = 40.0
    """the maximum norm for the global gradient clipping"""
    reward_clip: bool = True
    """clip rewards to [-1, 1] in the loss (logged returns stay unclipped)"""
    network: Literal["shallow", "deep"] = "shallow"
    """Atari torso: the Nature CNN ("shallow") or the IMPALA ResNet ("deep")"""
    use_lstm: bool = False
    """add an LSTM core; its state is reset at episode boundaries"""
    episodic_life: bool = True
    """Atari: end an episode (for learning only) when a life is lost"""
    repeat_action_probability: float = 0.0
    """Atari: sticky-action probability"""

    # V-trace arguments
    clip_rho_threshold: float = 1.0
    """rho-bar, the importance weight clip for the value targets"""
    clip_pg_rho_threshold: float = 1.0
    """the importance weight clip in the policy-gradient advantage"""
    vtrace_lambda: float = 1.0
    """lambda, scales the trace coefficients c"""

    # Checkpoints and evaluation
    checkpoint_interval: float = 600.0
    """seconds between checkpoints (one is also written at the end and on Ctrl-C / SIGTERM)"""
    stall_timeout: float = 300.0
    """seconds without a learner update before the run stops with an error that says which side stalled"""
    resume: Optional[str] = None
    """path of a checkpoint.pt to continue (same run folder, step count and schedule; under torchrun rank 0 reads it)"""
    eval_checkpoint: Optional[str] = None
    """path of a checkpoint.pt to evaluate instead of training"""
    eval_episodes: int = 10
    """the number of full games played by evaluation"""

    # to be filled in runtime
    run_name: str = ""
    """the run's folder under runs/ (set from the checkpoint when resuming)"""
    wandb_id: tyro.conf.Suppress[Optional[str]] = None
    """the W&B run's id, kept in the checkpoint so that a resumed run continues it"""


def make_env(args, num_envs, batch_size, seed, num_threads):
    """An EnvPool pool, env i seeded with seed + i; Atari keeps EnvPool's preprocessing (30 no-ops, 4-frame skip, 84x84
    gray, 4 stacked frames, fire reset, 27,000-step cap). After a final obs an env returns the reset obs next, ignoring
    that step's action."""
    kwargs = {"num_envs": num_envs, "batch_size": batch_size, "num_threads": num_threads, "seed": seed}
    if is_atari(args.env_id):  # rewards stay unclipped here: the loss clips them (--reward-clip), the logs do not
        kwargs.update(
            episodic_life=args.episodic_life, repeat_action_probability=args.repeat_action_probability, reward_clip=False
        )
    if args.capture_video:
        kwargs["render_mode"] = "rgb_array"  # full-colour screens for videos
    return envpool.make(args.env_id, env_type="gymnasium", **kwargs)


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x):
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


class ConvSequence(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.pool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.res0, self.res1 = ResidualBlock(out_channels), ResidualBlock(out_channels)

    def forward(self, x):
        return self.res1(self.res0(self.pool(self.conv(x))))


def mlp(in_features, out_features, std, hidden=256):
    return nn.Sequential(
        layer_init(nn.Linear(in_features, hidden)),
        nn.ReLU(),
        layer_init(nn.Linear(hidden, hidden)),
        nn.ReLU(),
        layer_init(nn.Linear(hidden, out_features), std=std),
    )


class Agent(nn.Module):
    """Torso (Nature CNN or IMPALA ResNet for images [C, H, W]), optional LSTM core, policy and baseline heads. Vector
    observations get separate policy and value MLPs of 256 ReLU units (README, implementation details). Observations
    are divided by `obs_scale` (default: 255 for images, 1 for vectors)."""

    def __init__(self, obs_shape, num_actions, network="shallow", use_lstm=False, bf16=False, obs_scale=None):
        super().__init__()
        self.dtype = torch.bfloat16 if bf16 else torch.float32  # what the forward computes in
        self.obs_scale = obs_scale or (1.0 if len(obs_shape) == 1 else 255.0)
        if len(obs_shape) == 1:
            hidden = obs_shape[0]
            self.torso = nn.Sequential()  # empty: the identity
        else:
            if network == "shallow":
                hidden = 512
                convs = [
                    layer_init(nn.Conv2d(obs_shape[0], 32, 8, stride=4)),
                    nn.ReLU(),
                    layer_init(nn.Conv2d(32, 64, 4, stride=2)),
                    nn.ReLU(),
                    layer_init(nn.Conv2d(64, 64, 3, stride=1)),
                    nn.ReLU(),
                    nn.Flatten(),
                ]
            else:
                hidden = 256
                convs = [ConvSequence(obs_shape[0], 16), ConvSequence(16, 32), ConvSequence(32, 32), nn.Flatten(), nn.ReLU()]
            with torch.no_grad():  # the flattened size, from a dummy frame through the layers
                flat_size = nn.Sequential(*convs)(torch.zeros(1, *obs_shape)).shape[1]
            self.torso = nn.Sequential(*convs, layer_init(nn.Linear(flat_size, hidden)), nn.ReLU())
        self.lstm = nn.LSTMCell(hidden, max(hidden, 64)) if use_lstm else None
        core_size = self.lstm.hidden_size if use_lstm else hidden
        if len(obs_shape) == 1:
            self.actor = mlp(core_size, num_actions, std=0.01)
            self.critic = mlp(core_size, 1, std=1.0)
        else:
            self.actor = layer_init(nn.Linear(core_size, num_actions), std=0.01)
            self.critic = layer_init(nn.Linear(core_size, 1), std=1.0)
            self.to(memory_format=torch.channels_last)  # NHWC: the convolutions' fast layout on CPU (README)

    def initial_state(self, batch_size):
        """The core state (h, c), each [B, hidden]; () without an LSTM."""
        return () if self.lstm is None else tuple(torch.zeros(batch_size, self.lstm.hidden_size) for _ in range(2))

    def forward(self, obs, first, core_state):
        """obs [T, B, *obs_shape], first [T, B] (True where an episode starts) -> the outputs by name: logits [T, B, A],
        values [T, B], core_state (after the last step), activations (the output of each of the torso's ReLUs,
        [T * B, ...], for the dead-units diagnostic). A new head is one more key."""
        T, B, *_ = obs.shape
        # Mixed precision: under bf16 autocast, convolutions and matrix products run in bfloat16 on float32 parameters
        # (bf16 has float32's exponent range, so unlike float16 no loss scaling is needed); the outputs go back to float32.
        with torch.autocast(obs.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16):
            x = obs.flatten(0, 1)
            if x.dim() == 4:  # frames: NHWC like the weights, converted while still uint8
                x = x.contiguous(memory_format=torch.channels_last)
            x = x.to(self.dtype) / self.obs_scale
            activations = []
            for layer in self.torso:
                x = layer(x)
                if isinstance(layer, nn.ReLU):
                    activations.append(x)
            x = x.view(T, B, -1)
            if self.lstm is not None:
                h, c = core_state
                outputs = []
                for t in range(T):
                    keep = (~first[t]).float().unsqueeze(-1)  # reset the state where an episode starts
                    h, c = self.lstm(x[t], (h * keep, c * keep))
                    outputs.append(h)
                x, core_state = torch.stack(outputs), (h.float(), c.float())
            logits, values = self.actor(x), self.critic(x).squeeze(-1)
        return {"logits": logits.float(), "values": values.float(), "core_state": core_state, "activations": activations}


def make_agent(args, observation_space, action_space):
    """The agent for the env's spaces and the flags, built here alone: a new `Agent` argument is passed here. uint8
    observations (frames) are scaled to [0, 1]; others go in as they are."""
    obs_scale = 255.0 if observation_space.dtype == np.uint8 else 1.0
    return Agent(observation_space.shape, action_space.n, args.network, args.use_lstm, args.bf16, obs_scale)


# ALGO LOGIC: acting. The env pool's loop (`actor_loop`, below the fence) steps the envs with `act` on the acting copy of
# the agent and records, at each step, the env's fields (obs, reward, terminated, truncated), the action and these
# outputs of the agent's forward on the obs, by name: compute_loss reads each as batch[name], [T + 1, B, ...]. A new
# recorded quantity (the acting policy's values, for a value clip) is one more name.
RECORDED_OUTPUTS = ("logits",)


@torch.no_grad()
def act(agent, obs, first, core_state):
    """The policy's step: obs [n, *obs_shape], first [n] (True where obs starts an episode) -> the action [n] sampled from
    the policy, the RECORDED_OUTPUTS {name: [n, ...]}, the core state after obs."""
    output = agent(obs[None], first[None], core_state)
    action = torch.multinomial(torch.softmax(output["logits"][0], dim=-1), 1).squeeze(-1)
    return action, {key: output[key][0] for key in RECORDED_OUTPUTS}, output["core_state"]


class ActingPolicy:
    """The copy of the agent the envs act with, on the learner's device, given new parameters after every update
    under a lock (no half-copied read). With bf16 it holds bf16 parameters, which autocast would cast anew per batch."""

    def __init__(self, agent, version=0):
        self.agent, self.version, self.lock = copy.deepcopy(agent).to(agent.dtype), version, threading.Lock()

    def act(self, obs, first, core_state):
        """`act` with these parameters (no update halfway through), and their version."""
        with self.lock:
            return *act(self.agent, obs, first, core_state), self.version

    @torch.no_grad()
    def update(self, agent, version):
        with self.lock:
            for acting, learning in zip(self.agent.state_dict().values(), agent.state_dict().values()):
                acting.copy_(learning)
            self.version = version


# ALGO LOGIC: learning
def compute_loss(agent, batch, args):
    """V-trace actor-critic loss on rollouts [T + 1, B, ...].

    Losses are summed over T and B (as in the IMPALA paper and TorchBeast), not averaged; RMSProp divides the
    gradient's scale out, so one learning rate serves batches of 160 (the default) and 640 steps (the paper's).
    """
    done = batch["terminated"] | batch["truncated"]
    output = unroll(agent, batch)
    logits, values = output["logits"], output["values"]  # [T + 1, B, A], [T + 1, B]

    # Move from obs[t] -> reward[t] to action[t] -> reward[t + 1]: step t is (obs[t], action[t], reward[t + 1], obs[t + 1]).
    actions = batch["action"][:-1]
    rewards = batch["reward"][1:].clamp(-1, 1) if args.reward_clip else batch["reward"][1:]
    discounts = (~batch["terminated"][1:]).float() * args.gamma  # a truncated episode bootstraps from its final obs
    target_log_probs = vtrace.action_log_probs(logits[:-1], actions)
    behavior_log_probs = vtrace.action_log_probs(batch["logits"][:-1], actions)
    # On a final obs the env ignores the action and resets: importance weight 0 stops the trace there
    # (vs = V(final obs)) and gives the step no advantage.
    log_rhos = (target_log_probs - behavior_log_probs).masked_fill(done[:-1], float("-inf"))
    vtrace_returns = vtrace.from_importance_weights(
        log_rhos=log_rhos,
        discounts=discounts,
        rewards=rewards,
        values=values[:-1],
        bootstrap_value=values[-1],
        clip_rho_threshold=args.clip_rho_threshold,
        clip_pg_rho_threshold=args.clip_pg_rho_threshold,
        lambda_=args.vtrace_lambda,
    )
    if args.clip_coef is None:  # IMPALA: V-trace's policy-gradient advantages, its clipped rho included
        advantages = vtrace_returns.pg_advantages
    else:  # APPO: the same without rho, for which the clipped surrogate's ratio to the acting policy stands in
        vs_next = torch.cat([vtrace_returns.vs[1:], values[-1:].detach()])
        advantages = (rewards + discounts * vs_next - values[:-1].detach()).masked_fill(done[:-1], 0.0)
    if args.clip_coef is None:
        policy_loss = -(advantages * target_log_probs).sum()
    else:  # PPO's clipped surrogate
        ratio = log_rhos.exp()  # 0 on a final obs, as its advantage
        clipped_ratio = ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)
        policy_loss = -torch.min(ratio * advantages, clipped_ratio * advantages).sum()
    value_loss = 0.5 * ((vtrace_returns.vs - values[:-1]) ** 2).sum()
    entropy = torch.distributions.Categorical(logits=logits[:-1]).entropy()[~done[:-1]]
    loss = policy_loss + args.vf_coef * value_loss - args.ent_coef * entropy.sum()
    stats = {
        "losses/policy_loss": policy_loss,
        "losses/value_loss": value_loss,
        "losses/entropy": entropy.mean(),
        "losses/loss": loss,
        "stats/value": values[:-1].mean(),
        # the share of steps whose importance weight rho-bar clipped (with rho-bar 1: where the learning policy is likelier
        # than the acting one to take the action; near half once the two differ at all)
        "stats/rho_clipped": (log_rhos[~done[:-1]] > np.log(args.clip_rho_threshold)).float().mean(),
    }
    if args.clip_coef is not None:  # the share of steps whose ratio to the acting policy is outside the clip
        stats["stats/surrogate_clipped"] = ((ratio - 1).abs() > args.clip_coef)[~done[:-1]].float().mean()
    for i, activation in enumerate(output["activations"], 1):  # a unit (a conv's channel) 0 on every step learns nothing
        stats[f"stats/dead_units_{i}"] = (activation <= 0).transpose(0, 1).flatten(1).all(1).float().mean()
    return loss, stats


def make_optimizer(args, agent):
    """The paper's RMSProp. Another optimizer goes here (in both scripts); --resume refuses a checkpoint written with
    another one."""
    return torch.optim.RMSprop(agent.parameters(), lr=args.learning_rate, alpha=args.rmsprop_alpha, eps=args.rmsprop_eps)


def learn(agent, optimizer, batch, args, global_step, world_size=1):
    """One update on a batch of rollouts [T + 1, B, ...] (every rank calls this with its own batch, in step): the loss
    (V-trace under the current parameters), its gradient averaged over the ranks, clipped to `max_grad_norm`, one
    optimizer step. Returns the stats as floats. All of the batch or none: if the gradient, or the network's outputs
    after the step, are not finite, the state from before the batch comes back and FloatingPointError is raised on
    every rank."""
    fraction_left = max(0.0, 1.0 - global_step / args.anneal_lr_timesteps)  # never below 0
    learning_rate = args.learning_rate * (fraction_left if args.anneal_lr else 1.0)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate
    with all_or_nothing(agent, optimizer):
        loss, stats = compute_loss(agent, batch, args)
        stats = scalar_stats(stats, loss.device)
        optimizer.zero_grad()
        loss.backward()
        if world_size > 1:
            all_reduce_gradients(agent, world_size)
        grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)  # the norm before clipping
        if not torch.isfinite(grad_norm):
            bad = [key.split("/")[1] for key, value in stats.items() if not torch.isfinite(value)]
            raise FloatingPointError(f"not finite ({', '.join(bad) or 'the gradient'})")
        optimizer.step()
        finite = outputs_finite(agent, batch).float()
        if world_size > 1:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # every rank restores and raises alike
        if not finite:
            raise FloatingPointError("not finite after its step (the network's outputs: the step blew the weights up)")
        stats.update({"losses/grad_norm": grad_norm, "stats/grad_clipped": (grad_norm > args.max_grad_norm).float()})
        stats = dict(zip(stats, torch.stack(list(stats.values())).tolist()))  # floats, with one device sync
    stats["charts/learning_rate"] = learning_rate
    return stats


# ======================================================================================================================
# MACHINERY: what a researcher does not need to touch. The batch helpers (the forward over rollouts, the replay buffer
# the learner thread mixes in), precision detection, video, evaluation, the env pool's loop and its
# rollout assembly, argument checks, checkpoint I/O, signals, the learner's counters and the ranks' stop agreement, then
# the main program: threads, supervision, logging, restarts and shutdown.
# ======================================================================================================================


def unroll(agent, batch):
    """The network's outputs on rollouts [T + 1, B, ...], each from its stored core state (compute_loss's forward)."""
    done = batch["terminated"] | batch["truncated"]
    # After a final obs comes a reset obs; the stored core state is already reset for obs[0].
    first = torch.cat([torch.zeros_like(done[:1]), done[:-1]])
    core_state = tuple(batch["core_state"]) if "core_state" in batch else ()
    return agent(batch["obs"], first, core_state)


class Replay:
    """Experience replay as in LASER (Schmitt et al. 2020) and RLlib's IMPALA: each fresh batch is learned together with
    `proportion` batches drawn at random from the last `capacity` fresh ones; V-trace (or the clipped surrogate, whose
    ratio is to the acting policy) corrects their lag. Each rollout is learned from about 1 + proportion times."""

    def __init__(self, proportion, capacity):
        self.proportion, self.batches = proportion, collections.deque(maxlen=capacity)

    def mix(self, batch):
        """The fresh batch [T + 1, B, ...] followed along B by the drawn ones (fewer until that many are stored); then
        stores the fresh one. The batch itself without replay."""
        if not self.proportion:
            return batch
        drawn = random.sample(list(self.batches), min(self.proportion, len(self.batches)))
        self.batches.append(batch)
        return {
            key: torch.cat([value] + [other[key] for other in drawn], dim=0 if value.dim() == 1 else 1)
            for key, value in batch.items()
        }


class StatError(ValueError):
    """A stat of compute_loss's that cannot be logged: the run stops with one error line naming it, nothing applied."""


def scalar_stats(stats, device):
    """compute_loss's stats as 0-d float32 tensors on `device`: each may be a float, an int or a 0-d tensor. Raises
    StatError naming a stat of another kind, before anything is applied."""
    checked = {}
    for key, value in stats.items():
        try:
            value = torch.as_tensor(value, dtype=torch.float32, device=device).detach()
        except (TypeError, ValueError, RuntimeError):
            value = None
        if value is None or value.dim() != 0:
            raise StatError(
                f"compute_loss's stat {key!r} is {type(stats[key]).__name__} "
                f"{tuple(stats[key].shape) if hasattr(stats[key], 'shape') else stats[key]!r}: a stat must be a float, an "
                "int or a 0-d tensor (reduce it, e.g. with .mean())"
            )
        checked[key] = value
    return checked


def outputs_finite(agent, batch):
    """Whether the network's outputs on the batch's first step are finite: a step that blew the weights up (finite but
    huge) shows here, before the next step or the actors use them."""
    with torch.no_grad():
        first = torch.zeros_like(batch["terminated"][:1])
        core_state = tuple(batch["core_state"]) if "core_state" in batch else ()
        output = agent(batch["obs"][:1], first, core_state)
    return torch.isfinite(output["logits"]).all() & torch.isfinite(output["values"]).all()


@contextlib.contextmanager
def all_or_nothing(agent, optimizer):
    """An update applied whole or not at all: if the block raises (FloatingPointError, StatError or any other error,
    before or after the optimizer's step), the parameters and the optimizer state go back to what they were before it."""
    before = copy.deepcopy(agent.state_dict()), copy.deepcopy(optimizer.state_dict())
    try:
        yield
    except BaseException:
        agent.load_state_dict(before[0])
        optimizer.load_state_dict(before[1])
        raise


def is_atari(env_id):
    return "repeat_action_probability" in envpool.make_spec(env_id).config._fields


def bf16_native():
    """True where the network's device runs bfloat16 natively: a CUDA GPU from Ampere on, a CPU with AVX512-BF16 or AMX.
    Elsewhere bf16 is emulated and slower than float32. (Off with a torch that lacks these CPU checks.)"""
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability()[0] >= 8
    return any(getattr(torch.cpu, check, lambda: False)() for check in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


class GameRecorder:
    """--capture-video: env 0's games as H.264 MP4s of the full-colour screen, one frame per step (the last of its 4
    emulator frames; a game of L steps gives L + 1 frames with its first screen), played at the game's speed, streamed
    to ffmpeg as they come. In training, the first game to start `interval` seconds after the last recorded one is
    recorded; in eval mode, every game."""

    def __init__(self, screen, folder, interval):
        self.screen, self.folder, self.interval = screen, folder, interval
        self.writer, self.next_start, self.count = None, 0.0, 0

    def step(self, new_game, ended, version):
        """After each step of env 0: new_game: its obs starts a game; ended: [(return, length)] of the game ending there."""
        try:  # a clip that cannot be written never stops a run
            if self.writer is None and new_game and time.time() >= self.next_start:
                import imageio.v2 as imageio  # only with --capture-video

                os.makedirs(self.folder, exist_ok=True)
                self.path = os.path.join(self.folder, f"update{version}-game{self.count}.mp4")
                self.writer = imageio.get_writer(self.path, fps=15, codec="libx264", macro_block_size=1)  # 60 Hz / 4
                self.next_start, self.count = time.time() + self.interval, self.count + 1
            if self.writer is not None:
                self.writer.append_data(self.screen())
                for game_return, length in ended:
                    self.writer.close()
                    self.writer = None
                    os.replace(self.path, f"{self.path[: -len('.mp4')]}-return{game_return:g}-steps{length}.mp4")
        except Exception as e:
            print(f"warning: --capture-video stopped: {e!r}", file=sys.stderr, flush=True)
            self.writer, self.next_start = None, float("inf")

    def close(self):
        """Drops the clip of a game that has not ended."""
        if self.writer is not None:
            self.writer.close()
            os.remove(self.path)


def evaluate(args, policy, device, signals):
    """Plays `eval_episodes` full games on one env, carrying the LSTM state, or fewer if a signal stops it; returns
    their returns."""
    envs = make_env(args, num_envs=1, batch_size=1, seed=args.seed, num_threads=1)
    games, returns = GameTracker(1), []
    recorder = GameRecorder(lambda: envs.render()[0], os.path.join("videos", args.run_name), 0) if args.capture_video else None
    core_state = tuple(s.to(device) for s in policy.agent.initial_state(1))
    envs.async_reset()
    while len(returns) < args.eval_episodes and not signals.received:
        obs, reward, terminated, truncated, info = envs.recv()
        first, ended = games.update(info["env_id"], reward, terminated, truncated, info)
        returns += [game_return for _, game_return, _ in ended]
        if recorder is not None:
            recorder.step(first[0] and games.lengths[0] == 0, [g[1:] for g in ended], policy.version)
        action, _, core_state, _ = policy.act(torch.from_numpy(obs).to(device), torch.from_numpy(first).to(device), core_state)
        envs.send(action.cpu().numpy(), info["env_id"])
    return np.array(returns[: args.eval_episodes])


def actor_loop(args, envs, policy, batch_queue, episodes, timings, stop, device, recorder=None):
    """recv -> act -> send on the pool until `stop`; every `batch_size` finished rollouts go to the learner as a batch."""
    assembler, games = RolloutAssembler(args.num_envs, args.unroll_length), GameTracker(args.num_envs)
    core_state = tuple(s.to(device) for s in policy.agent.initial_state(args.num_envs))  # each env's state before its next obs
    rollouts = []
    envs.async_reset()
    while not stop.is_set():
        recv_start = time.time()
        obs, reward, terminated, truncated, info = envs.recv()
        env_ids = info["env_id"]
        act_start = time.time()
        first, ended = games.update(env_ids, reward, terminated, truncated, info)
        episodes.extend(ended)
        if recorder is not None and 0 in env_ids:
            ended_0 = [game[1:] for game in ended if game[0] == 0]
            recorder.step(first[env_ids == 0][0] and games.lengths[0] == 0, ended_0, policy.version)
        index, first_t = torch.from_numpy(env_ids).to(device), torch.from_numpy(first).to(device)
        # The state fed to the core on obs: reset where obs starts an episode.
        state = tuple(s[index] * ~first_t.unsqueeze(-1) for s in core_state)
        action, recorded, next_state, version = policy.act(torch.from_numpy(obs).to(device), first_t, state)
        for s, next_s in zip(core_state, next_state):
            s[index] = next_s
        action = action.cpu().numpy()
        start = dict(policy_version=np.full(len(env_ids), version))
        if state:
            start["core_state"] = torch.stack(state, dim=1).cpu().numpy()  # [n, 2, hidden]
        # reward: received on arriving at obs, unclipped; terminated / truncated: obs is a final obs (the env resets
        # on its next step, ignoring that action); the recorded outputs (logits, ...): the behavior policy's on obs.
        step = dict(obs=obs, reward=reward, terminated=terminated, truncated=truncated, action=action)
        step.update({key: value.cpu().numpy() for key, value in recorded.items()})
        rollouts += assembler.add(env_ids, step, start)
        envs.send(action, env_ids)
        put_start = time.time()
        rollouts = send_batches(rollouts, args, batch_queue, stop, device)
        timings["recv"] += act_start - recv_start
        timings["act"] += put_start - act_start
        timings["queue"] += time.time() - put_start
    if recorder is not None:
        recorder.close()


class GameTracker:
    """Full-game returns and lengths per env. With --episodic-life a lost life ends an episode for learning, not the
    game: EnvPool's info["terminated"] (Atari) says when the game is over."""

    def __init__(self, num_envs):
        self.after_final = np.ones(num_envs, bool)  # the env's next obs is a reset obs (so is the very first)
        self.returns, self.lengths = np.zeros(num_envs), np.zeros(num_envs, np.int64)

    def update(self, env_ids, reward, terminated, truncated, info):
        """Returns first [n] (the obs starts an episode) and [(env_id, return, length)] of the games that just ended."""
        first = self.after_final[env_ids]
        self.after_final[env_ids] = terminated | truncated
        counted = ~first  # the reset step belongs to no episode
        self.returns[env_ids] += reward * counted
        self.lengths[env_ids] += counted
        ended = env_ids[truncated | info.get("terminated", terminated).astype(bool)]
        games = list(zip(ended.tolist(), self.returns[ended].tolist(), self.lengths[ended].tolist()))
        self.returns[ended], self.lengths[ended] = 0.0, 0
        return first, games


class RolloutAssembler:
    """Cuts each env's stream of steps into [T + 1] rollouts; EnvPool's async batches come in any env order.

    Each env fills its own row, so a rollout never mixes envs; the last step of one rollout is the first of the next.
    Per-step values (obs, reward, ..., logits) are written at the env's current step; per-rollout values
    (policy_version, core_state) are kept from the step its rollout starts at.
    """

    def __init__(self, num_envs, unroll_length):
        self.num_envs, self.T = num_envs, unroll_length
        self.t = np.zeros(num_envs, np.int64)  # each env's current step in its rollout
        self.steps, self.starts = None, None  # {key: [num_envs, T + 1, ...]}, {key: [num_envs, ...]}

    def add(self, env_ids, step, start):
        """step, start: {key: [n, ...] arrays} for the distinct envs `env_ids`. Returns the rollouts this step
        finished: a list of {key: [T + 1, ...] per step, [...] per rollout}."""
        if self.steps is None:
            self.steps = {k: np.zeros((self.num_envs, self.T + 1, *v.shape[1:]), v.dtype) for k, v in step.items()}
            self.starts = {k: np.zeros((self.num_envs, *v.shape[1:]), v.dtype) for k, v in start.items()}
        T, t = self.T, self.t[env_ids]
        for key, value in step.items():
            self.steps[key][env_ids, t] = value
        rollouts = []
        if t.max() == T:  # one copy per key for all the envs that finished, then a view of it per rollout
            finished = env_ids[t == T]
            done = {key: buffer[finished] for key, buffer in (*self.steps.items(), *self.starts.items())}
            rollouts = [{key: value[i] for key, value in done.items()} for i in range(len(finished))]
            for buffer in self.steps.values():
                buffer[finished, 0] = buffer[finished, T]
            t = np.where(t == T, 0, t)  # their step T is the next rollout's step 0
        starting = t == 0
        for key, value in start.items():
            self.starts[key][env_ids[starting]] = value[starting]
        self.t[env_ids] = t + 1
        return rollouts


def send_batches(rollouts, args, batch_queue, stop, device):
    """Every `batch_size` finished rollouts as one batch into the learner's queue, waiting while it is full (until
    `stop`); returns the rollouts left over."""
    while len(rollouts) >= args.batch_size and not stop.is_set():
        batch = stack_rollouts(rollouts[: args.batch_size], pin_memory=device.type == "cuda")
        rollouts = rollouts[args.batch_size :]
        while not stop.is_set():
            with contextlib.suppress(queue.Full):
                batch_queue.put(batch, timeout=0.5)
                break
    return rollouts


def stack_rollouts(rollouts, pin_memory):
    """B rollouts -> one batch: [T + 1, B, ...] per step, core_state [2, B, hidden], policy_version [B]."""
    batch = {}
    for key, value in rollouts[0].items():
        stacked = torch.from_numpy(np.stack([rollout[key] for rollout in rollouts], axis=min(1, value.ndim)))
        batch[key] = stacked.pin_memory() if pin_memory else stacked
    return batch


def check_args(args):
    """Exits with a one-line error on bad input, before anything is started."""
    try:
        spec = envpool.make_spec(args.env_id)
        supported = isinstance(spec.action_space, gym.spaces.Discrete) and (
            is_atari(args.env_id) or len(spec.observation_space.shape) == 1
        )
    except Exception:
        supported = False
    if not supported:
        sys.exit(
            f"error: unknown --env-id {args.env_id!r}: use an Atari id as in EnvPool (Pong-v5, Breakout-v5, ...) "
            "or a gymnasium classic-control id (CartPole-v1, Acrobot-v1, ...): EnvPool's envs only; impala_mono.py runs any "
            "gymnasium env"
        )
    for name in (
        "total_timesteps",
        "num_envs",
        "env_batch_size",
        "num_threads",
        "unroll_length",
        "batch_size",
        "queue_size",
        "num_torch_threads",
        "eval_episodes",
        "stall_timeout",
        "video_interval",
        "anneal_lr_timesteps",
        "replay_buffer",
        "clip_coef",
        "learning_rate",
        "rmsprop_eps",  # 0 would divide a gradient of 0 by 0
        "max_grad_norm",  # 0 would zero every gradient, a negative one turn it around
        "clip_rho_threshold",
        "clip_pg_rho_threshold",
    ):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            sys.exit(f"error: --{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.anneal_lr and args.anneal_lr_timesteps < args.total_timesteps:
        sys.exit(
            f"error: --total-timesteps {args.total_timesteps} runs past --anneal-lr-timesteps {args.anneal_lr_timesteps}, "
            "after which the learning rate is 0: raise --anneal-lr-timesteps, or pass --no-anneal-lr"
        )
    if args.clip_coef is not None and args.clip_coef >= 1:
        sys.exit(
            f"error: --clip-coef {args.clip_coef} leaves the ratio no lower bound (1 - clip <= 0): pass a value below 1 "
            "(PPO: 0.1-0.2)"
        )
    if args.clip_coef is not None and args.clip_pg_rho_threshold != 1.0:
        sys.exit(
            f"error: --clip-pg-rho-threshold {args.clip_pg_rho_threshold} clips IMPALA's policy gradient, which "
            f"--clip-coef {args.clip_coef} replaces with the clipped surrogate: pass one of the two"
        )
    if args.replay_proportion < 0:
        sys.exit(f"error: --replay-proportion must be 0 (no replay) or more, got {args.replay_proportion}")
    if args.replay_buffer < args.replay_proportion:
        sys.exit(
            f"error: --replay-buffer {args.replay_buffer} holds fewer batches than --replay-proportion "
            f"{args.replay_proportion} draws for each update: raise --replay-buffer"
        )
    args.env_batch_size = args.env_batch_size or max(1, args.num_envs // 2)  # unset (None) or positive by now
    if args.env_batch_size > args.num_envs:
        sys.exit(
            f"error: --env-batch-size {args.env_batch_size} is larger than --num-envs {args.num_envs}: "
            "each recv() returns at most all the envs"
        )
    # Each env's [T + 1] rollout, the rollouts one recv() finished waiting to be batched, and the batches in the queue,
    # being stacked and being learned from, per local rank.
    obs_bytes = int(np.prod(spec.observation_space.shape)) * spec.observation_space.dtype.itemsize
    rollouts = args.num_envs + args.env_batch_size + (args.queue_size + 2) * args.batch_size
    needed = rollouts * (args.unroll_length + 1) * obs_bytes
    needed *= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    try:  # bytes of memory available for new allocations (Linux's MemAvailable); None where unknown
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        available = None
    if available is not None and needed > available:
        sys.exit(
            f"error: --num-envs {args.num_envs} needs {needed / 2**30:.1f} GiB of rollout buffers, but "
            f"{available / 2**30:.1f} GiB of memory is available: lower --num-envs, --batch-size or --unroll-length"
        )
    for flag, needs, packages in (
        ("track", ["wandb"], "wandb"),
        ("capture_video", ["imageio", "imageio_ffmpeg"], "imageio imageio-ffmpeg"),
    ):
        if getattr(args, flag) and not all(importlib.util.find_spec(name) for name in needs):
            sys.exit(f"error: --{flag.replace('_', '-')} needs {packages}: pip install {packages}")
    if args.capture_video and not is_atari(args.env_id):
        sys.exit(f"error: --capture-video records Atari games; {args.env_id} has no screen to record")
    args.bf16 = args.bf16 and is_atari(args.env_id)  # the classic-control MLPs ran slower in bf16
    # EnvPool and torch share the cores: Atari gives EnvPool all of them and torch as many (half with bf16, where the
    # network is cheaper); classic control, whose steps are cheap, one of each (docs/experiments.md, threads).
    cores = max(1, os.cpu_count() // int(os.environ.get("LOCAL_WORLD_SIZE", 1))) if is_atari(args.env_id) else 1
    args.num_threads = args.num_threads or cores
    args.num_torch_threads = args.num_torch_threads or (max(1, cores // 2) if args.bf16 else cores)
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)):  # restarts: see "Restarts" in the README
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            sys.exit(
                "error: torchrun --max-restarts: restarted ranks would read the dead ranks' addresses from torchrun's "
                "shared store: launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (across nodes also --rdzv-backend c10d)"
            )
        if os.environ.get("TORCHELASTIC_RUN_ID") == "none" and not (args.run_name or args.resume):
            sys.exit(
                "error: torchrun --max-restarts needs a run folder that every restart finds: pass --run-name or "
                "torchrun --rdzv-id"
            )
    if args.resume and args.eval_checkpoint:
        sys.exit(
            "error: --resume and --eval-checkpoint both name a checkpoint: pass --resume to train on, or "
            "--eval-checkpoint to evaluate"
        )
    for name, path in (("resume", args.resume), ("eval_checkpoint", args.eval_checkpoint)):
        if path is not None and not os.path.isfile(path) and os.environ.get("RANK", "0") == "0":
            sys.exit(f"error: --{name.replace('_', '-')} {path}: no such file")
    check_batch_reads()


def check_batch_reads():
    """Exits with a one-line error, before anything starts, if the learner's code (compute_loss, learn, unroll) reads a
    key of the batch, as batch["name"], that the acting side does not record: the env's fields, the action, the
    policy version, the core state and RECORDED_OUTPUTS. Keys the code adds to a batch itself count as recorded."""
    recorded = {"obs", "reward", "terminated", "truncated", "action", "policy_version", "core_state", *RECORDED_OUTPUTS}
    nodes = {
        function.__name__: list(ast.walk(ast.parse(textwrap.dedent(inspect.getsource(function)))))
        for function in (compute_loss, learn, unroll)
    }
    keyed = [  # (function, batch["name"]), read or written
        (name, node)
        for name, function_nodes in nodes.items()
        for node in function_nodes
        if isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "batch"
        and isinstance(node.slice, ast.Constant)
    ]
    for function_nodes in nodes.values():  # keys added anywhere: {**batch, "name": ...}
        for node in function_nodes:
            if isinstance(node, ast.Dict):
                recorded |= {key.value for key in node.keys if isinstance(key, ast.Constant)}
    recorded |= {node.slice.value for _, node in keyed if isinstance(node.ctx, ast.Store)}  # batch["name"] = ...
    for name, node in keyed:
        if isinstance(node.ctx, ast.Load) and node.slice.value not in recorded:
            sys.exit(
                f"error: {name} reads batch[{node.slice.value!r}], which the actors do not record: add "
                f"{node.slice.value!r} to RECORDED_OUTPUTS if it is an output of Agent.forward"
            )


# The flags that change how a run is run, watched or stored, not what it learns; every other flag is a learning flag,
# and resuming under another value of one is warned about (a new flag is one by default).
RUN_ONLY_FLAGS = ("exp_name", "torch_deterministic", "cuda", "track", "wandb_project_name", "wandb_entity", "capture_video",
                  "video_interval", "num_threads", "num_torch_threads", "checkpoint_interval", "stall_timeout", "resume",
                  "eval_checkpoint", "eval_episodes", "run_name", "wandb_id", "total_timesteps")  # fmt: skip


def load_checkpoint(path, args):
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        trained = checkpoint["args"]
    except Exception as e:
        sys.exit(f"error: cannot read checkpoint {path} ({type(e).__name__}): pass a checkpoint.pt written by this script")
    newer = [name for name in vars(args) if name not in trained and name not in RUN_ONLY_FLAGS]
    if newer:
        print(
            f"warning: {', '.join('--' + name.replace('_', '-') for name in newer)}: not in the checkpoint {path} "
            "(written before the flag existed), taken as its default",
            file=sys.stderr,
        )
    trained = {**vars(type(args)()), **trained}  # a flag newer than the checkpoint: it trained at the flag's default
    checkpoint["args"] = trained
    for name in ("env_id", "network", "use_lstm"):
        if trained[name] != getattr(args, name):
            sys.exit(
                f"error: checkpoint {path} is for --{name.replace('_', '-')} {trained[name]}, not {getattr(args, name)}: "
                "pass the same flag as in training"
            )
    if args.eval_checkpoint is None:  # resuming: the run goes on under the flags given, so say which ones changed
        changed = [
            f"--{name.replace('_', '-')} {value} (trained with {trained[name]})"
            for name, value in vars(args).items()
            if name not in RUN_ONLY_FLAGS and trained[name] != value
        ]
        if changed:
            print(
                f"warning: resuming {path} under other flags than it was trained with: {', '.join(changed)}; pass "
                "the training values to continue the same run",
                file=sys.stderr,
            )
        unknown = [f"--{name.replace('_', '-')} {value}" for name, value in trained.items() if name not in vars(args)]
        if unknown:  # a flag of the script that wrote it (patched, or from before the flag was retired)
            print(
                f"warning: resuming {path}, trained with flags this script does not have: {', '.join(unknown)}; the "
                "run goes on without them",
                file=sys.stderr,
            )
    return checkpoint


def check_resumable(path, checkpoint, agent, args, build, optimizer=None):
    """Exits with a one-line error, before anything starts and leaving the file as it is, if the checkpoint (as
    load_checkpoint returns it) holds another network than `agent`, which the flags `args` and the code built (or
    another optimizer's state, when given: resuming): a flag that shapes the network set otherwise than in training
    (named: `build(flags)` makes the network for other flags), an edited network, or another optimizer."""

    def shapes(state):
        return {key: tuple(value.shape) for key, value in state.items()}

    saved, built = shapes(checkpoint["model"]), shapes(agent.state_dict())
    if saved != built:
        trained = checkpoint["args"]
        differ = [name for name, value in vars(args).items() if name not in RUN_ONLY_FLAGS and trained[name] != value]
        # the flags whose training value alone builds the saved network
        flags = [name for name in differ if shapes(build(replace(args, **{name: trained[name]})).state_dict()) == saved]
        doing = "evaluate" if optimizer is None else "resume"
        if flags:
            trained_with = ", ".join(f"--{name.replace('_', '-')} {trained[name]}" for name in flags)
            sys.exit(f"error: checkpoint {path} was trained with {trained_with}: pass the same to {doing} it")
        key = sorted(set(saved.items()) ^ set(built.items()))[0][0]
        sys.exit(
            f"error: checkpoint {path} holds another network ({key} differs): {doing} it with the network it was trained "
            f"with{'' if optimizer is None else ', or start a new run'}"
        )
    if optimizer is None:
        return
    # The state an optimizer keeps per parameter names it (RMSprop: square_avg; Adam: exp_avg, exp_avg_sq): take one
    # step with zero gradients on a copy to see what this one keeps.
    probe = copy.deepcopy(agent)
    probe_optimizer = type(optimizer)(probe.parameters(), **optimizer.defaults)
    for p in probe.parameters():
        p.grad = torch.zeros_like(p)
    probe_optimizer.step()
    keeps = {key for state in probe_optimizer.state_dict()["state"].values() for key in state}
    kept = {key for state in checkpoint["optimizer"]["state"].values() for key in state}
    if kept and kept != keeps:
        sys.exit(
            f"error: checkpoint {path} holds the state of another optimizer ({', '.join(sorted(kept))}) than "
            f"{type(optimizer).__name__}: resume with the optimizer it was trained with (make_optimizer), or start a new run"
        )


class StopSignals:
    """Ctrl-C (SIGINT) and SIGTERM (`kill`, `timeout`, a scheduler, torchrun) ask the run to stop. The handler only
    counts them and never raises: the main loop stops the run when it sees the first, and any number more, at any
    moment, cannot cut the shutdown or the checkpoint's save short. From the third on, each says what the run is waiting
    for. A process forked from this one ignores them (its parent stops it); SIGKILL stops the run without saving."""

    def __init__(self):
        self.received, self.waiting_for, self.pid = 0, "the run to start (it stops once started)", os.getpid()
        for signum in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a shell's background job starts with it ignored
            signal.signal(signum, self.handle)

    def handle(self, signum, frame):
        if os.getpid() != self.pid:
            return
        self.received += 1
        if self.received >= 3:  # os.write, not print: the signal may have interrupted a print to the same stream
            name = signal.Signals(signum).name
            os.write(2, f"{name}: stopping; waiting for {self.waiting_for} (SIGKILL stops without saving)\n".encode())


@dataclass
class Progress:
    """The learner's counters, shared by its thread and the main loop."""

    global_step: int = 0
    num_updates: int = 0


def all_reduce_gradients(agent, world_size):
    """Averages the gradients over the ranks, in one all_reduce. Every rank sends the same layout: a parameter with no
    gradient on a rank (a head its batch did not reach) counts as zeros there, and one with no gradient on any rank
    keeps none, as in a single-process update."""
    params = list(agent.parameters())
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    has_grad = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    flat = torch.cat([g.flatten() for g in grads] + [has_grad])
    dist.all_reduce(flat)
    reduced_has_grad = flat[-len(params) :].tolist()
    for p, grad, count in zip(params, flat[: -len(params)].split([p.numel() for p in params]), reduced_has_grad):
        if count == 0:
            p.grad = None
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # in the parameter's memory layout (channels-last for convolutions)
        p.grad.copy_(grad.view_as(p) / world_size)


def any_rank_stops(stop, device):
    """Every rank says whether it stops, in one all_reduce; True if any does. The ranks call this before each update,
    so that all of them make the same updates and end with the same parameters."""
    flag = torch.tensor([float(stop)], device=device)
    dist.all_reduce(flag)
    return flag.item() > 0


def save_checkpoint(path, agent, optimizer, global_step, num_updates, args):
    """Written to a temporary file and renamed, so a crash never leaves a half-written checkpoint; the one it replaces
    is kept as checkpoint.prev.pt. Non-finite parameters are refused (returns False), so no path writes them."""
    if not all(torch.isfinite(p).all() for p in agent.parameters()):
        print(f"error: the parameters are not finite at global_step={global_step}: {path} not overwritten", file=sys.stderr)
        return False
    torch.save(
        dict(
            model=agent.state_dict(),
            optimizer=optimizer.state_dict(),
            global_step=global_step,
            num_updates=num_updates,
            args=vars(args),
        ),
        path + ".tmp",
    )
    if os.path.exists(path):
        previous = path[: -len(".pt")] + ".prev.pt"
        shutil.copyfile(path, previous + ".tmp")
        os.replace(previous + ".tmp", previous)
    os.replace(path + ".tmp", path)
    return True


def train(args, signals):
    """Trains (or, with --eval-checkpoint, evaluates) as the flags say, on this rank: set up the agent, optimizer,
    process group and writer, start the actor and learner threads, supervise them, save on the way out (also when
    `signals`, a StopSignals, received one). Returns the exit code."""

    # TRY NOT TO MODIFY: torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; a plain `python` run is rank 0 of 1
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    master_process = rank == 0  # the one that logs and writes checkpoints
    use_cuda = torch.cuda.is_available() and args.cuda
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0)) % torch.cuda.device_count()}" if use_cuda else "cpu")
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_num_threads(args.num_torch_threads)

    # The run folder is the same on every rank and every torchrun restart: from --resume, --run-name or torchrun's run id.
    if args.resume or args.eval_checkpoint:
        args.run_name = os.path.basename(os.path.dirname(os.path.abspath(args.resume or args.eval_checkpoint)))
    if not args.run_name:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")  # a uuid under torchrun on one node, --rdzv-id across nodes
        args.run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{run_id if run_id != 'none' else int(time.time())}"
    run_dir = os.path.join("runs", args.run_name)
    checkpoint_path = os.path.join(run_dir, "checkpoint.pt")
    # Under torchrun --max-restarts a run whose folder holds a checkpoint continues it (rank 0's folder: it saves them).
    restart = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0 and os.path.isfile(checkpoint_path)
    load_path = checkpoint_path if restart else args.resume or args.eval_checkpoint
    checkpoint = load_checkpoint(load_path, args) if load_path and master_process else None

    spec = envpool.make_spec(args.env_id)
    agent = make_agent(args, spec.observation_space, spec.action_space)
    if checkpoint is not None:
        optimizer = None if args.eval_checkpoint else make_optimizer(args, agent)
        build = lambda flags: make_agent(flags, spec.observation_space, spec.action_space)  # noqa: E731
        check_resumable(load_path, checkpoint, agent, args, build, optimizer)
    if world_size > 1:
        if use_cuda:
            torch.cuda.set_device(device)
        # A collective that waits longer than this for a peer raises instead of hanging (a dead peer's closed
        # connection makes gloo raise at once; torchrun also stops the other ranks of a failed run).
        # NCCL wants a GPU per rank: ranks that share one (more ranks than GPUs on a node) all-reduce with gloo
        shared_gpu = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > torch.cuda.device_count()
        dist.init_process_group("nccl" if use_cuda and not shared_gpu else "gloo", timeout=timedelta(minutes=5))
        shared = [agent.state_dict(), checkpoint]  # every rank starts from rank 0's parameters, or rank 0's checkpoint
        dist.broadcast_object_list(shared, src=0)
        agent.load_state_dict(shared[0])
        checkpoint = shared[1]
    if checkpoint is not None:
        agent.load_state_dict(checkpoint["model"])
    agent.to(device)

    if args.eval_checkpoint:
        returns = evaluate(args, ActingPolicy(agent, version=checkpoint["num_updates"]), device, signals)
        if signals.received:
            print(f"interrupted after {len(returns)} of {args.eval_episodes} games", flush=True)
        if not len(returns):
            return 0
        print(
            f"{args.env_id}: mean return {returns.mean():.2f} +- {returns.std():.2f} over {len(returns)} games "
            f"({args.eval_checkpoint}, global_step {checkpoint['global_step']})"
        )
        return 0

    optimizer = make_optimizer(args, agent)  # on the parameters' device
    replay = Replay(args.replay_proportion, args.replay_buffer)  # empty on --resume: it refills in replay_buffer updates
    progress = Progress()
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])  # its state, and the hyperparameters it was saved with:
        for group in optimizer.param_groups:  # those the flags given set instead (--rmsprop-eps, ...)
            group.update(optimizer.defaults)
        progress = Progress(checkpoint["global_step"], checkpoint["num_updates"])
    writer = None
    if master_process:
        if args.track:
            import wandb  # only with --track

            args.wandb_id = checkpoint["args"].get("wandb_id") if checkpoint else None
            args.wandb_id = wandb.init(
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                sync_tensorboard=True,
                config=vars(args),
                name=args.run_name,
                monitor_gym=False,
                save_code=True,
                id=args.wandb_id,
                resume="allow",
            ).id
        # purge_step: drop what was logged after the checkpoint
        writer = SummaryWriter(run_dir, purge_step=progress.global_step + 1 if checkpoint else None)
        table = "\n".join(f"|{key}|{value}|" for key, value in {**vars(args), "world_size": world_size}.items())
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
        resumed = f", continuing {load_path} at global_step={progress.global_step}" if restart else ""
        precision = str(agent.dtype)[len("torch.") :]
        print(f"{run_dir}: training on {world_size} x {device}, network forward in {precision}{resumed}", flush=True)

    def log(tag, value):
        if writer is not None:
            writer.add_scalar(tag, value, progress.global_step)

    # TRY NOT TO MODIFY: the env pool and its actor thread
    envs = make_env(args, args.num_envs, args.env_batch_size, args.seed + rank * args.num_envs, args.num_threads)
    policy = ActingPolicy(agent, version=progress.num_updates)
    batch_queue = queue.Queue(maxsize=args.queue_size)
    episodes = collections.deque()  # (return, length) of finished games
    timings = collections.Counter()  # actor seconds in recv, inference (+ assembly) and waiting on the full queue
    stop, learn_lock = threading.Event(), threading.Lock()
    errors, params_in_sync = [], []

    def actor_thread():
        try:
            recorder = None
            if args.capture_video and master_process:
                screen = lambda: envs.render(env_ids=[0])[0]  # noqa: E731
                recorder = GameRecorder(screen, os.path.join("videos", args.run_name), args.video_interval * 60)
            actor_loop(args, envs, policy, batch_queue, episodes, timings, stop, device, recorder)
        except Exception as e:
            errors.append(f"the actor loop failed: {e!r}")
            traceback.print_exc()
            stop.set()

    # TRY NOT TO MODIFY: the learner thread; the update itself is `learn`
    def learner_thread():
        try:
            while progress.global_step < args.total_timesteps:
                wait_start, batch = time.time(), None
                while batch is None and not stop.is_set():  # a batch on the learner's device; None once `stop` is set
                    with contextlib.suppress(queue.Empty):
                        batch = {
                            key: value.to(device, non_blocking=True) for key, value in batch_queue.get(timeout=0.5).items()
                        }
                stopping = any_rank_stops(stop.is_set(), device) if world_size > 1 else stop.is_set()
                if stopping:
                    break
                with learn_lock:
                    update_start = time.time()
                    batch = replay.mix(batch)
                    try:
                        stats = learn(agent, optimizer, batch, args, progress.global_step, world_size)
                    except FloatingPointError as e:  # raised on every rank alike: all of them stop here
                        errors.append(
                            f"update {progress.num_updates + 1} at global_step={progress.global_step} is {e}: "
                            "not applied, the checkpoint keeps the parameters before it; lower --learning-rate "
                            "or check the rewards"
                        )
                        stop.set()
                        break
                    except StatError as e:  # the same stats on every rank: all of them stop here
                        errors.append(f"{e}; update {progress.num_updates + 1} not applied")
                        stop.set()
                        break
                    policy.update(agent, progress.num_updates + 1)
                    stats["stats/policy_lag"] = progress.num_updates - batch["policy_version"].float().mean().item()
                    progress.num_updates += 1
                    progress.global_step += args.unroll_length * args.batch_size * world_size
                    stats["stats/batch_wait_time"] = update_start - wait_start
                    stats["stats/update_time"] = time.time() - update_start
                    for tag, value in stats.items():
                        log(tag, value)
            if world_size > 1:  # a cheap end-of-run check that the ranks stayed in step
                flat = torch.cat([p.detach().flatten() for p in agent.parameters()])  # channels-last weights: no view
                low, high = flat.clone(), flat.clone()
                dist.all_reduce(low, op=dist.ReduceOp.MIN)
                dist.all_reduce(high, op=dist.ReduceOp.MAX)
                params_in_sync.append(torch.equal(low, high))
        except Exception as e:
            errors.append(f"the learner failed: {e!r}")
            traceback.print_exc()
            stop.set()

    # TRY NOT TO MODIFY: run until done or a signal; log, checkpoint, and save on the way out
    # daemon: a thread stuck past its bounded join (below) cannot keep the process alive
    actor = threading.Thread(target=actor_thread, daemon=True)
    learner = threading.Thread(target=learner_thread, daemon=True)
    start_time = last_log = last_checkpoint = last_progress = time.time()
    start_step = last_progress_step = progress.global_step
    recent_returns = collections.deque(maxlen=20)
    exit_code, interrupted = 0, False
    try:
        actor.start()
        learner.start()
        signals.waiting_for = "the run to stop"
        while learner.is_alive():
            time.sleep(0.1)
            if signals.received:
                interrupted = True
                if master_process:
                    print(f"interrupted at global_step={progress.global_step}", flush=True)
                break
            while episodes:
                _, episodic_return, episodic_length = episodes.popleft()
                recent_returns.append(episodic_return)
                log("charts/episodic_return", episodic_return)
                log("charts/episodic_length", episodic_length)
            if errors:
                raise RuntimeError(errors[0])
            now = time.time()
            if progress.global_step != last_progress_step:
                last_progress, last_progress_step = now, progress.global_step
            elif now - last_progress > args.stall_timeout:
                side = "the learner (a batch waits for it)" if batch_queue.qsize() else "the actors (no batch came)"
                raise RuntimeError(f"no update for {now - last_progress:.0f} s (--stall-timeout): {side} stalled")
            if now - last_log >= 5.0:
                sps = int((progress.global_step - start_step) / (now - start_time))
                log("charts/SPS", sps)
                log("stats/queue_size", batch_queue.qsize())
                actor_seconds = dict(timings)  # a copy in one step: the actor thread adds to timings meanwhile
                timings.clear()
                actor_time = sum(actor_seconds.values()) or 1.0
                for key, seconds in actor_seconds.items():
                    log(f"stats/actor_{key}_fraction", seconds / actor_time)
                if master_process:
                    mean_return = f"{np.mean(recent_returns):.2f}" if recent_returns else "n/a"
                    print(
                        f"global_step={progress.global_step} SPS={sps} updates={progress.num_updates} "
                        f"episodic_return(last {len(recent_returns)})={mean_return}",
                        flush=True,
                    )
                last_log = now
            if master_process and now - last_checkpoint >= args.checkpoint_interval:
                with learn_lock:
                    save_checkpoint(checkpoint_path, agent, optimizer, progress.global_step, progress.num_updates, args)
                last_checkpoint = now
        if errors:
            raise RuntimeError(errors[0])
        if not interrupted and world_size > 1 and params_in_sync != [True]:
            raise RuntimeError(f"the parameters differ between ranks at update {progress.num_updates}")
    except RuntimeError as e:
        print(f"error: {e}; stopping the run", file=sys.stderr, flush=True)
        exit_code = 1
    finally:
        stop.set()
        # The learner gets --stall-timeout to finish its update (its collectives with the ranks included), the actor
        # its step of the envs.
        signals.waiting_for = "the learner's update"
        learner.join(timeout=args.stall_timeout)
        signals.waiting_for = "the actor's step of the envs"
        actor.join(timeout=args.stall_timeout)
        if not actor.is_alive():
            envs.close()
        if learner.is_alive():
            print("error: the learner's update did not end within --stall-timeout: not saving", file=sys.stderr, flush=True)
            exit_code = 1
        elif master_process:
            signals.waiting_for = f"the checkpoint to be written to {checkpoint_path}"
            saved = save_checkpoint(checkpoint_path, agent, optimizer, progress.global_step, progress.num_updates, args)
            exit_code = exit_code if saved else 1
            in_sync = f", parameters identical on all {world_size} ranks" if params_in_sync == [True] else ""
            print(
                f"{'saved' if saved else 'did not save'} {checkpoint_path} at global_step={progress.global_step}{in_sync} "
                f"(mean of the last {len(recent_returns)} episodic returns: "
                f"{np.mean(recent_returns) if recent_returns else float('nan'):.2f})",
                flush=True,
            )
        if writer is not None:
            writer.close()
        if world_size > 1 and not learner.is_alive():
            dist.destroy_process_group()
    return exit_code


if __name__ == "__main__":
    signals = StopSignals()  # first: from here on a signal asks the run to stop, whenever it comes
    args = tyro.cli(Args)
    check_args(args)
    sys.exit(train(args, signals))
