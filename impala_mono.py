"""IMPALA on one machine, pure Python: actor processes, shared-memory rollouts, V-trace learner.

Paper: https://arxiv.org/abs/1802.01561 (Espeholt et al. 2018). Design after TorchBeast's MonoBeast.

    python impala_mono.py --env-id Pong-v5
    python impala_mono.py --env-id CartPole-v1 --total-timesteps 4000000
    python impala_mono.py --env-id Pong-v5 --eval-checkpoint runs/<run_name>/checkpoint.pt
"""

import os

# One thread per actor process for numpy (the frame resize) and torch: spare threads spin and fight
# over the cores. The learner sets its own torch thread count (--num-torch-threads).
os.environ["OMP_NUM_THREADS"] = "1"

import ast
import collections
import contextlib
import copy
import importlib.util
import inspect
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
from typing import Literal, Optional

import ale_py
import gymnasium as gym
import numpy as np
import torch
import torch.multiprocessing as mp
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
    """an Atari id as in EnvPool (`Pong-v5`, `Breakout-v5`, ...; EnvPool's preprocessing on ale-py) or any gymnasium id
    with discrete actions and vector or image observations (`CartPole-v1`; `my_module:MyEnv-v0` imports my_module)"""
    total_timesteps: int = 50_000_000
    """total environment steps over all actors (an Atari step is 4 frames)"""

    # Algorithm specific arguments
    num_actors: int = 2
    """the number of actor processes"""
    num_envs_per_actor: int = 4
    """environments stepped by each actor, with batched inference"""
    num_buffers: Optional[int] = None
    """shared-memory rollout slots; default: 2 * (num_actors * num_envs_per_actor + batch_size)"""
    num_learner_threads: int = 1
    """learner threads; more than one overlaps batching with the update"""
    num_torch_threads: Optional[int] = None
    """torch intra-op threads of the learner (each actor uses one); default: 2 in float32, 1 with bf16"""

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
    """path of a checkpoint.pt to continue (same run folder, step count and schedule)"""
    eval_checkpoint: Optional[str] = None
    """path of a checkpoint.pt to evaluate instead of training"""
    eval_episodes: int = 10
    """the number of full games played by evaluation"""

    # to be filled in runtime
    run_name: str = ""
    """the run's folder under runs/ (set from the checkpoint when resuming)"""
    wandb_id: tyro.conf.Suppress[Optional[str]] = None
    """the W&B run's id, kept in the checkpoint so that a resumed run continues it"""


def make_env(args):
    """An env that resets itself on the step after an episode ends, ignoring that step's action (as EnvPool does).
    Seed it with its first `reset(seed=...)`. Atari ids get EnvPool's preprocessing (AtariEnv); any other gymnasium id
    is made as it is (`my_module:MyEnv-v0` imports my_module first, where MyEnv-v0 registers itself), its images
    turned channels-first."""
    if is_atari(args.env_id):
        env = AtariEnv(args.env_id, args.episodic_life, args.repeat_action_probability)
    else:
        env = gym.make(args.env_id)
        env = channels_first(env) if is_hwc(env.observation_space) else env
    return gym.wrappers.Autoreset(env)


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


# ALGO LOGIC: acting. Actor processes (`actor`, below the fence) step their envs with `act` on the shared CPU agent and
# record, at each step, the env's fields (obs, reward, terminated, truncated), the action and these outputs of the
# agent's forward on the obs, by name: compute_loss reads each as batch[name], [T + 1, B, ...]. A new recorded quantity
# (the acting policy's values, for a value clip) is one more name.
RECORDED_OUTPUTS = ("logits",)


@torch.no_grad()
def act(agent, obs, first, core_state):
    """The policy's step: obs [n, *obs_shape], first [n] (True where obs starts an episode) -> the action [n] sampled from
    the policy, the RECORDED_OUTPUTS {name: [n, ...]}, the core state after obs."""
    output = agent(obs[None], first[None], core_state)
    action = torch.multinomial(torch.softmax(output["logits"][0], dim=-1), 1).squeeze(-1)
    return action, {key: output[key][0] for key in RECORDED_OUTPUTS}, output["core_state"]


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


