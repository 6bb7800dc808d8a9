"""Failures in a run: a diverged update is never applied nor saved, and a stalled side stops the run; each with one
error line."""

import os

import pytest
import torch

import impala_mono
import impala_poly
from helpers import CARTPOLE_FLAGS as FLAGS
from helpers import error_line, run, scalars, train


@pytest.mark.slow
@pytest.mark.parametrize("script", ["impala_mono.py", "impala_poly.py"])
def test_non_finite_update_stops_the_run_and_keeps_the_checkpoint(tmp_path, script):
    """--vf-coef 1e38 makes the first loss of the resumed run infinite: that update is not applied, the run exits
    non-zero with one error line naming it, and the checkpoint holds the finite parameters of step 80."""
    run_dir = train(script, "CartPole-v1", 80, FLAGS[script], tmp_path)
    path = os.path.join(run_dir, "checkpoint.pt")
    good = torch.load(path, weights_only=True)
    assert scalars(run_dir, "losses/grad_norm") and all(
        0 < norm < float("inf") for _, norm in scalars(run_dir, "losses/grad_norm")
    )

    result = run(
        script,
        "--env-id",
        "CartPole-v1",
        "--total-timesteps",
        160,
        *FLAGS[script],
        "--vf-coef",
        1e38,
        "--resume",
        path,
        cwd=tmp_path,
    )
    assert error_line(result).startswith("error: update 3 at global_step=80 is not finite (loss): not applied"), result.stderr
    checkpoint = torch.load(path, weights_only=True)
    assert (checkpoint["global_step"], checkpoint["num_updates"]) == (80, 2)
    assert all(torch.equal(checkpoint["model"][key], good["model"][key]) for key in good["model"])
    assert [step for step, _ in scalars(run_dir, "losses/loss")] == [40, 80]  # nothing logged for the bad update


@pytest.mark.parametrize("script", [impala_mono, impala_poly], ids=["mono", "poly"])
def test_save_checkpoint_keeps_the_previous_one_and_refuses_non_finite(tmp_path, script, capsys):
    agent = script.Agent((4,), 2)
    optimizer = torch.optim.RMSprop(agent.parameters())
    args = script.Args(env_id="CartPole-v1")
    path = str(tmp_path / "checkpoint.pt")
    assert script.save_checkpoint(path, agent, optimizer, 10, 1, args)
    assert script.save_checkpoint(path, agent, optimizer, 20, 2, args)
    steps = lambda p: torch.load(p, weights_only=True)["global_step"]  # noqa: E731
    assert (steps(path), steps(str(tmp_path / "checkpoint.prev.pt"))) == (20, 10)
    with torch.no_grad():
        agent.actor[0].weight[0, 0] = float("nan")
    assert not script.save_checkpoint(path, agent, optimizer, 30, 3, args)
    assert (steps(path), steps(str(tmp_path / "checkpoint.prev.pt"))) == (20, 10)
    assert capsys.readouterr().err.startswith("error: the parameters are not finite at global_step=30")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.prev.pt", "checkpoint.pt"]  # no temporary file left


@pytest.mark.slow
@pytest.mark.parametrize("script", ["impala_mono.py", "impala_poly.py"])
def test_stalled_actors_stop_the_run(tmp_path, script):
    """One CartPole env with rollouts of 20,000 steps takes 10-20 s to fill a batch of 4 (~5k steps/s here; with
    rollouts of 2000 a batch came within 2 s about half the time): the learner waits, and after --stall-timeout 2 the
    run stops, naming the actors."""
    flags = {
        "impala_mono.py": ["--num-actors", 1, "--num-envs-per-actor", 1],
        "impala_poly.py": ["--num-envs", 1, "--num-threads", 1],
    }[script]
    result = run(
        script,
        "--env-id",
        "CartPole-v1",
        *flags,
        "--unroll-length",
        20000,
        "--batch-size",
        4,
        "--stall-timeout",
        2,
        cwd=tmp_path,
        timeout=60,
    )
    assert error_line(result).startswith("error: no update for 2 s (--stall-timeout): the actors (no batch came) stalled")


