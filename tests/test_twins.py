"""The definitions kept text-identical in impala_mono.py and impala_poly.py (each script is whole on its own, so the
shared parts are written twice): an edit to one copy must be made to the other."""

import ast
import difflib
import os

import pytest

from helpers import ROOT

# Written twice on purpose: the same text in both scripts.
TWINS = ["layer_init", "ResidualBlock", "ConvSequence", "mlp", "Agent", "make_agent", "compute_loss", "make_optimizer",
         "split_batch", "scalar_stats", "outputs_finite", "GameRecorder", "load_checkpoint", "check_resumable", "Progress",
         "save_checkpoint"]  # fmt: skip
# Defined in both scripts but different, each for its own reasons (mono's ale-py envs and actor processes, poly's EnvPool
# and torch.distributed).
DIFFERENT = ["Args", "is_atari", "make_env", "learn", "bf16_native", "evaluate", "check_args"]


def definitions(script):
    """{name: source text} of a script's top-level functions and classes."""
    with open(os.path.join(ROOT, script)) as f:
        source = f.read()
    tree = ast.parse(source)
    nodes = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    return {node.name: ast.get_source_segment(source, node) for node in nodes}


MONO, POLY = definitions("impala_mono.py"), definitions("impala_poly.py")


@pytest.mark.parametrize("name", TWINS)
def test_twin_is_identical(name):
    assert name in MONO and name in POLY, f"{name} is missing from a script"
    diff = "\n".join(
        difflib.unified_diff(MONO[name].splitlines(), POLY[name].splitlines(), "impala_mono.py", "impala_poly.py", lineterm="")
    )
    assert MONO[name] == POLY[name], f"{name} differs between the scripts: edit both copies\n{diff}"


def test_every_shared_name_is_listed():
    """A definition that appears in both scripts is either a twin or known to differ: a new shared helper gets a
    decision (and, as a twin, a check)."""
    assert set(MONO) & set(POLY) == set(TWINS) | set(DIFFERENT)
