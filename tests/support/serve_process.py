"""serve.py as users start it (one fresh process per rank on loopback), and plain-HTTP calls to it
with the standard library's urllib: JSON in and out, server-sent events read line by line.

Fresh processes rather than the command drivers of script_runner: the server runs until it is
stopped, and the tests kill a rank on purpose.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from support.dist_pool import free_port
from support.script_runner import ENV, ROOT


class Served:
    """Every rank of one serve.py job; rank 0 answers on http://127.0.0.1:{port}."""

    def __init__(self, config: str, world: int, *extra: str):
        self.port, rendezvous = free_port(), free_port()
        self.logs = tempfile.mkdtemp(prefix="serve_")
        self.procs, self.serving = [], None
        for rank in range(world):
            argv = [sys.executable, "serve.py", "--config_file", config, "--world", str(world), "--rank", str(rank),
                    "--init_method", f"tcp://127.0.0.1:{rendezvous}", "--port", str(self.port), *extra]
            err = open(os.path.join(self.logs, f"rank{rank}.err"), "w")
            self.procs.append(subprocess.Popen(argv, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=err,
                                               text=True))

    def wait_serving(self, timeout: float = 180) -> str:
        """Rank 0's "serving ..." line, once it listens; fails naming every rank's stderr otherwise."""
        out, deadline = self.procs[0].stdout, time.monotonic() + timeout
        while self.serving is None and time.monotonic() < deadline and self.procs[0].poll() is None:
            ready, _, _ = select.select([out], [], [], 1.0)
            if ready:
                line = out.readline()
                self.serving = line if "serving" in line else None
        if self.serving is not None:
            return self.serving
        raise AssertionError(f"serve.py did not start serving in {timeout} s:\n{self.stderr()}")

    def stderr(self) -> str:
        return "\n".join(open(os.path.join(self.logs, f"rank{r}.err")).read() for r in range(len(self.procs)))

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        """Stop every rank still running: SIGTERM to rank 0 first (it stops the others), then kill."""
        if self.procs[0].poll() is None:
            self.procs[0].send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def call(url: str, body=None, raw: bytes | None = None, timeout: float = 120) -> tuple[int, dict]:
    """(HTTP status, JSON body) of a GET (body None) or a POST of `body` as JSON (or of `raw`)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def events(url: str, body: dict, timeout: float = 120) -> list:
    """The server-sent events of a streamed POST: each "data:" line's JSON, "[DONE]" as the string."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(request, timeout=timeout) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out
