"""helpers.run, which forks the scripts' runs from a server that has imported their libraries, against a new
interpreter: what a script sees and does must be the same."""

import pytest

from helpers import run

SCRIPT = """
import atexit, json, os, sys, threading, time
import helper_neighbour  # a module of the script's folder
import user_module  # a module of PYTHONPATH's folder
atexit.register(lambda: print("atexit", flush=True))
def late():
    time.sleep(0.2)
    print("a thread the interpreter waits for", flush=True)
threading.Thread(target=late).start()
print(json.dumps([__name__, sys.argv, sys.path, os.getcwd(), os.environ.get("MY_VARIABLE")]))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "raise":
    raise ValueError("raised by the script")
if sys.argv[1] == "syntax":
    exec("1 +")
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("how", ["3", "0", "raise", "syntax", "compile"])
def test_a_forked_run_is_a_new_interpreters_run(tmp_path, how):
    (tmp_path / "code").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "code" / "script.py").write_text(SCRIPT + ("def (" if how == "compile" else ""))
    (tmp_path / "code" / "helper_neighbour.py").write_text("")
    (tmp_path / "lib" / "user_module.py").write_text("")
    env = {"MY_VARIABLE": "set", "PYTHONPATH": str(tmp_path / "lib")}
    script = str(tmp_path / "code" / "script.py")
    forked = run(script, how, "--flag", cwd=tmp_path / "work", env=env)
    new = run(script, how, "--flag", cwd=tmp_path / "work", env={**env, "IMPALA_TESTS_NEW_INTERPRETER": "1"})
    assert (forked.returncode, forked.stdout, forked.stderr) == (new.returncode, new.stdout, new.stderr)
    assert new.returncode == {"3": 3, "0": 0, "raise": 1, "syntax": 1, "compile": 1}[how]
    if how == "compile":
        assert (new.stdout, new.stderr.splitlines()[-1]) == ("", "SyntaxError: invalid syntax")
    else:
        assert new.stdout.splitlines()[1:] == ["a thread the interpreter waits for", "atexit"]
        assert new.stderr.startswith("to stderr\n")
