"""Chat records for causal-LM training: {"messages": [{"role", "content"}, ...]}, loss on the
assistant turns only.

A conversation is rendered to one string, with the character spans of the assistant turns:

  - with the tokenizer's chat template when it has one (tokenizer.apply_chat_template). The span
    of assistant turn i is what rendering messages[:i + 1] adds to rendering messages[:i] with the
    generation prompt: the reply and whatever the template closes the turn with (e.g. an
    end-of-turn token). The rendered text already holds the template's special tokens, so it is
    tokenised without adding more (as apply_chat_template(tokenize=True) does).
  - else with CHAT_TEMPLATE below (guanaco's "### Human: / ### Assistant:" style), tokenised with
    the tokenizer's default special tokens (e.g. BOS), like plain text:

        ### System: {content}\n          (only where a system message is)
        ### Human: {content}\n
        ### Assistant: {content}{eos}\n   <- the loss covers "{content}{eos}"

Tokens are labelled by character offsets (a fast tokenizer's offset mapping): a token whose
characters overlap an assistant span is a label, every other token is IGNORE (-100). The model
shifts the labels, as for every causal-LM sample.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import DataError

ROLES = ("system", "user", "assistant")
# role -> (header, footer) around the content; "{eos}" is the tokenizer's EOS token.
CHAT_TEMPLATE = {"system": ("### System: ", "\n"), "user": ("### Human: ", "\n"),
                 "assistant": ("### Assistant: ", "{eos}\n")}


@dataclass(frozen=True)
class Chat:
    """A conversation as read: (role, content) pairs; `where` is "file:line" for errors."""
    messages: tuple[tuple[str, str], ...]
    where: str


@dataclass(frozen=True)
class RenderedChat:
    """A conversation rendered for one tokenizer: the text, the assistant turns' character spans
    [start, end), and whether tokenising adds the tokenizer's special tokens."""
    text: str
    spans: tuple[tuple[int, int], ...]
    add_special_tokens: bool


def parse_chat(path: str, where, record: dict) -> Chat:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{path}:{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
    pairs = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{path}:{where}: messages[{i}] must be {{\"role\": one of {', '.join(ROLES)}, "
                            f"\"content\": a string}}, got {_short(m)}")
        pairs.append((m["role"], m["content"]))
    if not any(role == "assistant" and content.strip() for role, content in pairs):
        raise DataError(f"{path}:{where}: 'messages' has no non-empty assistant turn (the loss covers "
                        f"only assistant turns)")
    return Chat(tuple(pairs), f"{path}:{where}")


def uses_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer, chat: Chat) -> RenderedChat:
    if uses_chat_template(tokenizer):
        return _render_with_template(tokenizer, chat)
    eos = tokenizer.eos_token or ""
    text, spans = "", []
    for role, content in chat.messages:
        header, footer = CHAT_TEMPLATE[role]
        if role == "assistant":        # the reply and its EOS
            start = len(text) + len(header)
            spans.append((start, start + len(content) + len(eos)))
        text += header + content + footer.format(eos=eos)
    return RenderedChat(text, tuple(spans), True)


def render_chat_prompt(tokenizer, messages: list[tuple[str, str]]) -> tuple[str, bool]:
    """A conversation so far, rendered as the prompt of the assistant's next turn (generation):
    (text, whether tokenising adds the tokenizer's special tokens). The same template as
    training's: the tokenizer's chat template with its generation prompt, else CHAT_TEMPLATE's
    turns followed by the assistant's header."""
    if uses_chat_template(tokenizer):
        dicts = [{"role": r, "content": c} for r, c in messages]
        return tokenizer.apply_chat_template(dicts, tokenize=False, add_generation_prompt=True), False
    eos = tokenizer.eos_token or ""
    text = "".join(CHAT_TEMPLATE[r][0] + c + CHAT_TEMPLATE[r][1].format(eos=eos) for r, c in messages)
    return text + CHAT_TEMPLATE["assistant"][0], True


def _render_with_template(tokenizer, chat: Chat) -> RenderedChat:
    messages = [{"role": r, "content": c} for r, c in chat.messages]

    def render(upto, prompt=False):
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=prompt)

    full, spans = render(len(messages)), []
    for i, (role, _) in enumerate(chat.messages):
        if role != "assistant":
            continue
        before, through = render(i, prompt=True) if i else "", render(i + 1)
        # A template that renders earlier turns differently once later ones follow (one that
        # drops past reasoning, say) has no prefix-stable spans: say so rather than mislabel.
        if not (through.startswith(before) and full.startswith(through)):
            raise DataError(f"{chat.where}: the tokenizer's chat template does not render this "
                            f"conversation turn by turn (turn {i} is not a prefix of the whole); "
                            f"give text records, or a tokenizer whose template renders prefixes stably")
        spans.append((len(before), len(through)))
    return RenderedChat(full, tuple(spans), False)


def encode_chat(tokenizer, rendered: RenderedChat, pad_size: int, ignore_index: int):
    """-> (ids, labels) lists, truncated to pad_size (no padding)."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("chat records need a fast tokenizer (character offsets label the assistant turns)")
    enc = tokenizer(rendered.text, add_special_tokens=rendered.add_special_tokens, return_offsets_mapping=True)
    ids = enc["input_ids"][:pad_size]
    labels = []
    for token, (start, end) in zip(ids, enc["offset_mapping"]):
        inside = end > start and any(start < b and end > a for a, b in rendered.spans)
        labels.append(token if inside else ignore_index)
    return ids, labels


def _short(value) -> str:
    import json
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
