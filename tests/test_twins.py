"""The definitions kept text-identical in impala_mono.py and impala_poly.py (each script is whole on its own, so the
shared parts are written twice): an edit to one copy must be made to the other."""

import ast
import difflib
import os

import pytest

from helpers import ROOT

# Written twice on purpose: the same text in both scripts.
TWINS = ["layer_init", "ResidualBlock", "ConvSequence", "mlp", "Agent", "make_agent", "compute_loss", "make_optimizer",
         "Replay", "unroll", "split_batch", "StatError", "scalar_stats", "mean_stats", "outputs_finite", "all_or_nothing",
         "GameRecorder", "load_checkpoint", "check_resumable", "RUN_ONLY_FLAGS", "StopSignals", "Progress",
         "save_checkpoint"]  # fmt: skip
# Defined in both scripts but different, each for its own reasons (mono's ale-py envs and actor processes, poly's EnvPool
# and torch.distributed).
DIFFERENT = ["Args", "is_atari", "make_env", "learn", "bf16_native", "evaluate", "check_args", "GameTracker", "train"]


def definitions(script):
    """{name: source text} of a script's top-level functions, classes and constants."""
    with open(os.path.join(ROOT, script)) as f:
        source = f.read()
    tree = ast.parse(source)
    nodes = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    named = {node.name: ast.get_source_segment(source, node) for node in nodes}
    for node in tree.body:  # module-level constants, such as RUN_ONLY_FLAGS
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            named[node.targets[0].id] = ast.get_source_segment(source, node)
    return named


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


LEARNING_BLOCK = ("    # Learning arguments", "    # Checkpoints and evaluation")  # where the shared flags start and end


def args_fields(source):
    """{field: (type, default)} of the `Args` dataclass in a script's source, as written."""
    tree = ast.parse(source)
    (args,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Args"]
    return {
        node.target.id: (ast.get_source_segment(source, node.annotation), ast.get_source_segment(source, node.value))
        for node in args.body
        if isinstance(node, ast.AnnAssign)
    }


def fields_read(node):
    """The names of the `args.<field>` a definition reads."""
    return {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "args"
    }


def twin_args_problems(paths):
    """What breaks the twins' promise that they run alike in both scripts: a field a twin reads that a script's Args
    lacks or defines with another type or default, and a learning block that differs. [] when all is well."""
    sources = {os.path.basename(path): open(path).read() for path in paths}
    fields = {name: args_fields(source) for name, source in sources.items()}
    problems = []
    for source in sources.values():
        for node in ast.parse(source).body:
            if getattr(node, "name", None) not in TWINS:
                continue
            for field in sorted(fields_read(node)):
                defined = {script: fields[script].get(field) for script in sources}
                for script, definition in defined.items():
                    if definition is None:
                        problems.append(f"{node.name} reads args.{field}, which {script}'s Args lacks")
                if None not in defined.values() and len(set(defined.values())) > 1:
                    written = ", ".join(f"{script}: {t} = {d}" for script, (t, d) in defined.items())
                    problems.append(f"{node.name} reads args.{field}, defined differently ({written})")
    blocks = {}
    for name, source in sources.items():
        start, end = (source.index(marker) for marker in LEARNING_BLOCK)
        blocks[name] = source[start:end]
    if len(set(blocks.values())) > 1:
        (a, text_a), (b, text_b) = blocks.items()
        diff = "\n".join(difflib.unified_diff(text_a.splitlines(), text_b.splitlines(), a, b, lineterm=""))
        problems.append(f"the learning arguments of Args differ: edit both copies\n{diff}")
    return sorted(set(problems))


def test_twins_read_fields_that_both_args_define_alike():
    assert twin_args_problems([os.path.join(ROOT, "impala_mono.py"), os.path.join(ROOT, "impala_poly.py")]) == []


def test_a_flag_added_to_one_args_is_caught(tmp_path):
    """A user's edit: a clipped surrogate in compute_loss reads a new args.ppo_clip, pasted into both scripts, but the
    flag added to mono's Args only. The check names the field and the script that lacks it (without it, poly would fail
    with AttributeError in its first update); with the flag in mono's learning block only, it also shows the blocks
    differ."""
    paths = []
    for script in ("impala_mono.py", "impala_poly.py"):
        with open(os.path.join(ROOT, script)) as f:
            source = f.read()
        source = source.replace("    loss = policy_loss +", "    clip = args.ppo_clip\n    loss = policy_loss +", 1)
        if script == "impala_mono.py":
            source = source.replace(
                "    rmsprop_alpha: float = 0.99\n",
                '    ppo_clip: float = 0.2\n    """the surrogate\'s clip"""\n    rmsprop_alpha: float = 0.99\n',
                1,
            )
        paths.append(str(tmp_path / script))
        with open(paths[-1], "w") as f:
            f.write(source)
    problems = twin_args_problems(paths)
    assert problems[0] == "compute_loss reads args.ppo_clip, which impala_poly.py's Args lacks"
    assert problems[1].startswith("the learning arguments of Args differ: edit both copies\n")
    assert len(problems) == 2

    # The same flag with another default in poly's Args: named too.
    with open(paths[1]) as f:
        source = f.read()
    with open(paths[1], "w") as f:
        f.write(
            source.replace(
                "    rmsprop_alpha: float = 0.99\n",
                '    ppo_clip: float = 0.1\n    """the surrogate\'s clip"""\n    rmsprop_alpha: float = 0.99\n',
                1,
            )
        )
    assert twin_args_problems(paths)[0] == (
        "compute_loss reads args.ppo_clip, defined differently (impala_mono.py: float = 0.2, impala_poly.py: float = 0.1)"
    )


@pytest.mark.parametrize("script", ["impala_mono.py", "impala_poly.py"])
def test_the_algorithm_comes_first(script):
    """A reader who wants the agent and the loss reads from the top and stops at the end of `learn`: within 500 lines,
    above the MACHINERY fence."""
    with open(os.path.join(ROOT, script)) as f:
        source = f.read()
    (learn,) = [node for node in ast.parse(source).body if getattr(node, "name", None) == "learn"]
    fence = source[: source.index("# MACHINERY")].count("\n")
    assert learn.end_lineno <= 500 and learn.end_lineno < fence, (learn.end_lineno, fence)