def learn(agent, optimizer, batch, args, global_step):
    """One update on a batch of rollouts [T + 1, B, ...]: the loss (V-trace under the current parameters), its gradient
    clipped to `max_grad_norm`, one optimizer step. Returns the stats as floats. All of the batch or none: if the
    gradient, or the network's outputs after the step, are not finite, the parameters and the optimizer state go back
    to what they were before the batch and FloatingPointError is raised."""
    fraction_left = max(0.0, 1.0 - global_step / args.anneal_lr_timesteps)  # never below 0
    learning_rate = args.learning_rate * (fraction_left if args.anneal_lr else 1.0)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate
    with all_or_nothing(agent, optimizer):
        loss, stats = compute_loss(agent, batch, args)
        stats = scalar_stats(stats, loss.device)
        optimizer.zero_grad()
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)  # the norm before clipping
        if not torch.isfinite(grad_norm):
            bad = [key.split("/")[1] for key, value in stats.items() if not torch.isfinite(value)]
            raise FloatingPointError(f"not finite ({', '.join(bad) or 'the gradient'})")
        optimizer.step()
        finite = outputs_finite(agent, batch).float()
        if not finite:
            raise FloatingPointError("not finite after its step (the network's outputs: the step blew the weights up)")
        stats.update({"losses/grad_norm": grad_norm, "stats/grad_clipped": (grad_norm > args.max_grad_norm).float()})
        stats = dict(zip(stats, torch.stack(list(stats.values())).tolist()))  # floats, with one device sync
    stats["charts/learning_rate"] = learning_rate
    return stats


# ======================================================================================================================
# MACHINERY: what a researcher does not need to touch. The batch helpers (the forward over rollouts, the replay buffer
# the learner thread mixes in), precision detection, EnvPool's Atari preprocessing on ale-py, the actor
# processes and their shared-memory buffers, video, evaluation, argument checks, checkpoint I/O, signals and the
# learner's counters, then the main program: actor processes, learner threads, supervision, logging and shutdown.
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
    return f"ALE/{env_id}" in gym.registry


def bf16_native():
    """True where the network's devices run bfloat16 natively: the actors' CPU (AVX512-BF16 or AMX) and, if the learner
    is on CUDA, its GPU (Ampere on). Elsewhere bf16 is emulated and slower than float32. (Off with a torch that
    lacks these CPU checks.)"""
    cpu = any(getattr(torch.cpu, check, lambda: False)() for check in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return cpu and (not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] >= 8)


