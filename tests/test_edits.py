"""A user's ordinary edits, each made in a copy of a script as a user would make it, and the outcome they must get: a
new flag is covered by the resume warning with no other edit, and a new `Agent` argument is passed in one place."""

import importlib.util
import os

import pytest
import torch

from helpers import CARTPOLE_FLAGS as FLAGS
from helpers import edited_copy, error_line, run, scalars, train

pytestmark = pytest.mark.slow  # each edit is tried in a real run

# A new learning flag, added to Args' learning block as a user would (both scripts have the same block).
NEW_FLAG = (
    "    gamma: float = 0.99\n",
    '    my_coef: float = 1.0\n    """a new loss term\'s weight"""\n    gamma: float = 0.99\n',
)


@pytest.mark.parametrize("script", ["impala_mono.py", "impala_poly.py"])
def test_a_new_flag_is_covered_by_the_resume_warning(tmp_path, script):
    """A flag added to Args and nowhere else: resuming under another value names it in the warning, as every flag that
    is not run-only (paths, tracking, video, threads)."""
    path = edited_copy(tmp_path, script, *NEW_FLAG)
    run_dir = train(path, "CartPole-v1", 40, FLAGS[script], tmp_path)
    checkpoint = os.path.join(run_dir, "checkpoint.pt")
    flags = [*FLAGS[script], "--resume", checkpoint, "--my-coef", 2.0, "--checkpoint-interval", 60]
    result = run(path, "--env-id", "CartPole-v1", "--total-timesteps", 80, *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: resuming")]
    assert warnings == [
        f"warning: resuming {checkpoint} under other flags than it was trained with: --my-coef 2.0 (trained with 1.0); "
        "pass the training values to continue the same run"
    ]


@pytest.mark.parametrize("script", ["impala_mono.py", "impala_poly.py"])
def test_a_checkpoint_older_than_a_new_flag_names_it(tmp_path, script):
    """A checkpoint written by the script before the edit, resumed by the edited one: the new flag is named as taken at
    its default, the schedule or term it drives having had no say in training."""
    run_dir = train(script, "CartPole-v1", 40, FLAGS[script], tmp_path)
    checkpoint = os.path.join(run_dir, "checkpoint.pt")
    path = edited_copy(tmp_path, script, *NEW_FLAG)
    flags = [*FLAGS[script], "--resume", checkpoint, "--checkpoint-interval", 60]
    result = run(path, "--env-id", "CartPole-v1", "--total-timesteps", 80, *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: --my-coef: not in the checkpoint {checkpoint} (written before the flag existed), taken as its default"
    ]


@pytest.mark.parametrize("script", ["impala_mono.py", "impala_poly.py"])
def test_a_new_agent_argument_is_one_edit_in_make_agent(tmp_path, script):
    """A width for the classic-control MLPs, from a new flag: Agent and mlp take it, make_agent passes it, and the
    run (training, checkpoint and evaluation) builds the narrower network with no edit below the algorithm."""
    old = [
        NEW_FLAG[0],
        "obs_scale=None):\n",  # the end of Agent's signature
        "            self.actor = mlp(core_size, num_actions, std=0.01)\n"
        "            self.critic = mlp(core_size, 1, std=1.0)\n",
        "args.bf16, obs_scale)\n",  # the end of make_agent's call
    ]
    new = [
        '    mlp_width: int = 256\n    """units of the classic-control MLPs"""\n' + NEW_FLAG[0],
        "obs_scale=None, mlp_width=256):\n",
        "            self.actor = mlp(core_size, num_actions, std=0.01, hidden=mlp_width)\n"
        "            self.critic = mlp(core_size, 1, std=1.0, hidden=mlp_width)\n",
        "args.bf16, obs_scale, args.mlp_width)\n",
    ]
    path = edited_copy(tmp_path, script, old, new)
    run_dir = train(path, "CartPole-v1", 40, [*FLAGS[script], "--mlp-width", 32], tmp_path)
    checkpoint = os.path.join(run_dir, "checkpoint.pt")
    model = torch.load(checkpoint, weights_only=True)["model"]
    assert model["actor.0.weight"].shape == (32, 4) and model["critic.2.weight"].shape == (32, 32)
    result = run(path, "--env-id", "CartPole-v1", "--mlp-width", 32, "--eval-checkpoint", checkpoint, "--eval-episodes", 1,
                 cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1].startswith("CartPole-v1: mean return ")

    # Evaluated without the flag: refused, naming the flag to pass (not a parameter of the network).
    result = run(path, "--env-id", "CartPole-v1", "--eval-checkpoint", checkpoint, "--eval-episodes", 1, cwd=tmp_path)
    assert (
        error_line(result) == f"error: checkpoint {checkpoint} was trained with --mlp-width 32: pass the same to evaluate it"
    )


# A stat that reads the acting policy's values from the batch, in compute_loss (say, for a value clip).
READS_VALUES = (
    '        "stats/value": values[:-1].mean(),\n',
    '        "stats/value": values[:-1].mean(),\n        "stats/acting_value": batch["values"][:-1].mean(),\n',
)


@pytest.mark.parametrize("script", ["impala_mono.py", "impala_poly.py"])
def test_a_new_recorded_quantity_is_one_edit(tmp_path, script):
    """The acting policy's values recorded for the learner: one more name in RECORDED_OUTPUTS, and compute_loss reads
    them as batch["values"]: what the actors computed, not zeros (a fresh value head's outputs are not 0)."""
    old = [READS_VALUES[0], 'RECORDED_OUTPUTS = ("logits",)\n']
    new = [READS_VALUES[1], 'RECORDED_OUTPUTS = ("logits", "values")\n']
    path = edited_copy(tmp_path, script, old, new)
    run_dir = train(path, "CartPole-v1", 80, FLAGS[script], tmp_path)
    acting = [value for _, value in scalars(run_dir, "stats/acting_value")]
    learning = [value for _, value in scalars(run_dir, "stats/value")]
    assert len(acting) == 2 and all(value != 0.0 for value in acting), acting
    assert acting[0] == pytest.approx(learning[0], abs=1e-5)  # the first batch: acted on with the learner's parameters


@pytest.mark.parametrize("script", ["impala_mono.py", "impala_poly.py"])
def test_a_key_the_actors_do_not_record_is_one_error_before_anything_starts(tmp_path, script):
    """compute_loss reads batch["values"], but RECORDED_OUTPUTS was not edited: one error line, before any run starts
    (no buffer of zeros to learn from)."""
    path = edited_copy(tmp_path, script, *READS_VALUES)
    result = run(path, "--env-id", "CartPole-v1", "--total-timesteps", 80, *FLAGS[script], cwd=tmp_path)
    assert error_line(result) == (
        "error: compute_loss reads batch['values'], which the actors do not record: add 'values' to RECORDED_OUTPUTS if "
        "it is an output of Agent.forward"
    )
    assert not os.path.exists(tmp_path / "runs")


@pytest.mark.parametrize("script", ["impala_mono.py", "impala_poly.py"])
def test_a_key_learn_adds_to_the_batch_may_be_read_by_compute_loss(tmp_path, script):
    """learn adds a key to the batch before the loss (the policy before the batch, say) and compute_loss reads it:
    not a key the actors must record, wherever in the three functions it is added."""
    old = ["    with all_or_nothing(agent, optimizer):\n", READS_VALUES[0]]
    new = [
        '    with torch.no_grad():\n        batch = {**batch, "before": unroll(agent, batch)["values"]}\n' + old[0],
        '        "stats/value": values[:-1].mean(),\n        "stats/before": batch["before"][:-1].mean(),\n',
    ]
    path = edited_copy(tmp_path, script, old, new)
    spec = importlib.util.spec_from_file_location(f"edited_{script[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.check_batch_reads()  # no SystemExit
    module.RECORDED_OUTPUTS = ()  # the same check still refuses a key nobody records: "logits"
    with pytest.raises(SystemExit) as exit:
        module.check_batch_reads()
    assert str(exit.value).startswith("error: compute_loss reads batch['logits'], which the actors do not record")
