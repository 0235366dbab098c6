"""The OpenAI-compatible HTTP API's bodies: request JSON in (checked, turned into Requests), response
JSON and server-sent-event chunks out. No server and no torch here (galaxy.inference.server).

    POST /v1/completions        {"prompt": TEXT or [TEXT, ...], "max_tokens" (16), "temperature" (1),
                                 "top_p" (1), "top_k" (0: off; an extension, as vLLM's), "stop": TEXT or
                                 [TEXT, ...] (up to 4), "seed", "n" (1), "stream" (false)}
    POST /v1/chat/completions   {"messages": [{"role", "content"}, ...], "max_tokens" or
                                 "max_completion_tokens" (default: up to the model's positions), the rest
                                 as above}
    GET  /v1/models

Fields OpenAI defines that change the output and are not computed here (logprobs, echo, best_of,
suffix, tools, response_format, ...) are refused with a 400 naming them rather than ignored;
"model" may be any name (one model is served) and "user" is accepted; "stream_options":
{"include_usage": true} adds OpenAI's last chunk with the usage and no choices.
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass

from galaxy.data.errors import DataError
from galaxy.inference.prompts import Limits, Prompt, parse_messages, prompt_ids
from galaxy.inference.requests import Completion, Request
from galaxy.inference.sampling import Sampling

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "stream", "user",
          "stream_options", "frequency_penalty", "presence_penalty"}
FIELDS = {"completions": COMMON | {"prompt"}, "chat": COMMON | {"messages", "max_completion_tokens"}}


class BadRequest(ValueError):
    """A request the API refuses: HTTP status and the one-line message for the error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class Asked:
    kind: str                       # "completions" | "chat"
    requests: list[Request]         # one per prompt (the choices' order)
    stream: bool
    model: str
    prompt_tokens: int
    usage_chunk: bool = False       # stream_options.include_usage


def parse(kind: str, raw: bytes, tokenizer, limits: Limits, model: str) -> Asked:
    """The body of a POST to /v1/completions ("completions") or /v1/chat/completions ("chat")."""
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        served = ", ".join(sorted(FIELDS[kind]))
        raise BadRequest(f"{unknown[0]!r} is not supported by this server (it serves {served})", param=unknown[0])
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise BadRequest(f"{name} other than 0 is not supported", param=name)
    if body.get("n", 1) != 1:
        raise BadRequest("n must be 1 (one choice per prompt)", param="n")
    prompts = _prompts(kind, body)
    sampling, stop = _sampling(body), _stop(body.get("stop"))
    requests = []
    for prompt in prompts:
        ids = prompt_ids(tokenizer, prompt, chat=False)
        budget = limits.budget(len(ids))
        default = 16 if kind == "completions" else max(budget, 1)
        max_tokens = _integer(body, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens",
                              default)
        problem = limits.problem(len(ids), max_tokens)
        if problem:
            raise BadRequest(problem, param="messages" if kind == "chat" else "prompt")
        requests.append(Request(prompt.text, tuple(ids), max_tokens, sampling, stop))
    return Asked(kind, requests, _flag(body, "stream"), str(body.get("model") or model),
                 sum(len(r.ids) for r in requests), _include_usage(body.get("stream_options")))


def _prompts(kind: str, body: dict) -> list[Prompt]:
    if kind == "chat":
        try:
            return [Prompt("", parse_messages(body.get("messages"), "messages"))]
        except DataError as e:
            raise BadRequest(str(e), param="messages") from None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [Prompt(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [Prompt(p) for p in prompt]
    raise BadRequest("prompt must be a string or a non-empty list of strings", param="prompt")


def _sampling(body: dict) -> Sampling:
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbits(63)            # unseeded requests differ from one another
    elif not isinstance(seed, int) or isinstance(seed, bool):
        raise BadRequest("seed must be an integer", param="seed")
    s = Sampling(_number(body, "temperature", 1.0), _integer(body, "top_k", 0), _number(body, "top_p", 1.0), seed)
    problems = s.problems()
    if problems:
        raise BadRequest(problems[0], param=problems[0].split()[0])
    return s


def _include_usage(options) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage"} \
            or not isinstance(options.get("include_usage", False), bool):
        raise BadRequest('stream_options must be {"include_usage": true or false}', param="stream_options")
    return options.get("include_usage", False)


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)):
        raise BadRequest("stop must be a non-empty string or a list of up to 4 of them", param="stop")
    return tuple(stop)


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number", param=name)
    return float(value)


def _integer(body: dict, name: str, default: int) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < (1 if "tokens" in name else 0):
        raise BadRequest(f"{name} must be an integer of at least {1 if 'tokens' in name else 0}", param=name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool) and value is not None:
        raise BadRequest(f"{name} must be true or false", param=name)
    return bool(value)


# -- responses ---------------------------------------------------------------------------------

def response_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def completion_body(asked: Asked, rid: str, done: list[Completion]) -> dict:
    """The whole answer of a request that does not stream."""
    if asked.kind == "chat":
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                    "finish_reason": c.finish_reason} for i, c in enumerate(done)]
    else:
        choices = [{"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                   for i, c in enumerate(done)]
    return {"id": rid, "object": "chat.completion" if asked.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": asked.model, "choices": choices, "usage": usage(asked, done)}


def usage(asked: Asked, done: list[Completion]) -> dict:
    used = sum(len(c.tokens) for c in done)
    return {"prompt_tokens": asked.prompt_tokens, "completion_tokens": used, "total_tokens": asked.prompt_tokens + used}


def usage_chunk(asked: Asked, rid: str, done: list[Completion]) -> bytes:
    """A stream's last chunk under stream_options.include_usage: no choices, the usage."""
    body = {"id": rid, "object": "chat.completion.chunk" if asked.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": asked.model, "choices": [], "usage": usage(asked, done)}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def chunk(asked: Asked, rid: str, index: int, text: str | None, finish: str | None, first: bool = False) -> bytes:
    """One server-sent event of a streamed answer: `text` added to choice `index` (chat: the
    assistant's role on the first chunk), or its finish_reason."""
    if asked.kind == "chat":
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    body = {"id": rid, "object": kind, "created": int(time.time()), "model": asked.model, "choices": [choice]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def error_body(message: str, status: int, param: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else ("service_unavailable" if status == 503 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def models_body(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "galaxy"}]}