class AtariEnv(gym.Env):
    """EnvPool's Atari preprocessing on ale-py, so that a score here means what it means in EnvPool.

    No-op reset (1 to 30 no-ops, one fewer with fire reset), FIRE on reset, 4-frame skip with
    max over the last two frames, 84x84 grayscale (area resize), 4 stacked frames, a cap of
    27,000 steps. With `episodic_life`, losing a life ends the episode for learning and the
    next reset carries on with the same game. `info["terminated"]` is True when the game is over.
    """

    def __init__(self, env_id, episodic_life, repeat_action_probability, noop_max=30, frame_skip=4, max_episode_steps=27_000):
        self.ale_env = gym.make(
            f"ALE/{env_id}",
            frameskip=1,
            repeat_action_probability=repeat_action_probability,
            full_action_space=False,
            max_num_frames_per_episode=None,
        ).unwrapped
        self.ale = self.ale_env.ale
        self.action_set = self.ale.getMinimalActionSet()
        self.fire_reset = ale_py.Action.FIRE in self.action_set
        self.episodic_life, self.noop_max, self.frame_skip = episodic_life, noop_max, frame_skip
        self.max_episode_steps, self.elapsed_step, self.lives = max_episode_steps, max_episode_steps, 0
        self.observation_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
        self.action_space = gym.spaces.Discrete(len(self.action_set))
        self.screens = np.zeros((2, 210, 160), np.uint8)  # the last two frames of a skip
        self.stack = np.zeros((4, 84, 84), np.uint8)
        self.resize_rows, self.resize_cols = area_resize_matrix(210, 84), area_resize_matrix(160, 84)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self.ale_env.reset(seed=seed)  # seeds the emulator
            self.elapsed_step = self.max_episode_steps
        new_game = not self.episodic_life or self.ale.game_over() or self.elapsed_step >= self.max_episode_steps
        if new_game:
            self.ale.reset_game()
            self.elapsed_step = 0
        for _ in range(self.np_random.integers(self.noop_max) + 1 - self.fire_reset):
            self.ale.act(ale_py.Action.NOOP)
            if self.ale.game_over():
                self.ale.reset_game()
                new_game = True
        if self.fire_reset:
            self.ale.act(ale_py.Action.FIRE)
        self.ale.getScreenGrayscale(self.screens[0])
        self.push_frame(self.screens[0], fill=new_game)
        self.lives = self.ale.lives()
        return self.stack.copy(), {"lives": self.lives, "terminated": False}

    def step(self, action):
        reward = 0.0
        for skip in range(self.frame_skip):
            reward += self.ale.act(self.action_set[action])
            game_over = self.ale.game_over()
            if skip >= self.frame_skip - 2:
                self.ale.getScreenGrayscale(self.screens[skip - self.frame_skip + 2])
            if game_over:
                break
        self.push_frame(self.screens.max(0) if skip == self.frame_skip - 1 else self.screens[0])
        self.elapsed_step += 1
        life_lost = self.episodic_life and 0 < self.ale.lives() < self.lives
        self.lives = self.ale.lives()
        terminated = game_over or life_lost
        truncated = not terminated and self.elapsed_step >= self.max_episode_steps
        return self.stack.copy(), reward, terminated, truncated, {"lives": self.lives, "terminated": game_over}

    def push_frame(self, screen, fill=False):
        frame = np.rint(self.resize_rows @ screen @ self.resize_cols.T).astype(np.uint8)
        self.stack[:-1] = frame if fill else self.stack[1:]
        self.stack[-1] = frame


def is_hwc(space):
    """An image [H, W, C] (C at most 4, H more), as gymnasium's pixel envs give; else [C, H, W] is assumed."""
    return isinstance(space, gym.spaces.Box) and len(space.shape) == 3 and space.shape[-1] <= 4 < space.shape[0]


def channels_first(env):
    """The env with its [H, W, C] images turned [C, H, W], as the convolutions take them."""
    space = env.observation_space
    transposed = gym.spaces.Box(np.moveaxis(space.low, -1, 0), np.moveaxis(space.high, -1, 0), dtype=space.dtype)
    return gym.wrappers.TransformObservation(env, lambda obs: np.moveaxis(obs, -1, 0), transposed)


def area_resize_matrix(src, dst):
    """[dst, src] weights of an area (box-filter) resize: each output averages the inputs it covers."""
    edges = np.arange(dst + 1) * src / dst
    lo, hi = edges[:-1, None], edges[1:, None]
    pixels = np.arange(src)[None, :]
    overlap = np.clip(np.minimum(hi, pixels + 1) - np.maximum(lo, pixels), 0, None)
    return (overlap * dst / src).astype(np.float32)


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


