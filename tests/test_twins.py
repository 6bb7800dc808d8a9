"""The definitions kept text-identical in impala_mono.py and impala_poly.py (each script is whole on its own, so the
shared parts are written twice): an edit to one copy must be made to the other."""

import ast
import difflib
import os

import pytest

from helpers import ROOT

# Written twice on purpose: the same text in both scripts.
TWINS = ["layer_init", "ResidualBlock", "ConvSequence", "mlp", "Agent", "make_agent", "compute_loss", "make_optimizer",
         "Replay", "unroll", "StatError", "scalar_stats", "outputs_finite", "all_or_nothing",
         "GameRecorder", "load_checkpoint", "check_resumable", "RUN_ONLY_FLAGS", "StopSignals", "Progress",
         "save_checkpoint", "RECORDED_OUTPUTS", "act", "check_batch_reads"]  # fmt: skip
# Defined in both scripts but different, each for its own reasons (mono's ale-py envs and actor processes, poly's EnvPool
# and torch.distributed). `learn` is checked apart: poly's is mono's plus the ranks' collectives.
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


def learn_difference(mono_source, poly_source):
    """How the two `learn`s differ as code, beyond what only the ranks need: poly's `world_size` parameter and its
    `if world_size > 1:` blocks (the gradients' all-reduce, the ranks' agreement on a step's outputs). Docstrings and
    comments aside. "" when they are twins."""

    def learn_code(source, collectives):
        (node,) = [node for node in ast.parse(source).body if getattr(node, "name", None) == "learn"]
        if ast.get_docstring(node) is not None:
            node.body = node.body[1:]
        if collectives:
            node.args.args = [arg for arg in node.args.args if arg.arg != "world_size"]
            node.args.defaults = node.args.defaults[: len(node.args.defaults) - 1]

            class DropCollectives(ast.NodeTransformer):
                def visit_If(self, branch):
                    if ast.unparse(branch.test) == "world_size > 1" and not branch.orelse:
                        return None
                    return self.generic_visit(branch)

            node = DropCollectives().visit(node)
        return ast.unparse(node)

    mono, poly = learn_code(mono_source, False), learn_code(poly_source, True)
    diff = difflib.unified_diff(mono.splitlines(), poly.splitlines(), "impala_mono.py", "impala_poly.py", lineterm="")
    return "\n".join(diff)


def test_learn_is_a_twin_but_for_the_ranks():
    with open(os.path.join(ROOT, "impala_mono.py")) as mono, open(os.path.join(ROOT, "impala_poly.py")) as poly:
        difference = learn_difference(mono.read(), poly.read())
    assert difference == "", f"learn differs between the scripts beyond the ranks' collectives: edit both copies\n{difference}"


def test_a_schedule_edited_in_one_learn_is_caught():
    """A user's edit: the learning rate's schedule changed (here: a warmup over the first 10k steps) in mono's learn
    only. The check shows the line that differs."""
    with open(os.path.join(ROOT, "impala_mono.py")) as mono, open(os.path.join(ROOT, "impala_poly.py")) as poly:
        mono_source, poly_source = mono.read(), poly.read()
    old = "    learning_rate = args.learning_rate * (fraction_left if args.anneal_lr else 1.0)\n"
    assert mono_source.count(old) == 1
    edited = mono_source.replace(old, old + "    learning_rate *= min(1.0, global_step / 10_000)\n")
    difference = learn_difference(edited, poly_source)
    assert "-    learning_rate *= min(1.0, global_step / 10000)" in difference.splitlines(), difference
