"""impala_mono.py on a user's own gymnasium envs, registered by a module of the test's (as `my_module:MyEnv-v0`
imports it): vector and image observations learn, images in either layout reach the network channels first, and the
spaces it cannot serve are one error line before anything starts."""

import os

import numpy as np
import pytest
import torch

import impala_mono
from helpers import error_line, run, scalars, train

MY_ENVS = '''
import gymnasium as gym
import numpy as np


class Signal(gym.Env):
    """Each observation says which of two actions pays 1 (the other pays 0); 8 steps a game, so perfect play scores 8
    and random play 4 on average. A vector (+-1 first), or an image whose left or right half is lit."""

    def __init__(self, layout="vector", size=12):
        self.layout, self.size = layout, size
        self.action_space = gym.spaces.Discrete(2)
        if layout == "vector":
            self.observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
        else:
            shape = (size, size, 3) if layout == "hwc" else (3, size, size)
            self.observation_space = gym.spaces.Box(0, 255, shape, np.uint8)

    def observe(self):
        if self.layout == "vector":
            return np.array([1.0 if self.target else -1.0, 0.0, 0.0, 0.0], np.float32)
        image = np.zeros((self.size, self.size, 3), np.uint8)
        if self.target:
            image[:, self.size // 2 :] = 255
        else:
            image[:, : self.size // 2] = 255
        return image if self.layout == "hwc" else np.ascontiguousarray(image.transpose(2, 0, 1))

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.target = 0, int(self.np_random.integers(2))
        return self.observe(), {}

    def step(self, action):
        reward = float(action == self.target)
        self.t, self.target = self.t + 1, int(self.np_random.integers(2))
        return self.observe(), reward, self.t >= 8, False, {}


class Pointer(Signal):
    """Continuous actions."""

    def __init__(self):
        super().__init__()
        self.action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)


class Sensors(Signal):
    """A Dict observation."""

    def __init__(self):
        super().__init__()
        self.observation_space = gym.spaces.Dict({"position": gym.spaces.Box(-1.0, 1.0, (4,), np.float32)})


gym.register("Signal-v0", entry_point=Signal)
gym.register("SignalHWC-v0", entry_point=Signal, kwargs={"layout": "hwc"})
gym.register("SignalCHW-v0", entry_point=Signal, kwargs={"layout": "chw", "size": 40})
gym.register("Pointer-v0", entry_point=Pointer)
gym.register("Sensors-v0", entry_point=Sensors)
'''

FLAGS = ["--num-actors", 1, "--num-envs-per-actor", 4, "--unroll-length", 10, "--batch-size", 4]


@pytest.fixture
def my_envs(tmp_path, monkeypatch):
    """tmp_path/code/my_envs.py, importable here and by the script's processes (PYTHONPATH)."""
    os.makedirs(tmp_path / "code")
    (tmp_path / "code" / "my_envs.py").write_text(MY_ENVS)
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    return {"PYTHONPATH": str(tmp_path / "code")}


@pytest.mark.slow
@pytest.mark.parametrize(
    "env_id, flags, first_weight",
    [
        ("my_envs:Signal-v0", [], ("actor.0.weight", (256, 4))),  # the vector goes to the MLPs as it is
        ("my_envs:SignalHWC-v0", ["--network", "deep"], ("torso.0.conv.weight", (16, 3, 3, 3))),  # 3 channels, not 12
        ("my_envs:SignalCHW-v0", [], ("torso.0.weight", (32, 3, 8, 8))),  # 40x40: the Nature CNN
    ],
    ids=["vector", "hwc-12x12", "chw-40x40"],
)
def test_a_registered_env_learns(tmp_path, my_envs, env_id, flags, first_weight):
    """4000 steps (perfect play came after ~1500 in trials): the last 20 games average at least 7.5 of 8 (random: 4)."""
    run_dir = train("impala_mono.py", env_id, 4000, [*FLAGS, *flags], tmp_path, env=my_envs)
    returns = [value for _, value in scalars(run_dir, "charts/episodic_return")]
    assert len(returns) >= 400 and np.mean(returns[-20:]) >= 7.5, returns[-20:]
    name, shape = first_weight
    assert torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)["model"][name].shape == shape


@pytest.mark.parametrize(
    "env_id, flags, message",
    [
        (
            "my_envs:Pointer-v0",
            [],
            "error: --env-id my_envs:Pointer-v0 acts in Box(-1.0, 1.0, (1,), float32): impala_mono.py learns discrete "
            "actions (Discrete)",
        ),
        (
            "my_envs:Sensors-v0",
            [],
            "error: --env-id my_envs:Sensors-v0 observes Dict: impala_mono.py takes a Box of a vector (one dimension) or "
            "an image ([H, W, C] or [C, H, W])",
        ),
        (
            "my_envs:SignalHWC-v0",
            [],
            "error: --env-id my_envs:SignalHWC-v0 gives images of 12x12 (channels first): the Nature CNN (--network "
            "shallow) needs at least 36x36; use --network deep",
        ),
    ],
    ids=["box-actions", "dict-obs", "small-image-shallow"],
)
def test_a_space_it_cannot_serve_is_one_error(my_envs, env_id, flags, message):
    with pytest.raises(SystemExit) as exit:
        impala_mono.check_args(impala_mono.Args(env_id=env_id))
    assert exit.value.code == message


def test_the_error_reaches_the_user_as_one_line(tmp_path, my_envs):
    result = run("impala_mono.py", "--env-id", "my_envs:Sensors-v0", cwd=tmp_path, env=my_envs)
    assert error_line(result).startswith("error: --env-id my_envs:Sensors-v0 observes Dict")
    assert not os.path.exists(tmp_path / "runs")


def test_an_unknown_id_is_one_error_with_gymnasiums_reason(my_envs):
    with pytest.raises(SystemExit) as exit:
        impala_mono.check_args(impala_mono.Args(env_id="my_envs:Nothing-v0"))
    assert exit.value.code.startswith("error: cannot make --env-id 'my_envs:Nothing-v0' (Environment `Nothing` doesn't exist.")
    assert exit.value.code.endswith(
        "): use an Atari id as in EnvPool (Pong-v5, ...), a registered gymnasium id (CartPole-v1, ...), or "
        "my_module:MyEnv-v0 to import the module that registers it"
    )