def actor(actor_index, args, agent, buffers, free_queue, full_queue, episode_queue, policy_version, stop):
    """Steps `num_envs_per_actor` envs with the shared CPU `agent`, filling one buffer slot per env per rollout."""
    try:
        torch.set_num_threads(1)
        parent = os.getppid()
        K, T = args.num_envs_per_actor, args.unroll_length
        seed = args.seed + actor_index * K
        torch.manual_seed(seed)
        envs = [make_env(args) for _ in range(K)]
        obs = np.stack([env.reset(seed=seed + k)[0] for k, env in enumerate(envs)])
        # The current step of each env; the last step of one rollout is the first of the next.
        step = dict(
            obs=torch.from_numpy(obs),
            reward=torch.zeros(K),
            terminated=torch.zeros(K, dtype=torch.bool),
            truncated=torch.zeros(K, dtype=torch.bool),
            action=torch.zeros(K, dtype=torch.int64),
        )
        first = torch.ones(K, dtype=torch.bool)  # step["obs"] starts an episode
        core_state = agent.initial_state(K)  # before the current step
        games = GameTracker(args, actor_index, envs, episode_queue, policy_version)

        def policy_step(core_state):  # the action and the recorded outputs on the current step, into `step`
            action, recorded, next_state = act(agent, step["obs"], first, core_state)
            step.update(recorded, action=action)
            return next_state

        next_core_state = policy_step(core_state)
        while True:
            indices = [free_slot(free_queue, stop, parent) for _ in range(K)]
            if None in indices:
                break
            for k, index in enumerate(indices):
                buffers["policy_version"][index] = policy_version.value
                if core_state:  # the state the core starts obs[0] from, already reset if obs[0] starts an episode
                    buffers["core_state"][index] = torch.stack([s[k] for s in core_state]) * ~first[k]
            for t in range(T + 1):
                if t > 0:
                    # EnvPool-style auto-reset: an env whose last step ended its episode returns the reset obs now.
                    first = step["terminated"] | step["truncated"]
                    for k, env in enumerate(envs):
                        obs, reward, terminated, truncated, info = env.step(step["action"][k].item())
                        step["obs"][k] = torch.from_numpy(obs)
                        step["reward"][k], step["terminated"][k], step["truncated"][k] = reward, terminated, truncated
                        games.step(k, first[k], reward, truncated or info.get("terminated", terminated))  # not just a life
                    core_state, next_core_state = next_core_state, policy_step(next_core_state)
                for k, index in enumerate(indices):
                    for key, value in step.items():
                        buffers[key][index, t] = value[k]
            for index in indices:
                full_queue.put(index)
        games.close()
    except Exception:
        traceback.print_exc()
        sys.stderr.write(f"actor {actor_index} failed\n")
        sys.exit(1)


def create_buffers(args, obs_space, agent):
    """Shared-memory rollout slots: [num_buffers, T + 1, ...] per step, [num_buffers, ...] per rollout. The agent's
    RECORDED_OUTPUTS get their shapes from a forward on one zero obs."""
    T = args.unroll_length
    obs_dtype = torch.from_numpy(np.zeros(0, obs_space.dtype)).dtype
    core_state = agent.initial_state(1)
    with torch.no_grad():
        output = agent(torch.zeros(1, 1, *obs_space.shape, dtype=obs_dtype), torch.ones(1, 1, dtype=torch.bool), core_state)
    specs = dict(
        obs=((T + 1, *obs_space.shape), obs_dtype),
        reward=((T + 1,), torch.float32),  # reward received on arriving at obs[t], unclipped
        terminated=((T + 1,), torch.bool),  # obs[t] is terminal (a lost life counts with --episodic-life)
        truncated=((T + 1,), torch.bool),  # obs[t] is the last of an episode cut by the time limit
        action=((T + 1,), torch.int64),  # action taken on obs[t]
        policy_version=((), torch.int64),  # learner updates done when the rollout started
    )
    for key in RECORDED_OUTPUTS:  # the behavior policy's outputs on obs[t] (logits [T + 1, A], ...)
        specs[key] = ((T + 1, *output[key].shape[2:]), output[key].dtype)
    if core_state:
        specs["core_state"] = ((len(core_state), *core_state[0].shape[1:]), torch.float32)  # before obs[0]
    needed = sum(args.num_buffers * int(np.prod(shape)) * dtype.itemsize for shape, dtype in specs.values())
    free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else needed
    if needed > free:
        sys.exit(
            f"error: the rollout buffers need {needed / 2**20:.0f} MiB of shared memory but /dev/shm has "
            f"{free / 2**20:.0f} MiB free: lower --num-buffers or enlarge /dev/shm (docker run --shm-size)"
        )
    return {key: torch.zeros(args.num_buffers, *shape, dtype=dtype).share_memory_() for key, (shape, dtype) in specs.items()}


def free_slot(free_queue, stop, parent):
    """A free rollout slot's index for an actor; None once the run stops or `parent` (the process that started the actor)
    has died."""
    while not stop.is_set() and os.getppid() == parent:
        try:
            return free_queue.get(timeout=1.0)
        except queue.Empty:
            pass
    return None


