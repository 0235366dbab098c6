"""Run an entry script as users do: one process per rank, started by hand on loopback.

`launch` starts fresh processes and reports how each exited (for the tests of exit codes, errors
and dying peers). `run_script`, for runs that must succeed, gives each rank's command line to a
long-lived command driver instead (tests/support/command_driver.py --serve; one per rank, kept for the
session): the script runs as `python SCRIPT ARGS` would, without paying for importing torch and
transformers again (about 5 s of CPU per process on this 2-core machine). A driver whose script
failed is replaced, so no state of a broken run reaches the next test. `run_scripts` runs many
jobs and reports how each exited (the combination test, whose jobs may be refused).

On the drivers matplotlib is unimportable unless a test asks for it (`without=()`): the trainer
then skips its loss plot, about 0.5 s of CPU a run; test_trainer_scripts.py draws it.
"""
import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import time

from support.dist_pool import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
NO_PLOT = ("matplotlib",)      # the trainer's loss plot, skipped (the default of run_scripts)


def _argv(script, config: str, world: int, rank: int, port, extra) -> list[str]:
    command = [script] if isinstance(script, str) else list(script)
    return [*command, "--config_file", config, "--world", str(world), "--rank", str(rank),
            "--init_method", f"tcp://127.0.0.1:{port}", *extra]


def launch(script, config: str, world: int, *extra: str, timeout: float = 240) -> list[tuple]:
    """[(returncode, stdout, stderr)] of every rank. script: a file name, or a list (a script and
    its subcommand, e.g. ["plan.py", "profile-devices"])."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, *_argv(script, config, world, r, port, extra)],
                              cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


class _Driver:
    """One tests/support/command_driver.py --serve process: a script at a time, its output in files."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="script_driver_")
        self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "support", "command_driver.py"), ROOT,
                                      "--serve"], cwd=ROOT, env=ENV, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def submit(self, argv: list[str], without: tuple = (), cwd: str | None = None) -> None:
        self.out, self.err = os.path.join(self.dir, "stdout"), os.path.join(self.dir, "stderr")
        request = {"argv": argv, "stdout": self.out, "stderr": self.err, "without": list(without), "cwd": cwd}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def result(self, deadline: float) -> tuple:
        """(exit status, stdout, stderr) of the script submitted; None for a status when the
        script did not finish by `deadline` (time.monotonic())."""
        code = None
        ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if ready:
            line = self.proc.stdout.readline()
            code = int(line.split()[2]) if line.startswith("@@ end ") else self.proc.wait()   # "": it exited
        read = lambda path: open(path).read() if os.path.exists(path) else ""   # noqa: E731
        return code, read(self.out), read(self.err)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_drivers: list[_Driver] = []


@atexit.register
def _close_drivers():
    for d in _drivers:
        d.close()


def run_scripts(jobs: list[tuple], timeout: float = 240, without: tuple = NO_PLOT) -> list[list[tuple]]:
    """Each job (script, config, world, *extra) run on the drivers; for each job, every rank's
    (exit status, stdout, stderr), the status None for a rank that did not finish in time.
    without: modules the scripts must find unimportable (command_driver.py's "without")."""
    return run_argvs([[_argv(script, config, world, r, "{port}", extra) for r in range(world)]
                      for script, config, world, *extra in jobs], timeout, without)


def run_argvs(jobs: list[list[list[str]]], timeout: float = 240, without: tuple = NO_PLOT,
              cwd: str | None = None) -> list[list[tuple]]:
    """Each job, one argv (`python argv...`) per rank, run on the drivers from `cwd` (None: the
    repository), "{port}" in an argument replaced by a port free when the job starts; for each
    job, every rank's (exit status, stdout, stderr) as run_scripts gives them.

    Consecutive jobs that fit the drivers together (two serial runs on two drivers) run at the
    same time; jobs never share a driver. The drivers of a job that failed are replaced, so no
    state of a broken run reaches the next one; a refusal (exit 2, raised before any process
    group or model exists) leaves nothing behind, and its drivers, if still alive, are kept."""
    width = max(len(job) for job in jobs)
    while len(_drivers) < width:
        _drivers.append(_Driver())
    results, start = [], 0
    while start < len(jobs):
        end, used = start, 0
        while end < len(jobs) and used + len(jobs[end]) <= width:
            used, end = used + len(jobs[end]), end + 1
        placed, first = [], 0
        for job in jobs[start:end]:
            port = str(free_port())
            for r, argv in enumerate(job):
                _drivers[first + r].submit([a.replace("{port}", port) for a in argv], without, cwd)
            placed.append(range(first, first + len(job)))
            first += len(job)
        deadline = time.monotonic() + timeout
        for drivers in placed:
            outcome = [_drivers[d].result(deadline) for d in drivers]
            if any(code not in (0, 2) for code, _, _ in outcome) or not all(_drivers[d].alive() for d in drivers):
                for d in drivers:
                    _drivers[d].close()
                    _drivers[d] = _Driver()
            results.append(outcome)
        start = end
    return results


def run_script(script, config: str, world: int, *extra: str, timeout: float = 240,
               without: tuple = NO_PLOT) -> list[str]:
    """Every rank's stdout; fails the test (showing its stderr) unless every rank exits 0."""
    results = run_scripts([(script, config, world, *extra)], timeout, without)[0]
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{out}\n{err}"
    return [out for _, out, _ in results]
