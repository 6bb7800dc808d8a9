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


COUNTER = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print("terminated", flush=True), sys.exit(0)))
for i in range(600):
    print(i, flush=True)
    time.sleep(0.1)
sys.exit(5)
"""


@pytest.mark.parametrize("new_interpreter", ["0", "1"])
def test_stop_terminates_the_run_once_its_output_says_so(tmp_path, new_interpreter):
    """`stop` reads the output so far, each second: the run gets SIGTERM once it returns True, and no earlier."""
    (tmp_path / "counter.py").write_text(COUNTER)
    seen = []

    def stop(stdout):
        seen.append(len(stdout.splitlines()))
        return seen[-1] >= 3

    env = {"IMPALA_TESTS_NEW_INTERPRETER": new_interpreter}
    result = run(str(tmp_path / "counter.py"), cwd=tmp_path, timeout=30, env=env, stop=stop)
    lines = result.stdout.splitlines()
    assert (result.returncode, lines[-1]) == (0, "terminated")
    assert seen[-1] >= 3 > max(seen[:-1], default=0)
    assert lines[:-1] == [str(i) for i in range(len(lines) - 1)] and 3 <= len(lines) - 1 <= seen[-1] + 5