def get_batch(args, buffers, free_queue, full_queue, stop, device):
    """B full rollouts, time-major on the learner's device; their slots go straight back to the actors. None once the
    run stops."""
    indices = []
    while len(indices) < args.batch_size:
        try:
            indices.append(full_queue.get(timeout=0.5))
        except queue.Empty:
            if stop.is_set():
                return None
    batch = {key: buffer[indices] for key, buffer in buffers.items()}  # [B, ...]
    for index in indices:
        free_queue.put(index)
    # [T + 1, B, ...] per step, core_state [2, B, hidden], policy_version [B]
    return {
        key: (value.transpose(0, 1) if value.dim() > 1 else value).to(device, non_blocking=True)
        for key, value in batch.items()
    }


class GameTracker:
    """Full-game returns and lengths of one actor's envs, sent to the main process as games end (the reset step after a
    final obs belongs to no game); env 0's games also go to the video recorder (--capture-video, actor 0)."""

    def __init__(self, args, actor_index, envs, episode_queue, policy_version):
        self.returns, self.lengths = np.zeros(len(envs)), np.zeros(len(envs), dtype=np.int64)
        self.episode_queue, self.policy_version, self.recorder = episode_queue, policy_version, None
        if args.capture_video and actor_index == 0:  # env 0's games; in eval mode all of them
            self.recorder = GameRecorder(
                envs[0].unwrapped.ale.getScreenRGB,
                os.path.join("videos", args.run_name),
                0 if args.eval_checkpoint else args.video_interval * 60,
            )
            self.recorder.step(True, [], policy_version.value)  # the first game's reset screen

    def step(self, k, first, reward, game_over):
        """Env k's step: `first` where it is the reset step after a final obs, `game_over` where it ended a game."""
        game_over = game_over and not first
        if not first:
            self.returns[k] += reward
            self.lengths[k] += 1
        if self.recorder is not None and k == 0:
            ended = [(self.returns[0], self.lengths[0])] if game_over else []
            self.recorder.step(first and self.lengths[0] == 0, ended, self.policy_version.value)
        if game_over:
            self.episode_queue.put((self.returns[k], self.lengths[k]))
            self.returns[k], self.lengths[k] = 0.0, 0

    def close(self):
        if self.recorder is not None:
            self.recorder.close()


def evaluate(args, agent, obs_space, version, signals):
    """Plays `eval_episodes` full games with one actor in this process, or fewer if a signal stops it; returns their
    returns."""
    args.num_envs_per_actor, args.num_buffers = 1, 2
    buffers = create_buffers(args, obs_space, agent)
    free_queue, full_queue, episode_queue = queue.Queue(), queue.Queue(), queue.Queue()
    for index in range(args.num_buffers):
        free_queue.put(index)
    stop = threading.Event()
    thread = threading.Thread(
        target=actor, args=(0, args, agent, buffers, free_queue, full_queue, episode_queue, mp.Value("l", version), stop)
    )
    thread.start()
    returns = []
    while len(returns) < args.eval_episodes and not signals.received:
        try:
            returns.append(episode_queue.get(timeout=0.01)[0])
        except queue.Empty:
            if not thread.is_alive():
                sys.exit("error: evaluation failed (see the actor's error above)")
        while not full_queue.empty():
            free_queue.put(full_queue.get())
    stop.set()
    thread.join()
    return np.array(returns)