def adam_state(path):
    """The checkpoint at `path` with the state of an Adam optimizer (after one step) in place of RMSprop's, as a run
    with an edited make_optimizer would save."""
    checkpoint = torch.load(path, weights_only=True)
    agent = impala_poly.Agent((4,), 2)
    agent.load_state_dict(checkpoint["model"])
    optimizer = torch.optim.Adam(agent.parameters())
    for p in agent.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    checkpoint["optimizer"] = optimizer.state_dict()
    return checkpoint


def wider_network(path):
    """The checkpoint at `path` with a policy network whose first layer is wider, as an edited Agent would save."""
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["model"]["actor.0.weight"] = torch.zeros(300, 4)
    return checkpoint


@pytest.mark.parametrize("script", [impala_mono, impala_poly], ids=["mono", "poly"])
@pytest.mark.parametrize(
    "edit, message",
    [
        (adam_state, "holds the state of another optimizer (exp_avg, exp_avg_sq, step) than RMSprop: resume with the "
                     "optimizer it was trained with (make_optimizer), or start a new run"),
        (wider_network, "holds another network (actor.0.weight differs): resume it with the network it was trained with, "
                        "or start a new run"),
    ],
    ids=["optimizer", "network"],
)  # fmt: skip
def test_resume_refuses_another_optimizer_or_network(tmp_path, script, edit, message):
    """A checkpoint written by other code (another optimizer, an edited network) is refused before anything starts:
    one error line, exit 1, the file left byte for byte as it was and nothing logged."""
    agent = script.Agent((4,), 2)
    trained = script.Args(env_id="CartPole-v1")
    optimizer = script.make_optimizer(trained, agent)
    for p in agent.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # an RMSprop state to replace
    path = str(tmp_path / "runs" / "run" / "checkpoint.pt")
    os.makedirs(os.path.dirname(path))
    assert script.save_checkpoint(path, agent, optimizer, 40, 1, trained)
    torch.save(edit(path), path)
    with open(path, "rb") as f:
        before = f.read()
    name = f"{script.__name__}.py"
    flags = [*FLAGS[name], "--resume", path]
    result = run(name, "--env-id", "CartPole-v1", "--total-timesteps", 80, *flags, cwd=tmp_path)
    assert result.returncode == 1
    assert error_line(result) == f"error: checkpoint {path} {message}"
    with open(path, "rb") as f:
        assert f.read() == before
    assert os.listdir(os.path.dirname(path)) == ["checkpoint.pt"]  # no events file: nothing started


