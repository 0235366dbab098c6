"""KV-cached generation on this rank's part of a model, under any plan and pipeline stage.

One batch of rows (Requests) at a time, every rank of the replica in lockstep:

  prefill   the prompts, left-padded to one length P, run once under the plan: first stage embeds,
            every stage runs its layers (the carry, [b, s_con, h] per tensor, sent to the same
            Galaxy rank of the next stage), each ATT writing its share of K/V to its cache
            (galaxy.layers.cached_attention). P is the longest prompt, or pad_size where the plan
            splits tokens (its shares are made for pad_size).
  sample    the sampler (the last Galaxy rank of the last stage: it holds the last prompt token
            under CON SP) runs the LM head on the last position only, [b, vocab], chooses every
            row's token (galaxy.inference.sampling) and broadcasts [b, 2] (token, status) over its
            group, then the last stage broadcasts it over the pipeline: every rank goes on with
            the same tokens and knows which rows have stopped.
  decode    one token per row under the decode layouts (galaxy.parallel.decode_layout), positions
            continuing each row's own, until every row has stopped. The LM head of a decode step
            is split by vocabulary rows over the last stage's group and its logits gathered to
            the sampler (galaxy.inference.split_head); each TP sub-block's (and SP MLP's)
            one-token partial output is summed by `token_sum`'s primitive. The gather gives every
            rank of the group the same logits, so each rank chooses the tokens itself and the
            [b, 2] broadcast of the sampler's choice is skipped (one collective a token less):
            greedy rows by the argmax (a batch of greedy rows only: no logits gathered, each rank
            sends its vocabulary rows' best logit and its index, [b, 2], and every rank takes the
            first largest, the gathered argmax); sampled rows (without a pipeline) by the same draw, each
            rank's row generators set once, after the prefill, to the sampler's states (one
            broadcast a batch): a draw depends only on the logits and the generator's state.
            Beam search, and sampling under a pipeline, keep the sampler's broadcast.

A pipeline's prefill may run in token chunks (the plan's prefill_chunks; tokens whole on every
rank: no SP sub-block): stage s computes chunk k + 1 while stage s + 1 computes chunk k, the
carry of each chunk sent asynchronously (galaxy.inference.chunked_prefill).

Left padding and per-row positions follow Hugging Face's generate: position = real tokens
before it, so a padded row computes what it would alone.

Beam search (num_beams K > 1, galaxy.inference.beam_search): each prompt is K rows; the sampler
broadcasts each row's token and the row it continues, and every rank reorders its caches' rows
(Caches.reorder) before the next step; at the end it broadcasts each prompt's best hypothesis.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from galaxy.distributed import waiting
from galaxy.distributed.token_link import TokenLink
from galaxy.inference.beam_search import BeamProgress
from galaxy.inference.chunked_prefill import ChunkedPrefill, chunk_spans
from galaxy.inference.requests import FINISH_CODE, RUNNING, Completion, Progress, Request
from galaxy.inference.split_head import SplitHead
from galaxy.layers.kv_cache import STEP_KEY, CacheStep, open_caches
from galaxy.parallel.decode_layout import SOCKET, decode_layouts, default_token_sum
from galaxy.pipeline.stage import carry_dtype, carry_shapes, carry_slots, pack_carry, unpack_carry
from galaxy.plan import Layout


class Engine:
    def __init__(self, model, plan, mesh, tokenizer, *, eos_ids, device="cpu", token_sum=None):
        """model: this rank's part, built under `plan` on `mesh` (galaxy.runtime.assemble);
        token_sum: how a decode step sums a TP sub-block's output (galaxy.parallel.decode_layout;
        None: default_token_sum). Collective over the Galaxy group under "socket" (the default on
        CPU): its ranks connect their TokenLink."""
        self.model, self.plan, self.mesh, self.tokenizer = model, plan, mesh, tokenizer
        self.group, self.device = mesh.galaxy, torch.device(device)
        self.eos = frozenset(eos_ids)
        pad = tokenizer.pad_token_id
        self.pad = pad if pad is not None else min(self.eos, default=0)
        self.split_tokens = plan.splits_prompt()
        self.is_sampler = mesh.is_last_stage and self.group.rank == self.group.size - 1
        self.token_sum = token_sum or default_token_sum(self.device)
        # the group's own sockets for a decode step's small messages: its sums and the LM head's pick
        self.link = TokenLink.open(self.group.pg) if self.token_sum == SOCKET and self.group.size > 1 else None
        self.split_head = SplitHead(model, self.group, self.link) \
            if SplitHead.applies(model, self.group, mesh.is_last_stage) else None
        self.cache_bytes = 0                 # this rank's KV cache of the last batch
        self.prefill_parts = None            # a chunked prefill's seconds on this rank (ChunkedPrefill.seconds)
        model.eval()
        for layer in model.layers:           # chunked transitions call ATT's pieces, not its cache path
            layer.comm_chunks = 1

    def prefill_length(self, longest: int) -> int:
        """The padded prompt length for a batch whose longest prompt has `longest` tokens."""
        return sum(self.plan.tokens) if self.split_tokens else longest

    @torch.no_grad()
    def generate(self, requests: list[Request], on_token=None) -> list[Completion]:
        """Every row's completion. on_token(row, token, status), when given, hears each token as
        soon as this rank has it (under beam search: every token of the answer, at the end)."""
        progress = self._progress(requests)
        ids, mask, positions = self._left_padded(progress.rows)
        rows, length = ids.shape
        new = max(r.max_new_tokens for r in requests)
        caches = open_caches(self.model, rows, length, new, carry_dtype(self.model), self.device)
        self.cache_bytes = caches.nbytes
        everywhere = self._chooses_everywhere(progress)
        # every rank of the group picks greedy rows' tokens itself from the head's shares' best
        # logits (SplitHead.greedy_tokens): no logits gathered
        greedy = everywhere and all(r.sampling.greedy for r in progress.rows)
        try:
            logits = self._prefill(ids, mask, positions)
            caches.skip_padding()            # decode steps read no slot that is padding in every row
            self._advance(progress, logits, on_token, caches)
            if everywhere:
                self._share_generators(progress)
            ones = torch.ones(rows, 1, dtype=torch.long, device=self.device)
            keep = ones.bool()
            with decode_layouts(self.model, self.token_sum, self.link):
                step = 0
                while not progress.done:
                    tokens = torch.tensor(progress.last_tokens(), device=self.device)[:, None]
                    positions = self._reordered(progress, positions)[:, -1:] + 1        # [b, 1]
                    owner = step % self.group.size
                    step_info = CacheStep(True, keep, owner, self.link)
                    scores = self._forward(tokens, ones, positions, step_info, everywhere, greedy)
                    self._advance(progress, scores, on_token, caches, everywhere, greedy)
                    step += 1
        finally:
            caches.close()
        return self._completions(progress, on_token)

    def _chooses_everywhere(self, progress) -> bool:
        """Whether every rank of the last stage's group chooses a decode step's tokens itself: the
        split head gives each the same logits; greedy rows need no shared draw, sampled rows the
        sampler's generator states (_share_generators; not under a pipeline)."""
        if self.split_head is None or isinstance(progress, BeamProgress):
            return False
        return self.mesh.pp_pg is None or all(r.sampling.greedy for r in progress.rows)

    def _share_generators(self, progress) -> None:
        """Every sampled row's generator as the sampler's after the prefill's draw: [rows, state
        bytes] broadcast over the group once a batch (nothing when every row is greedy)."""
        states = progress.generator_states(self.device)
        if not states.numel():
            return
        g, moved = self.group, states.to(self.device)
        waiting.wait(dist.broadcast(moved, src=dist.get_global_rank(g.pg, g.size - 1), group=g.pg, async_op=True))
        if not self.is_sampler:
            progress.set_generator_states(moved.cpu())

    def _progress(self, requests: list[Request]):
        """How the batch's rows stand: one row per request, or num_beams rows (beam search)."""
        if requests[0].beams.num_beams > 1:
            return BeamProgress(list(requests), self.tokenizer, self.eos, self.pad)
        return Progress(list(requests), self.tokenizer, self.eos, self.pad)

    def _reordered(self, progress, rows_first: torch.Tensor) -> torch.Tensor:
        """A per-row tensor [b, ...] in the order of the beams the last step chose."""
        parents = progress.parents
        return rows_first if parents is None else rows_first[parents.to(rows_first.device)]

    def _completions(self, progress, on_token) -> list[Completion]:
        """Every request's completion; under beam search, the sampler's answers broadcast."""
        if not isinstance(progress, BeamProgress):
            return progress.completions()
        answers = progress.answers() if self.is_sampler else torch.empty(progress.answers_shape, dtype=torch.long)
        done = progress.completions(self._from_sampler(answers.to(self.device)).cpu())
        for row, c in enumerate(done if on_token is not None else ()):
            for i, token in enumerate(c.tokens):
                on_token(row, token, RUNNING if i + 1 < len(c.tokens) else FINISH_CODE[c.finish_reason])
        return done

    def _left_padded(self, requests):
        """ids, mask, positions [b, P]: prompts right-aligned, positions counting real tokens."""
        length = self.prefill_length(max(len(r.ids) for r in requests))
        ids = torch.full((len(requests), length), self.pad, dtype=torch.long)
        mask = torch.zeros(len(requests), length, dtype=torch.long)
        for i, r in enumerate(requests):
            if r.ids:
                ids[i, length - len(r.ids):] = torch.tensor(r.ids)
                mask[i, length - len(r.ids):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)        # Hugging Face's, pad slots aside
        return ids.to(self.device), mask.to(self.device), positions.to(self.device)

    def _forward(self, ids, mask, positions, step: CacheStep, everywhere: bool = False, greedy: bool = False):
        """One pass of this stage; on the sampler (on every rank of its group where `everywhere`,
        decoding), the last position's logits [b, vocab] (fp32), or with `greedy` (decoding,
        everywhere) every row's greedy token [b]."""
        m = self.model
        context = {**m.layer_context(mask, positions), STEP_KEY: step}
        layout = Layout.R if step.decoding else self.plan.con_layout
        slots = carry_slots(m)
        carry = self._through_stage(lambda: m.embed(ids, positions=positions), slots, slots,
                                    carry_shapes(m, layout, *ids.shape), context, m.layers)
        if step.decoding and greedy and self.split_head is not None:
            return self.split_head.greedy_tokens(carry)                         # [b], every rank
        if step.decoding and self.split_head is not None:
            logits = self.split_head.logits(carry)                              # [b, vocab], every rank
            return logits if self.is_sampler or everywhere else None
        if not self.is_sampler:
            return None
        logits, _ = m.head(tuple(t[:, -1:] for t in carry))                    # [b, 1, vocab]
        return logits[:, -1].float()

    def _prefill(self, ids, mask, positions):
        """The prompt's pass: whole, or in prefill_chunks token chunks (ChunkedPrefill); the
        sampler's logits of the last position [b, vocab] (fp32), None elsewhere."""
        spans = chunk_spans(ids.shape[1], self.plan.prefill_chunks)
        if len(spans) == 1:
            return self._forward(ids, mask, positions, CacheStep(False, mask.bool()))
        chunked = ChunkedPrefill(self, spans)
        carry = chunked.run(ids, mask, positions)
        self.prefill_parts = chunked.seconds
        if not self.is_sampler:
            return None
        logits, _ = self.model.head(tuple(t[:, -1:] for t in carry))            # [b, 1, vocab]
        return logits[:, -1].float()

    def _advance(self, progress, scores, on_token, caches, everywhere: bool = False, greedy: bool = False) -> None:
        """The sampler chooses from the logits `scores` (or, `everywhere`, each rank of its group
        alike; `greedy`: scores are the rows' tokens already); every rank takes the choice (under
        beam search, every cache's rows follow the beams chosen)."""
        chooses = self.is_sampler or (everywhere and scores is not None)
        if greedy and scores is not None:
            packed = progress.take(scores.tolist())
        else:
            packed = progress.choose(scores) if chooses else torch.empty(progress.packed_shape, dtype=torch.long)
        packed = self._from_sampler(packed.to(self.device), group=not everywhere)
        for row, token, status in progress.record(packed.cpu()):
            if on_token is not None:
                on_token(row, token, status)
        if progress.parents is not None:
            caches.reorder(progress.parents.to(self.device))

    def _from_sampler(self, packed, group: bool = True):
        """The sampler's [b, 2] over its group (unless the group chose alike: group=False), then
        from the last stage over the pipeline; waited for in the run's mode (waiting.py)."""
        mesh, g = self.mesh, self.group
        if group and mesh.is_last_stage and g.pg is not None:
            waiting.wait(dist.broadcast(packed, src=dist.get_global_rank(g.pg, g.size - 1), group=g.pg, async_op=True))
        if mesh.pp_pg is not None:
            src = dist.get_global_rank(mesh.pp_pg, mesh.pp_size - 1)
            waiting.wait(dist.broadcast(packed, src=src, group=mesh.pp_pg, async_op=True))
        return packed

    # -- the pipeline: the carry from stage to stage --------------------------------------------

    def _through_stage(self, first_carry, received: tuple, sent: tuple, shapes, context: dict, layers) -> tuple:
        """This stage's part of one pass: the carry the first stage makes (first_carry()) or the
        previous stage sends (`shapes`' tensors, placed at the carry slots `received`), through
        `layers`; sent on to the next stage (the slots `sent`) unless this is the last. Returns it.
        One mechanism for every pass of both engines: the prefill, each decode step, and an
        encoder-decoder's first pass (both stacks' carries) and decode steps (the decoder's alone)."""
        m, at = self.model, self.model.attached
        carry = first_carry() if at.is_first_stage else unpack_carry(self._receive(shapes), received)
        carry = m.run_layers(tuple(carry), context, layers)
        if not at.is_last_stage:
            self._send(pack_carry(carry, sent))
        return carry

    def _receive(self, shapes) -> list:
        """The previous stage's tensors, of shapes [(shape, trainable)] (galaxy.pipeline.carry)."""
        pg = self.mesh.pp_pg
        tensors = [torch.empty(s, dtype=carry_dtype(self.model), device=self.device) for s, _ in shapes]
        for t in tensors:
            dist.recv(t, src=dist.get_global_rank(pg, self.mesh.pp_rank - 1), group=pg)
        return tensors

    def _send(self, tensors) -> None:
        pg = self.mesh.pp_pg
        for t in tensors:
            dist.send(t.to(carry_dtype(self.model)).contiguous(),
                      dst=dist.get_global_rank(pg, self.mesh.pp_rank + 1), group=pg)
