"""Run entry-script command lines one after another in this one process, as the shell would run
them (`python SCRIPT ARGS...` from the current directory), so torch and transformers are imported
once for many commands.

    python tests/support/command_driver.py REPO_ROOT COMMANDS.json [--without MODULE,...]
    python tests/support/command_driver.py REPO_ROOT --serve

COMMANDS.json: a list of command lines, run with the modules named by --without unimportable. For each, "@@ end CODE WALL_S CPU_S COMMAND" goes to
stdout (CODE: the script's exit status; a script that fails in training exits the whole process,
as galaxy.launch does, and the caller sees it; CPU_S: this process's CPU seconds, the imports
included for the first command). The ranks of a distributed command run as drivers
given the same list in the same order, so they meet at each command's rendezvous.

--serve: read one JSON request a line from stdin, {"argv": [NAME=VALUE..., SCRIPT, ARGS...], "stdout": PATH,
"stderr": PATH, "without": [MODULE, ...] (optional), "cwd": DIR (optional: the directory to run it
from, as the shell's current directory; the driver's own otherwise)}; run it with file descriptors
1 and 2 sent to those files (so that what C code and child threads print is caught too) and the
modules named in "without" unimportable (as if not installed), then answer "@@ end CODE" on the
driver's own stdout.
tests/support/script_runner.py keeps such drivers for the test session.
"""
import json
import os
import resource
import runpy
import shlex
import sys
import time
import traceback

from hidden_modules import modules_hidden   # run as a script: tests/support is sys.path[0]


def run(command: str, root: str, without: list[str]) -> int:
    python, script, *args = shlex.split(command)
    assert python == "python", command
    return run_without([script, *args], root, without)


def run_argv(argv: list[str], root: str) -> int:
    """Run `python argv...` in this process: the script's exit status (1 for an uncaught error,
    whose traceback goes to stderr, as the interpreter would print it)."""
    path = os.path.join(root, argv[0])
    sys.argv = [path, *argv[1:]]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def run_without(argv: list[str], root: str, modules: list[str]) -> int:
    """run_argv with `modules` unimportable (hidden_modules). Leading NAME=VALUE words set
    environment variables for this run only, as the shell reads `NAME=VALUE python ...`."""
    assigned = {}
    while argv and "=" in argv[0] and argv[0].split("=", 1)[0].isidentifier():
        name, value = argv[0].split("=", 1)
        assigned[name], argv = value, argv[1:]
    saved = {name: os.environ.get(name) for name in assigned}
    os.environ.update(assigned)
    try:
        with modules_hidden(modules):
            return run_argv(argv, root)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def serve(root: str) -> None:
    reply = os.fdopen(os.dup(1), "w")
    saved, home = (os.dup(1), os.dup(2)), os.getcwd()
    for line in sys.stdin:
        request = json.loads(line)
        with open(request["stdout"], "w") as out, open(request["stderr"], "w") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            os.chdir(request.get("cwd") or home)
            try:
                code = run_without(request["argv"], root, request.get("without", []))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.chdir(home)
        print(f"@@ end {code}", file=reply, flush=True)


if __name__ == "__main__":
    if sys.argv[2:] == ["--serve"]:
        serve(sys.argv[1])
        sys.exit(0)
    root, commands = sys.argv[1], json.load(open(sys.argv[2]))
    without = sys.argv[4].split(",") if sys.argv[3:4] == ["--without"] else []
    cpu = 0.0
    for command in commands:
        start = time.perf_counter()
        code = run(command, root, without)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        used, cpu = usage.ru_utime + usage.ru_stime - cpu, usage.ru_utime + usage.ru_stime
        print(f"@@ end {code} {time.perf_counter() - start:.1f} {used:.1f} {command}", flush=True)
