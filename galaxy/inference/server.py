"""serve.py's HTTP front, on rank 0: the OpenAI-compatible endpoints (galaxy.inference.openai_api)
over the standard library's ThreadingHTTPServer.

Each connection gets a thread that parses and checks its request (a mistake: a 4xx JSON error, the
server goes on), queues it as Work and waits for its events; the process's main thread runs the
engine and takes the waiting Work in batches (`take`). So requests queue, one batch generates at a
time, and every rank sees the batches in the order rank 0 takes them. Once a rank has died
(`fail`), every waiting and later request is answered 503.

The standard library rather than an ASGI stack (FastAPI, uvicorn): one engine loop serves every
request, so the front only needs threads that wait on queues; it adds no dependency, and rank 0's
main thread stays the one that runs torch and the collectives.
"""
from __future__ import annotations

import copy
import json
import queue
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from galaxy.inference import openai_api as api
from galaxy.inference.requests import RUNNING, TextStream

ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


class Work:
    """One HTTP request's rows; the engine loop puts ("token", choice, token, status),
    ("done", choice, Completion) or ("error", status, message) on `events`."""

    def __init__(self, asked: api.Asked):
        self.asked, self.events = asked, queue.Queue()


class Front:
    def __init__(self, host: str, port: int, *, tokenizer, limits, model: str, rows: int):
        # A fast tokenizer's Python object refuses use from two threads at once ("Already
        # borrowed"): the HTTP threads share a copy of their own, one at a time; the engine's
        # thread keeps the original.
        self.tokenizer, self.tokenizing = copy.deepcopy(tokenizer), threading.Lock()
        self.limits, self.model, self.rows = limits, model, rows
        self.created = int(time.time())
        self.waiting: deque[Work] = deque()
        self.ready = threading.Condition()
        self.broken: str | None = None
        self.stopping = False           # set by ask_to_stop (a signal handler on the main thread)
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.front = self
        self.httpd.daemon_threads = True

    def start(self) -> None:
        threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def submit(self, work: Work) -> None:
        with self.ready:
            if self.broken:
                work.events.put(("error", 503, self.broken))
                return
            self.waiting.append(work)
            self.ready.notify()

    def ask_to_stop(self) -> None:
        """Wake `take` and make it return []: the engine loop stops between batches. The condition's
        lock is re-entrant, so a signal handler may call this while its thread waits in `take`."""
        with self.ready:
            self.stopping = True
            self.ready.notify_all()

    def take(self, wait_s: float) -> list[Work]:
        """The waiting Work, oldest first, up to `rows` rows (at least one Work); [] after wait_s idle
        or once asked to stop."""
        with self.ready:
            if not self.waiting and not self.stopping:
                self.ready.wait(wait_s)
            if self.stopping:
                return []
            taken, rows = [], 0
            while self.waiting and (not taken or rows + len(self.waiting[0].asked.requests) <= self.rows):
                work = self.waiting.popleft()
                taken.append(work)
                rows += len(work.asked.requests)
            return taken

    def fail(self, message: str, works=()) -> None:
        """A rank is gone: answer `works` and everything waiting with 503, and every later request."""
        with self.ready:
            self.broken = message
            for work in (*works, *self.waiting):
                work.events.put(("error", 503, message))
            self.waiting.clear()


class Handler(BaseHTTPRequestHandler):
    """One connection's requests, on the server's thread for it."""
    protocol_version = "HTTP/1.1"
    server_version = "galaxy"

    @property
    def front(self) -> Front:
        return self.server.front

    def log_message(self, *args):      # one line per request would bury the ranks' own output
        pass

    def do_GET(self):
        if self.path.rstrip("/") == "/v1/models":
            return self._json(200, api.models_body(self.front.model, self.front.created))
        self._json(404, api.error_body(f"no route GET {self.path}", 404))

    def do_POST(self):
        kind = ROUTES.get(self.path.rstrip("/"))
        length = self.headers.get("Content-Length") or "0"
        if not length.isdigit():
            self.close_connection = True          # the body's end is unknown: nothing more can be read
            return self._json(411, api.error_body("a POST needs a Content-Length header (bytes of its body)", 411))
        raw = self.rfile.read(int(length))
        if kind is None:
            return self._json(404, api.error_body(f"no route POST {self.path}", 404))
        if self.front.broken:
            return self._json(503, api.error_body(self.front.broken, 503))
        try:
            with self.front.tokenizing:
                asked = api.parse(kind, raw, self.front.tokenizer, self.front.limits, self.front.model)
        except api.BadRequest as e:
            return self._json(e.status, api.error_body(str(e), e.status, e.param))
        work = Work(asked)
        self.front.submit(work)
        try:
            (self._stream if asked.stream else self._whole)(work)
        except (BrokenPipeError, ConnectionResetError):
            pass                       # the client left; its rows still finish in their batch

    def _whole(self, work: Work):
        done = [None] * len(work.asked.requests)
        while None in done:
            event = work.events.get()
            if event[0] == "error":
                return self._json(event[1], api.error_body(event[2], event[1]))
            if event[0] == "done":
                done[event[1]] = event[2]
        self._json(200, api.completion_body(work.asked, api.response_id(work.asked.kind), done))

    def _stream(self, work: Work):
        asked, rid = work.asked, api.response_id(work.asked.kind)
        self.send_response(200)
        for name, value in (("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"),
                            ("Connection", "close")):
            self.send_header(name, value)
        self.end_headers()
        self.close_connection = True
        streams = [TextStream(self.front.tokenizer, r.stop) for r in asked.requests]
        tokens = [[] for _ in asked.requests]
        if asked.kind == "chat":
            self._send(api.chunk(asked, rid, 0, "", None, first=True))
        left, done = len(asked.requests), [None] * len(asked.requests)
        while left:
            event = work.events.get()
            if event[0] == "error":
                self._send(b"data: " + json.dumps(api.error_body(event[2], event[1])).encode() + b"\n\n")
                return
            i = event[1]
            if event[0] == "token":
                tokens[i].append(event[2])
                with self.front.tokenizing:
                    piece = streams[i].piece(tokens[i], event[3] != RUNNING)
                if piece:
                    self._send(api.chunk(asked, rid, i, piece, None))
                continue
            done[i] = event[2]
            with self.front.tokenizing:
                piece = streams[i].piece(done[i].tokens, True)
            self._send(api.chunk(asked, rid, i, piece or None, done[i].finish_reason))
            left -= 1
        if asked.usage_chunk:
            self._send(api.usage_chunk(asked, rid, done))
        self._send(api.DONE)

    def _send(self, data: bytes):
        self.wfile.write(data)
        self.wfile.flush()

    def _json(self, status: int, body: dict):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
