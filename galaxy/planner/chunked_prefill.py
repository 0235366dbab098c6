"""The latency cost of a pipeline's prefill in token chunks (galaxy.inference.chunked_prefill).

The prompt's P tokens cross the stages as C chunks (sizes differing by at most one). Every stage
and every boundary link is a resource that takes the chunks in order, one at a time: stage s
computes chunk k once chunk k has arrived and stage s has finished chunk k - 1; the link from s
to s + 1 moves chunk k once s has computed it and the link has moved chunk k - 1 (sends are
asynchronous: the stage does not wait for its link). So the prefill is a flow shop over the
resources stage 0, link 0, stage 1, ..., last stage (`flow_shop`): with equal chunks of times
t_i per resource, sum_i t_i + (C - 1) max_i t_i, the fill and drain of the chunk pipeline plus
C - 1 turns of its slowest resource.

A chunk's time at a stage: its layers' sub-blocks at c tokens and the group's collectives at c
tokens (each call's latency paid per chunk). A sub-block at c tokens takes its whole-prompt time at
the rank's share times the ratio the device profile measured for that sub-block at c tokens and at
the whole prompt (`tokens_time`: the sequence-parallel kinds' tables, timed at every chunk size the
search tries): what a pass of few tokens loses, its weights read from memory once more for few rows
(on home3's laptop the products of 64-token chunks ran at 0.83x the rows per second of a whole
512-token prompt, of 32-token chunks 0.70x: bench/prefill_chunk_cost.py) and its Python once more.
A device profile without those tables falls back to the tokens' share of the whole prompt plus each
layer's one-token step with no key cached (DecodeTimes.layer_pass), an upper bound of that loss. A
boundary's: one send of the chunk's carry [1, c, h] per carry tensor on that pair's link, its
latency paid per chunk. The LM head runs once, after the last chunk, on the last position.
"""
from __future__ import annotations

from dataclasses import replace

from galaxy.plan import Plan
from galaxy.planner.model_terms import FP32

# The chunk counts the latency search tries for a pipeline whose tokens stay whole.
CHUNK_CHOICES = (1, 2, 4, 8, 16, 32)


def chunk_sizes(tokens: int, chunks: int) -> list[int]:
    """Tokens per chunk, as galaxy.inference.chunked_prefill.chunk_spans cuts them."""
    n = max(1, min(chunks, tokens))
    base, extra = divmod(tokens, n)
    return [base + (i < extra) for i in range(n)]


def flow_shop(times: list[list[float]]) -> float:
    """times[k][i]: chunk k's seconds at resource i (in pipeline order). Each resource takes the
    chunks in order, one at a time, and chunk k enters resource i once it has left resource
    i - 1. -> when the last chunk leaves the last resource."""
    done = [0.0] * len(times[0])          # when each resource finished its latest chunk
    for row in times:
        left = 0.0                         # when this chunk left the previous resource
        for i, t in enumerate(row):
            left = done[i] = max(left, done[i]) + t
    return done[-1]


class ChunkedPrefillCost:
    """The latency cost model's prefill (galaxy.planner.latency_cost.LatencyCostModel), whole or in
    chunks; with choose_chunks (the search) the quickest count of CHUNK_CHOICES."""

    def chunks_of(self, plan: Plan) -> int:
        """The prompt's chunks as the engine runs them: 1 where a sub-block splits tokens."""
        return 1 if plan.splits_prompt() else max(1, min(plan.prefill_chunks, self.prefill_tokens(plan)))

    def with_chunks(self, plan: Plan) -> Plan:
        """plan with the quickest prefill_chunks of CHUNK_CHOICES (choose_chunks, a pipeline whose
        tokens stay whole); else plan as it is."""
        if not self.choose_chunks or plan.pp == 1 or plan.splits_prompt():
            return plan
        trials = [replace(plan, prefill_chunks=c) for c in CHUNK_CHOICES if c <= self.prefill_tokens(plan)]
        return min(trials, key=lambda q: self._prefill(q, self._blank(q)))

    def _prefill(self, plan: Plan, out) -> float:
        """The prefill into `out` (the estimate's pass of per-rank figures), whole or in chunks
        (module docstring); returns its seconds."""
        chunks = self.chunks_of(plan)
        if chunks == 1:
            for p in range(plan.pp):
                self._prefill_stage(plan, p, out)
            return out.seconds
        resources, rows = {}, []
        for c in chunk_sizes(self.prefill_tokens(plan), chunks):
            if c not in resources:
                resources[c] = self._chunk_resources(plan, c)
            for one in resources[c]:
                out.add(one)
            rows.append([one.seconds for one in resources[c]])
        out.seconds += flow_shop(rows)
        sampler = self._ranks(plan, plan.pp - 1)[-1]
        self._charge(out, [sampler], "HEAD", [self.sampler_head_s(sampler)])
        return out.seconds

    def _chunk_resources(self, plan: Plan, tokens: int) -> list:
        """One chunk of `tokens` at each resource: stage 0, the link 0 -> 1, stage 1, ...: a stage's
        layers at those tokens and each layer's pass; a link's send of the chunk's carry."""
        out = []
        heads, columns = self._decode_shares(plan, "att"), self._decode_shares(plan, "mlp")
        for p in range(plan.pp):
            stage, ranks = self._blank(plan), self._ranks(plan, p)
            self._prefill_stage(plan, p, stage, tokens, whole=False)
            if not all(self._measured_tokens(r) for r in ranks):
                self._charge(stage, ranks, "PASS", [plan.stages[p] * self.decode[r].layer_pass(h, c)
                                                    for r, h, c in zip(ranks, heads, columns)])
            out.append(stage)
            if p < plan.pp - 1:
                out.append(self._blank(plan))
                self._hop(out[-1], ranks, self.carry * tokens * self.hidden * FP32)
        return out

    # the sub-block kinds whose token-indexed table gives a pass's time at fewer tokens
    TOKEN_KIND = {"att_tp": "att_sp", "att_sp": "att_sp", "mlp_tp": "mlp_sp", "mlp_sp": "mlp_sp", "con": "con"}

    def _measured_tokens(self, r: int) -> bool:
        """Whether rank r's device profile timed its sub-blocks at token counts (tokens_time)."""
        return all(k in self.compute[r].tables for k in set(self.TOKEN_KIND.values()))

    def tokens_time(self, r: int, kind: str, units: int, tokens: int) -> float:
        """Rank r's forward seconds of `kind` at its share `units` on `tokens` of the prompt: the
        whole prompt's (pad_size tokens) times the profile's measured ratio of the kind's
        token-indexed table at `tokens` and at pad_size; without that table, tokens / pad_size."""
        whole = self.compute[r](kind, units, 1)[0]
        if tokens == self.seq:
            return whole
        by_tokens = self.TOKEN_KIND.get(kind)
        if by_tokens is None or not self._measured_tokens(r):
            return whole * tokens / self.seq
        at = lambda t: self.compute[r](by_tokens, t, 1)[0]          # noqa: E731
        return whole * at(tokens) / at(self.seq)
