"""A pipeline's prefill in token chunks (the plan's prefill_chunks): the prompt's P tokens cut into
C spans, each run through this stage's layers and sent on as soon as it is done, so that stage s
computes chunk k + 1 while stage s + 1 computes chunk k and the link carries chunk k meanwhile.
A whole-prompt pass makes every stage wait for the previous one's whole prompt.

Per chunk [a, b) of the left-padded batch:

  embed       the first stage embeds ids[:, a:b] at their positions
  context     the layer context of the whole prompt, cut to the chunk's queries (each ATT's
              `query_dims`: the mask's rows, Llama's rotary tables) and the mask to keys [0, b):
              [b, 1, c, b] (causal within the chunk, every earlier chunk visible, padding hidden)
  attention   each ATT appends the chunk's K/V to its cache and attends to every cached key
              (galaxy.layers.cached_attention), so the cache the decode reads is the one a
              whole-prompt pass writes
  boundary    the chunk's carry, [b, c, h] per tensor, sent with isend (the stage goes on to the
              next chunk while it travels); the next stage has posted a receive for every chunk
              before it starts (so a chunk can land while the stage still computes an earlier
              one), and waits for chunk k only when it is about to run it

Tokens stay whole on every rank of a stage's Galaxy group (TP sub-blocks, CON None): a plan whose
sub-blocks split tokens makes its shares for the whole pad_size prompt, so galaxy.plan refuses
prefill_chunks with it. Only the last chunk's last position reaches the LM head.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from galaxy.distributed import waiting
from galaxy.layers.kv_cache import STEP_KEY, CacheStep
from galaxy.pipeline.stage import carry_dtype, carry_shapes, carry_slots, pack_carry, unpack_carry
from galaxy.plan import even_split


def chunk_spans(tokens: int, chunks: int) -> list[tuple[int, int]]:
    """[a, b) of each of min(chunks, tokens) chunks of `tokens`, sizes differing by at most one,
    larger first."""
    ends, start = [], 0
    for size in even_split(tokens, max(1, min(chunks, tokens))):
        ends.append((start, start + size))
        start += size
    return ends


def chunk_context(whole: dict, query_dims: dict[str, int], a: int, b: int) -> dict:
    """The layer context of tokens [a, b) as queries over keys [0, b): each query-indexed tensor
    cut at its dimension, and the attention mask [b, 1, S, S] to [b, 1, b - a, b]."""
    out = {}
    for name, t in whole.items():
        dim = query_dims.get(name)
        if dim is not None:
            t = t[(slice(None),) * dim + (slice(a, b),)]
        out[name] = t[..., :b] if name == "mask" and t is not None else t
    return out


class ChunkedPrefill:
    """One prefill of this stage, chunk by chunk (module docstring); `run` returns the carry of
    the last chunk after this stage's layers."""

    def __init__(self, engine, spans: list[tuple[int, int]]):
        self.engine, self.model, self.spans = engine, engine.model, spans
        self.mesh, self.slots = engine.mesh, carry_slots(engine.model)
        self.dtype = carry_dtype(engine.model)
        # where this rank's prefill went (s): waiting for chunks to arrive, computing them, waiting
        # for its last sends; benches read them (bench/inference_plans.py)
        self.seconds = {"arriving": 0.0, "computing": 0.0, "sending": 0.0}

    @torch.no_grad()
    def run(self, ids, mask, positions) -> tuple:
        m, at = self.model, self.model.attached
        whole = m.layer_context(mask, positions)
        query_dims = next(iter(m.layers)).att.query_dims
        arriving = None if at.is_first_stage else self._post_receives(ids.shape[0])
        sending, carry = [], None
        clock, spent = time.perf_counter(), self.seconds
        for k, (a, b) in enumerate(self.spans):
            context = {**chunk_context(whole, query_dims, a, b), STEP_KEY: CacheStep(False, mask[:, a:b].bool())}
            if at.is_first_stage:
                carry = m.embed(ids[:, a:b], positions=positions[:, a:b])
            else:
                carry = unpack_carry(self._arrived(arriving[k]), self.slots)
                spent["arriving"], clock = spent["arriving"] + time.perf_counter() - clock, time.perf_counter()
            carry = m.run_layers(tuple(carry), context, m.layers)
            if not at.is_last_stage:
                sending += self._start_send(pack_carry(carry, self.slots))
            spent["computing"], clock = spent["computing"] + time.perf_counter() - clock, time.perf_counter()
        for work, _ in sending:               # the buffers live until their sends are done
            waiting.wait(work)
        spent["sending"] = time.perf_counter() - clock
        return carry

    def _peer(self, step: int) -> int:
        pg = self.mesh.pp_pg
        return dist.get_global_rank(pg, self.mesh.pp_rank + step)

    def _post_receives(self, rows: int) -> list[list]:
        """Per chunk, [(work, buffer)] of every carry tensor it brings, all posted now."""
        layout = self.engine.plan.con_layout
        posted = []
        for a, b in self.spans:
            buffers = [torch.empty(s, dtype=self.dtype, device=self.engine.device)
                       for s, _ in carry_shapes(self.model, layout, rows, b - a)]
            posted.append([(dist.irecv(t, src=self._peer(-1), group=self.mesh.pp_pg), t) for t in buffers])
        return posted

    @staticmethod
    def _arrived(receives: list) -> list:
        for work, _ in receives:
            waiting.wait(work)
        return [t for _, t in receives]

    def _start_send(self, tensors) -> list:
        out = []
        for t in tensors:
            t = t.to(self.dtype).contiguous()
            out.append((dist.isend(t, dst=self._peer(1), group=self.mesh.pp_pg), t))
        return out
