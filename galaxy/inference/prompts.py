"""Prompts in, Requests out: reading a prompts file, applying the chat template, tokenising, and
the limits a prompt must respect (the model's positions; pad_size where the plan splits tokens).

A prompts file (generate.py --prompts) is JSON lines, {"prompt": TEXT} or {"messages": [{"role",
"content"}, ...]} each (when its first non-empty line starts with "{"), or else one prompt per
line. Empty lines are skipped. Errors name the file and line.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from galaxy.data.chat import ROLES, render_chat_prompt
from galaxy.data.errors import DataError
from galaxy.data.readers import _lines


@dataclass(frozen=True)
class Prompt:
    text: str                                           # what the output record shows
    messages: tuple[tuple[str, str], ...] | None = None  # a conversation (chat), or None: plain text


def read_prompts(path: str) -> list[Prompt]:
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    lines = [(n, line) for n, line in _lines(path) if line.strip()]
    if not lines:
        raise DataError(f"{path}: no prompts (the file is empty)")
    if not lines[0][1].lstrip().startswith("{"):
        return [Prompt(line) for _, line in lines]
    return [_json_prompt(path, n, line) for n, line in lines]


def _json_prompt(path: str, n: int, line: str) -> Prompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{n}: not a JSON object ({e.msg}); give one {{\"prompt\": ...}} a line") from None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return Prompt(record["prompt"])
    if isinstance(record, dict) and "messages" in record:
        return Prompt(json.dumps(record["messages"]), parse_messages(record["messages"], f"{path}:{n}"))
    raise DataError(f"{path}:{n}: each line needs a string \"prompt\" (or \"messages\")")


def parse_messages(messages, where: str) -> tuple[tuple[str, str], ...]:
    """[{"role", "content"}, ...] -> ((role, content), ...); DataError naming `where` otherwise."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{\"role\", \"content\"}}")
    out = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: messages[{i}] must be {{\"role\": one of {', '.join(ROLES)}, "
                            f"\"content\": a string}}")
        out.append((m["role"], m["content"]))
    return tuple(out)


def prompt_ids(tokenizer, prompt: Prompt, chat: bool) -> list[int]:
    """The prompt's token ids: plain text as the tokenizer encodes it (with its special tokens,
    e.g. BOS), or the conversation (or the text as one user turn, with `chat`) in the chat
    template, as training renders it (galaxy.data.chat)."""
    messages = prompt.messages or ((("user", prompt.text),) if chat else None)
    if messages is None:
        return list(tokenizer(prompt.text)["input_ids"])
    text, special = render_chat_prompt(tokenizer, list(messages))
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


SEQ2SEQ_BUDGET = 512


@dataclass(frozen=True)
class Limits:
    """The longest prompt and prompt + completion this run takes."""
    positions: int                       # the model's max_position_embeddings
    prompt: int | None = None            # pad_size where the plan splits tokens (Plan.splits_prompt), else None
    separate: bool = False               # an encoder-decoder: prompt and completion each have the positions

    def budget(self, prompt_tokens: int) -> int:
        """The most new tokens a prompt of this many tokens can get (the server's chat default):
        a causal LM's positions after the prompt; an encoder-decoder's decoder positions, at most
        SEQ2SEQ_BUDGET (T5 has no limit, and the cache is preallocated for them)."""
        if self.separate:
            return min(self.positions, SEQ2SEQ_BUDGET)
        return self.positions - prompt_tokens

    def problem(self, prompt_tokens: int, max_new_tokens: int) -> str | None:
        """Why a prompt of this many tokens cannot get max_new_tokens more, or None."""
        if prompt_tokens == 0:
            return "the prompt is empty (no tokens)"
        if self.prompt is not None and prompt_tokens > self.prompt:
            return (f"the prompt has {prompt_tokens} tokens, more than the {self.prompt} of pad_size, for which the "
                    f"plan's token shares are made; shorten it or raise pad_size")
        if self.separate:
            longest = max(prompt_tokens, max_new_tokens)
            if longest > self.positions:
                what = "prompt's" if longest == prompt_tokens else "completion's"
                return (f"the {what} {longest} tokens exceed the model's {self.positions} positions "
                        f"(max_position_embeddings); shorten the prompt or ask for fewer new tokens")
            return None
        if prompt_tokens + max_new_tokens > self.positions:
            return (f"the prompt's {prompt_tokens} tokens + {max_new_tokens} new tokens exceed the model's "
                    f"{self.positions} positions (max_position_embeddings); shorten the prompt or ask for fewer")
        return None