@pytest.mark.slow
@pytest.mark.parametrize("script", ["impala_mono.py", "impala_poly.py"])
def test_a_resumed_run_steps_the_optimizer_under_the_flags_given(tmp_path, script):
    """torch's load_state_dict also restores the hyperparameters an optimizer was saved with; a resumed run goes on
    under the flags given (README), so the checkpoint it saves holds the new RMSProp epsilon and alpha."""
    run_dir = train(script, "CartPole-v1", 80, FLAGS[script], tmp_path)
    path = os.path.join(run_dir, "checkpoint.pt")
    assert {(g["eps"], g["alpha"]) for g in torch.load(path, weights_only=True)["optimizer"]["param_groups"]} == {(0.01, 0.99)}
    flags = ["--rmsprop-eps", 0.001, "--rmsprop-alpha", 0.9, "--resume", path]
    result = run(script, "--env-id", "CartPole-v1", "--total-timesteps", 160, *FLAGS[script], *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    resumed = torch.load(path, weights_only=True)
    assert resumed["global_step"] >= 160
    assert {(g["eps"], g["alpha"]) for g in resumed["optimizer"]["param_groups"]} == {(0.001, 0.9)}


@pytest.mark.parametrize("script", [impala_mono, impala_poly], ids=["mono", "poly"])
def test_resume_under_other_flags_warns(tmp_path, script, capsys):
    """A resumed run goes on under the flags given: one warning line names each learning flag that differs from the
    checkpoint's (here the learning rate's horizon and the entropy cost); the same flags, a longer budget (which changes
    nothing the run learns) or an evaluation print nothing."""

    def args(**flags):  # the flags the checkpoint was trained with, and `flags`
        return script.Args(**{"env_id": "CartPole-v1", "ent_coef": 0.01, "anneal_lr_timesteps": 50_000_000, **flags})

    agent = script.Agent((4,), 2)
    trained = args(total_timesteps=1000)
    path = str(tmp_path / "checkpoint.pt")
    assert script.save_checkpoint(path, agent, script.make_optimizer(trained, agent), 400, 10, trained)
    capsys.readouterr()

    script.load_checkpoint(path, args(total_timesteps=1000, resume=path))
    script.load_checkpoint(path, args(total_timesteps=2000, resume=path))
    script.load_checkpoint(path, args(ent_coef=0.5, eval_checkpoint=path))
    assert capsys.readouterr().err == ""

    script.load_checkpoint(path, args(anneal_lr_timesteps=4000, ent_coef=0.02, resume=path))
    assert capsys.readouterr().err == (
        f"warning: resuming {path} under other flags than it was trained with: --anneal-lr-timesteps 4000 (trained with "
        "50000000), --ent-coef 0.02 (trained with 0.01); pass the training values to continue the same run\n"
    )

    # A checkpoint from before a flag existed trained at the flag's default: the flag is named, resumed or evaluated,
    # and another value of it is named as a change too.
    checkpoint = torch.load(path, weights_only=True)
    del checkpoint["args"]["clip_coef"], checkpoint["args"]["ent_coef"]
    torch.save(checkpoint, path)
    newer = (
        f"warning: --clip-coef, --ent-coef: not in the checkpoint {path} (written before the flag existed), taken as its "
        "default\n"
    )
    default = script.Args().ent_coef
    script.load_checkpoint(path, args(ent_coef=default, total_timesteps=1000, resume=path))
    assert capsys.readouterr().err == newer
    script.load_checkpoint(path, args(eval_checkpoint=path))
    assert capsys.readouterr().err == newer
    script.load_checkpoint(path, args(clip_coef=0.2, ent_coef=0.5, resume=path))
    assert capsys.readouterr().err == newer + (
        f"warning: resuming {path} under other flags than it was trained with: --clip-coef 0.2 (trained with "
        f"{script.Args().clip_coef}), --ent-coef 0.5 (trained with {default}); pass the training values to continue the "
        "same run\n"
    )

    # A flag the script no longer has (retired, or a patch's): named with its value when resuming, not when evaluating.
    checkpoint["args"].update(norm_adv=True, loss_reduction="mean")
    torch.save(checkpoint, path)
    capsys.readouterr()
    script.load_checkpoint(path, args(clip_coef=None, ent_coef=default, total_timesteps=1000, resume=path))
    assert capsys.readouterr().err == newer + (
        f"warning: resuming {path}, trained with flags this script does not have: --norm-adv True, --loss-reduction "
        "mean; the run goes on without them\n"
    )
    script.load_checkpoint(path, args(eval_checkpoint=path))
    assert capsys.readouterr().err == newer


@pytest.mark.parametrize("script", [impala_mono, impala_poly], ids=["mono", "poly"])
def test_evaluating_another_network_speaks_of_evaluation(tmp_path, script):
    """--eval-checkpoint with a checkpoint of another network: the refusal says to evaluate it with its network (no word
    of resuming or of a new run)."""
    agent = script.Agent((4,), 2)
    path = str(tmp_path / "checkpoint.pt")
    assert script.save_checkpoint(path, agent, script.make_optimizer(script.Args(env_id="CartPole-v1"), agent), 40, 1,
                                  script.Args(env_id="CartPole-v1"))  # fmt: skip
    torch.save(wider_network(path), path)
    with pytest.raises(SystemExit) as exit:
        build = lambda flags: script.Agent((4,), 2)  # noqa: E731 (the network as the code builds it now)
        checkpoint = torch.load(path, weights_only=True)
        script.check_resumable(path, checkpoint, agent, script.Args(env_id="CartPole-v1"), build)
    assert exit.value.code == (
        f"error: checkpoint {path} holds another network (actor.0.weight differs): evaluate it with the network it was "
        "trained with"
    )
