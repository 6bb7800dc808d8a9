"""--layer-norm, in both scripts: where the LayerNorm sits, that checkpoints written before the flag still load, and the
one-line errors for a run it cannot serve. Its training, saving and evaluation on Atari are in UPDATES_THEN_EVAL_CASES."""

import os

import pytest
import torch
from torch import nn

import impala_mono
import impala_poly
from helpers import CARTPOLE_FLAGS, error_line, run

SCRIPTS = {"impala_mono.py": impala_mono, "impala_poly.py": impala_poly}


@pytest.mark.parametrize("network", ["shallow", "deep"])
def test_the_layer_norm_sits_between_the_torso_linear_layer_and_its_relu(network):
    default = impala_poly.Agent((4, 84, 84), 6, network)
    normed = impala_poly.Agent((4, 84, 84), 6, network, layer_norm=True)
    linear, norm, relu = normed.torso[-3:]
    assert isinstance(linear, nn.Linear) and isinstance(relu, nn.ReLU)
    assert isinstance(norm, nn.LayerNorm) and norm.normalized_shape == (linear.out_features,)
    # The default adds no key: the checkpoints written before the flag existed load as they are.
    index = len(default.torso) - 2
    assert set(normed.state_dict()) - set(default.state_dict()) == {f"torso.{index}.weight", f"torso.{index}.bias"}
    assert set(default.state_dict()) <= set(normed.state_dict())
    # Per frame, the ReLU's input has mean 0 and variance 1 (the LayerNorm's gain 1 and bias 0 at the start).
    features = normed.torso[:-1](torch.rand(8, 4, 84, 84).contiguous(memory_format=torch.channels_last))
    assert torch.allclose(features.mean(dim=1), torch.zeros(8), atol=1e-5)
    assert torch.allclose(features.var(dim=1, unbiased=False), torch.ones(8), atol=1e-3)


@pytest.mark.parametrize("script", SCRIPTS)
def test_layer_norm_on_vector_observations_is_an_error(tmp_path, script):
    result = run(script, "--env-id", "CartPole-v1", *CARTPOLE_FLAGS[script], "--layer-norm", cwd=tmp_path)
    assert error_line(result) == (
        "error: --layer-norm normalizes the Atari torso; CartPole-v1 has vector observations: drop the flag"
    )
    assert not os.path.exists(tmp_path / "runs")


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_checkpoint_from_before_the_flag_is_refused_under_it(tmp_path, script):
    """A checkpoint whose args predate --layer-norm trained without it: resuming or evaluating it with the flag is
    refused in one line, before anything is built."""
    module = SCRIPTS[script]
    trained = vars(module.Args(env_id="Pong-v5"))
    del trained["layer_norm"]
    path = str(tmp_path / "checkpoint.pt")
    torch.save({"args": trained, "model": {}}, path)
    for flag in ("resume", "eval_checkpoint"):
        args = module.Args(env_id="Pong-v5", layer_norm=True, **{flag: path})
        with pytest.raises(SystemExit) as exit_info:
            module.load_checkpoint(path, args)
        assert str(exit_info.value) == (
            f"error: checkpoint {path} is for --layer-norm False, not True: pass the same flag as in training"
        )
