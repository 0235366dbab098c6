"""Run entry-script command lines one after another in this one process, as the shell would run
them (`python SCRIPT ARGS...` from the current directory), so torch and transformers are imported
once for many commands.

    python tests/command_driver.py REPO_ROOT COMMANDS.json

COMMANDS.json: a list of command lines. For each, "@@ end CODE WALL_S CPU_S COMMAND" goes to
stdout (CODE: the script's exit status; a script that fails in training exits the whole process,
as galaxy.launch does, and the caller sees it; CPU_S: this process's CPU seconds, the imports
included for the first command). The ranks of a distributed command run as drivers
given the same list in the same order, so they meet at each command's rendezvous.
"""
import json
import os
import resource
import runpy
import shlex
import sys
import time


def run(command: str, root: str) -> int:
    python, script, *args = shlex.split(command)
    assert python == "python", command
    path = os.path.join(root, script)
    sys.argv = [path, *args]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    return 0


if __name__ == "__main__":
    root, commands = sys.argv[1], json.load(open(sys.argv[2]))
    cpu = 0.0
    for command in commands:
        start = time.perf_counter()
        code = run(command, root)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        used, cpu = usage.ru_utime + usage.ru_stime - cpu, usage.ru_utime + usage.ru_stime
        print(f"@@ end {code} {time.perf_counter() - start:.1f} {used:.1f} {command}", flush=True)