def check_args(args):
    """Exits with a one-line error on bad input, before anything is started."""
    try:
        env = make_env(args)
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        sys.exit(
            f"error: cannot make --env-id {args.env_id!r} ({reason}): use an Atari id as in EnvPool (Pong-v5, ...), a "
            "registered gymnasium id (CartPole-v1, ...), or my_module:MyEnv-v0 to import the module that registers it"
        )
    obs_space, action_space = env.observation_space, env.action_space
    env.close()
    if not isinstance(action_space, gym.spaces.Discrete):
        sys.exit(f"error: --env-id {args.env_id} acts in {action_space}: impala_mono.py learns discrete actions (Discrete)")
    if not (isinstance(obs_space, gym.spaces.Box) and len(obs_space.shape) in (1, 3)):
        sys.exit(
            f"error: --env-id {args.env_id} observes {type(obs_space).__name__}{obs_space.shape or ''}: "
            "impala_mono.py takes a Box of a vector (one dimension) or an image ([H, W, C] or [C, H, W])"
        )
    if len(obs_space.shape) == 3 and args.network == "shallow" and min(obs_space.shape[1:]) < 36:
        sys.exit(
            f"error: --env-id {args.env_id} gives images of {obs_space.shape[1]}x{obs_space.shape[2]} (channels first): "
            "the Nature CNN (--network shallow) needs at least 36x36; use --network deep"
        )
    for name in (
        "total_timesteps",
        "num_actors",
        "num_envs_per_actor",
        "unroll_length",
        "batch_size",
        "num_buffers",
        "num_learner_threads",
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
    for flag, needs, packages in (
        ("track", ["wandb"], "wandb"),
        ("capture_video", ["imageio", "imageio_ffmpeg"], "imageio imageio-ffmpeg"),
    ):
        if getattr(args, flag) and not all(importlib.util.find_spec(name) for name in needs):
            sys.exit(f"error: --{flag.replace('_', '-')} needs {packages}: pip install {packages}")
    if args.capture_video and not is_atari(args.env_id):
        sys.exit(f"error: --capture-video records Atari games; {args.env_id} has no screen to record")
    args.bf16 = args.bf16 and len(obs_space.shape) == 3  # the classic-control MLPs ran slower in bf16
    if args.num_torch_threads is None:  # bf16's cheaper network wants fewer threads (docs/experiments.md, threads)
        args.num_torch_threads = 1 if args.bf16 else 2
    num_envs = args.num_actors * args.num_envs_per_actor
    if args.num_buffers is None:
        args.num_buffers = 2 * (num_envs + args.batch_size)
    if args.num_buffers < num_envs + args.batch_size:
        sys.exit(
            f"error: --num-buffers {args.num_buffers} is too small: each of the {num_envs} envs fills a slot while the "
            f"learner gathers --batch-size {args.batch_size}; use at least {num_envs + args.batch_size}"
        )
    if args.resume and args.eval_checkpoint:
        sys.exit(
            "error: --resume and --eval-checkpoint both name a checkpoint: pass --resume to train on, or "
            "--eval-checkpoint to evaluate"
        )
    for name in ("resume", "eval_checkpoint"):
        path = getattr(args, name)
        if path is not None and not os.path.isfile(path):
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
    """Trains (or, with --eval-checkpoint, evaluates) as the flags say: set up the agent, optimizer and writer, start
    the actor processes and learner threads, supervise them, save on the way out (also when `signals`, a StopSignals,
    received one). Returns the exit code."""
    checkpoint = load_checkpoint(args.resume or args.eval_checkpoint, args) if (args.resume or args.eval_checkpoint) else None
    if checkpoint is not None:
        args.run_name = os.path.basename(os.path.dirname(os.path.abspath(args.resume or args.eval_checkpoint)))
    if not args.run_name:
        env_name = args.env_id.replace("/", "-")  # ALE/Pong-v5: one folder, not two
        args.run_name = f"{env_name}__{args.exp_name}__{args.seed}__{int(time.time())}"

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_num_threads(args.num_torch_threads)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    env = make_env(args)
    obs_space = env.observation_space
    env.close()
    agent = make_agent(args, obs_space, env.action_space)
    if checkpoint is not None:
        optimizer = None if args.eval_checkpoint else make_optimizer(args, agent)
        build = lambda flags: make_agent(flags, obs_space, env.action_space)  # noqa: E731
        check_resumable(args.resume or args.eval_checkpoint, checkpoint, agent, args, build, optimizer)
        agent.load_state_dict(checkpoint["model"])
    # The CPU copy the actors act with, in shared memory. With bf16 it holds bf16 parameters: autocast would otherwise
    # cast the weights anew at every step.
    actor_agent = copy.deepcopy(agent).to(agent.dtype).share_memory()

    if args.eval_checkpoint:
        returns = evaluate(args, actor_agent, obs_space, checkpoint["num_updates"], signals)
        if signals.received:
            print(f"interrupted after {len(returns)} of {args.eval_episodes} games", flush=True)
        if not len(returns):
            return 0
        print(
            f"{args.env_id}: mean return {returns.mean():.2f} +- {returns.std():.2f} over {len(returns)} games "
            f"({args.eval_checkpoint}, global_step {checkpoint['global_step']})"
        )
        return 0

    agent.to(device)
    optimizer = make_optimizer(args, agent)  # on the parameters' device
    replay = Replay(args.replay_proportion, args.replay_buffer)  # empty on --resume: it refills in replay_buffer updates
    progress = Progress()
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])  # its state, and the hyperparameters it was saved with:
        for group in optimizer.param_groups:  # those the flags given set instead (--rmsprop-eps, ...)
            group.update(optimizer.defaults)
        progress = Progress(checkpoint["global_step"], checkpoint["num_updates"])
    run_dir = os.path.join("runs", args.run_name)
    checkpoint_path = os.path.join(run_dir, "checkpoint.pt")
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
    writer = SummaryWriter(run_dir, purge_step=progress.global_step + 1 if args.resume else None)
    table = "\n".join(f"|{key}|{value}|" for key, value in vars(args).items())
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
    precision = str(agent.dtype)[len("torch.") :]
    print(f"{run_dir}: learner on {device}, network forward in {precision}", flush=True)

    # TRY NOT TO MODIFY: start the actors
    buffers = create_buffers(args, obs_space, actor_agent)
    ctx = mp.get_context("fork")
    free_queue, full_queue, episode_queue = ctx.Queue(), ctx.Queue(), ctx.Queue()
    policy_version = ctx.Value("l", progress.num_updates)
    stop = ctx.Event()  # ends the actors and the learner threads
    for index in range(args.num_buffers):
        free_queue.put(index)
    actors = []
    for actor_index in range(args.num_actors):
        actor_args = (actor_index, args, actor_agent, buffers, free_queue, full_queue, episode_queue, policy_version, stop)
        process = ctx.Process(target=actor, args=actor_args, daemon=True)  # forked: StopSignals ignores its signals
        process.start()
        actors.append(process)

    # TRY NOT TO MODIFY: the learner threads; the update itself is `learn`
    batch_lock, learn_lock = threading.Lock(), threading.Lock()
    learner_errors = []

    def learner_thread():
        try:
            while not stop.is_set() and progress.global_step < args.total_timesteps:
                wait_start = time.time()
                with batch_lock:
                    batch = get_batch(args, buffers, free_queue, full_queue, stop, device)
                if batch is None:
                    return
                with learn_lock:
                    if stop.is_set() or progress.global_step >= args.total_timesteps:
                        return  # another learner thread's update ended the run while this one waited
                    update_start = time.time()
                    batch = replay.mix(batch)
                    try:
                        stats = learn(agent, optimizer, batch, args, progress.global_step)
                    except FloatingPointError as e:
                        learner_errors.append(
                            f"update {progress.num_updates + 1} at global_step={progress.global_step} is "
                            f"{e}: not applied, the checkpoint keeps the parameters before it; lower "
                            "--learning-rate or check the rewards"
                        )
                        stop.set()
                        return
                    except StatError as e:
                        learner_errors.append(f"{e}; update {progress.num_updates + 1} not applied")
                        stop.set()
                        return
                    actor_agent.load_state_dict(agent.state_dict())
                    stats["stats/policy_lag"] = progress.num_updates - batch["policy_version"].float().mean().item()
                    progress.num_updates += 1
                    policy_version.value = progress.num_updates
                    progress.global_step += args.unroll_length * args.batch_size
                    stats["stats/batch_wait_time"] = update_start - wait_start
                    stats["stats/update_time"] = time.time() - update_start
                    for tag, value in stats.items():
                        writer.add_scalar(tag, value, progress.global_step)
        except Exception as e:
            learner_errors.append(f"the learner failed: {e!r}")
            traceback.print_exc()
            stop.set()

    # TRY NOT TO MODIFY: run until done or a signal, watching the actors; save on the way out
    # daemon: a thread stuck past its bounded join (below) cannot keep the process alive
    learners = [threading.Thread(target=learner_thread, daemon=True) for _ in range(args.num_learner_threads)]
    start_time = last_log = last_checkpoint = last_progress = time.time()
    start_step = last_progress_step = progress.global_step
    recent_returns = collections.deque(maxlen=20)
    exit_code = 0
    try:
        for thread in learners:
            thread.start()
        signals.waiting_for = "the run to stop"
        while any(thread.is_alive() for thread in learners):
            time.sleep(0.1)
            if signals.received:
                print(f"interrupted at global_step={progress.global_step}", flush=True)
                break
            while not episode_queue.empty():
                episodic_return, episodic_length = episode_queue.get()
                recent_returns.append(episodic_return)
                writer.add_scalar("charts/episodic_return", episodic_return, progress.global_step)
                writer.add_scalar("charts/episodic_length", episodic_length, progress.global_step)
            if learner_errors:  # before the actors: they end when a failed learner stops the run
                raise RuntimeError(learner_errors[0])
            failed = [(i, p.exitcode) for i, p in enumerate(actors) if not p.is_alive()]
            if failed:
                raise RuntimeError(f"actor {failed[0][0]} exited with code {failed[0][1]}")
            now = time.time()
            if progress.global_step != last_progress_step:
                last_progress, last_progress_step = now, progress.global_step
            elif now - last_progress > args.stall_timeout:
                side = "the learner (rollouts wait for it)" if full_queue.qsize() else "the actors (no batch came)"
                raise RuntimeError(f"no update for {now - last_progress:.0f} s (--stall-timeout): {side} stalled")
            if now - last_log >= 5.0:
                sps = int((progress.global_step - start_step) / (now - start_time))
                writer.add_scalar("charts/SPS", sps, progress.global_step)
                writer.add_scalar("stats/full_queue_size", full_queue.qsize(), progress.global_step)
                mean_return = f"{np.mean(recent_returns):.2f}" if recent_returns else "n/a"
                print(
                    f"global_step={progress.global_step} SPS={sps} updates={progress.num_updates} "
                    f"episodic_return(last {len(recent_returns)})={mean_return}",
                    flush=True,
                )
                last_log = now
            if now - last_checkpoint >= args.checkpoint_interval:
                with learn_lock:
                    save_checkpoint(checkpoint_path, agent, optimizer, progress.global_step, progress.num_updates, args)
                last_checkpoint = now
        if learner_errors:
            raise RuntimeError(learner_errors[0])
    except RuntimeError as e:
        print(f"error: {e}; stopping the run", file=sys.stderr, flush=True)
        exit_code = 1
    finally:
        stop.set()
        # Each learner thread gets --stall-timeout to finish its update; the actors end their rollout or are killed.
        signals.waiting_for = "the learner threads' updates"
        for thread in learners:
            thread.join(timeout=args.stall_timeout)
        stuck = any(thread.is_alive() for thread in learners)
        signals.waiting_for = "the actor processes to stop"
        for process in actors:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
        if stuck:
            print("error: a learner's update did not end within --stall-timeout: not saving", file=sys.stderr, flush=True)
            exit_code = 1
        else:
            signals.waiting_for = f"the checkpoint to be written to {checkpoint_path}"
            saved = save_checkpoint(checkpoint_path, agent, optimizer, progress.global_step, progress.num_updates, args)
            exit_code = exit_code if saved else 1
            print(
                f"{'saved' if saved else 'did not save'} {checkpoint_path} at global_step={progress.global_step} "
                f"(mean of the last {len(recent_returns)} episodic returns: "
                f"{np.mean(recent_returns) if recent_returns else float('nan'):.2f})",
                flush=True,
            )
        writer.close()
    return exit_code


if __name__ == "__main__":
    signals = StopSignals()  # first: from here on a signal asks the run to stop, whenever it comes
    args = tyro.cli(Args)
    check_args(args)
    sys.exit(train(args, signals))
