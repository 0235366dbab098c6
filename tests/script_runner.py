"""Run an entry script as users do: one process per rank, started by hand on loopback."""
import os
import subprocess
import sys

from dist_pool import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(script, config: str, world: int, *extra: str, timeout: float = 240) -> list[tuple]:
    """[(returncode, stdout, stderr)] of every rank. script: a file name, or a list (a script and
    its subcommand, e.g. ["plan.py", "profile-devices"])."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    command = [script] if isinstance(script, str) else list(script)
    procs = [subprocess.Popen([sys.executable, *command, "--config_file", config, "--world", str(world), "--rank",
                               str(r), "--init_method", f"tcp://127.0.0.1:{port}", *extra],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def run_script(script, config: str, world: int, *extra: str, timeout: float = 240) -> list[str]:
    """Every rank's stdout; fails the test (showing its stderr) unless every rank exits 0."""
    results = launch(script, config, world, *extra, timeout=timeout)
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{out}\n{err}"
    return [out for _, out, _ in results]
