"""The KV cache: what each attention sub-block keeps of the keys and values it has seen, on this rank.

Generation (galaxy.inference) runs the prompt once under the plan (the prefill) and then one new
token per row per step (decode), and every step reads the keys and values of everything before
it from the cache instead of recomputing them. Each rank keeps only its share:

  serial, ATT TP    every token's K/V of this rank's K/V heads   [b, kv_heads_r, prompt + new, d]
  ATT SP            K/V of this rank's prompt tokens, and of the decoded tokens it owns
                    (CacheStep.owner: round-robin over the group)  [b, kv_heads, s_r + new/N, d]

A cache is preallocated for the prompt and max_new_tokens when generation starts
(`open_caches`), so decoding never allocates; `keep` says which slots hold a real key of each row
(left padding of a shorter prompt does not).

Any module with a `start_cache(rows, prompt, new, dtype, device)` method that returns a cache and a
`kv_cache` attribute takes part: the shared SelfAttention does (galaxy.layers.cached_attention).
An encoder-decoder names its caching modules itself (`cached_prefills`, galaxy.models.seq2seq):
each decoder ATT, with no prefill (the decoder starts from one start token), and each XATT,
whose cache holds the K/V of the encoder's output, projected once at the prefill, for its heads
or under SP its source tokens (galaxy.layers.cross_attention); the encoder's ATTs run once and
cache nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# The layer_context key under which the engine hands every ATT the current step (CacheStep).
STEP_KEY = "kv_step"
# The decode step's layer_context key for an additive bias over the keys, [1 | b, heads, 1, T]:
# column t for the t-th decoded token (T5's relative position bias of a decoder without prefill).
KEY_BIAS = "key_bias"


@dataclass(frozen=True)
class CacheStep:
    """What every layer's cache needs to know about the forward pass under way."""
    decoding: bool           # False: the prompt (prefill), all of it; True: one new token per row
    keep: torch.Tensor       # [b, s] bool: the tokens of this pass that are real (prompt: not padding)
    owner: int = 0           # decoding under SP: the Galaxy rank whose cache stores the new token's K/V
    link: object = None      # decoding: the group's TokenLink (galaxy.distributed.token_link), if any:
                             # an SP ATT's merge exchanges its partial outputs over it


class KVCache:
    """Preallocated keys and values of one attention on this rank.

    k, v: [b, kv_heads, slots, d] (the layout scaled_dot_product_attention reads); keep: [b, slots]
    bool, True where a slot holds a real key of that row; the first `length` slots are filled, and
    attention reads them from `start` on (skip_padding: the slots before it hold no row's key)."""

    def __init__(self, rows: int, kv_heads: int, slots: int, head_dim: int, dtype, device):
        self.k = torch.zeros(rows, kv_heads, slots, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.keep = torch.zeros(rows, slots, dtype=torch.bool, device=device)
        self.length = 0
        self.start = 0

    @property
    def slots(self) -> int:
        return self.k.shape[2]

    def write(self, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> None:
        """Append n tokens: k, v [b, kv_heads, n, d]; keep [b, n]."""
        start, n = self.length, k.shape[2]
        if start + n > self.slots:
            raise RuntimeError(f"KV cache full: {start} + {n} tokens exceed its {self.slots} slots")
        self.k[:, :, start:start + n] = k
        self.v[:, :, start:start + n] = v
        self.keep[:, start:start + n] = keep
        self.length = start + n

    def filled(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, v [b, kv_heads, T, d], keep [b, T]): views of the filled slots from `start`,
        T = length - start."""
        a, n = self.start, self.length
        return self.k[:, :, a:n], self.v[:, :, a:n], self.keep[:, a:n]

    def skip_padding(self) -> None:
        """After the prefill: later steps attend from the first slot that holds some row's real
        key. A prompt left-padded to pad_size (a plan that splits tokens) otherwise has every
        decode step read, and mask, pad_size - prompt keys more than the prompt has (the bench's
        32-token prompt padded to 512: 16 times its keys). A masked key weighs nothing: only the
        rounding of the softmax's sums can move. Beam search's reordering keeps it valid (rows
        only take other rows' slots)."""
        real = self.keep[:, :self.length].any(0)                          # [length]
        self.start = int(real.int().argmax()) if bool(real.any()) else self.length

    def reorder(self, rows: torch.Tensor) -> None:
        """Beam search: row i takes what row rows[i] holds ([b] indices; in place, so every view
        of the cache stays valid). The same on every rank, whatever share of heads or slots it
        keeps: the rows are the batch's, split by no plan."""
        self.k.copy_(self.k.index_select(0, rows))
        self.v.copy_(self.v.index_select(0, rows))
        self.keep.copy_(self.keep.index_select(0, rows))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.keep.nbytes


class Caches:
    """Every cache of one model (or pipeline stage) on this rank, for one generation."""

    def __init__(self, model: nn.Module, modules: list[nn.Module]):
        self.model, self.modules = model, modules

    @property
    def nbytes(self) -> int:
        return sum(m.kv_cache.nbytes for m in self.modules if m.kv_cache is not None)

    def reorder(self, rows: torch.Tensor) -> None:
        """Every cache's rows follow the beams chosen (KVCache.reorder): self- and cross-attention."""
        for m in self.modules:
            if m.kv_cache is not None:
                m.kv_cache.reorder(rows)

    def skip_padding(self) -> None:
        """Every cache's decode steps skip the slots no row fills (KVCache.skip_padding)."""
        for m in self.modules:
            if m.kv_cache is not None:
                m.kv_cache.skip_padding()

    def close(self) -> None:
        """Free the caches: the modules compute as in training again."""
        for m in self.modules:
            m.kv_cache = None


def open_caches(model: nn.Module, rows: int, prompt: int, new: int, dtype, device) -> Caches:
    """Give every caching module of `model` a cache for `rows` rows of `prompt` tokens (padded) and
    `new` decoded tokens. Until Caches.close() the modules read and write them. A model with
    `cached_prefills(prompt)` -> [(module, its prefill length)] names its caching modules itself."""
    named = getattr(model, "cached_prefills", None)
    pairs = named(prompt) if callable(named) else \
        [(m, prompt) for m in model.modules() if callable(getattr(m, "start_cache", None))]
    for m, prefill in pairs:
        m.kv_cache = m.start_cache(rows, prefill, new, dtype, device)
    return Caches(model, [m for m, _ in pairs])
