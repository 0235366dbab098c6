"""The latency cost model (plan.py search --objective latency): how long one generation request
takes under a plan, and what each rank holds while it runs.

One prompt of N tokens at batch 1, then M new tokens, forward only, as galaxy.inference.engine
runs them: the prefill runs the prompt under the plan and chooses the first new token; each of the
M - 1 decode steps runs the token chosen last, attending to every key cached before it and its own.
No backward, no weight gradients, no optimizer state, no micro-batches: one request crosses the
pipeline's stages one after the other (nothing overlaps at batch 1), and data-parallel replicas
would serve other requests, not cut this one's time (the search keeps dp 1).

Prefill. The prompt is padded to P tokens: pad_size where the plan splits tokens (the shares are
made for it), else N. Each sub-block takes its slowest rank's forward at its share and one row
(the device profile's table, taken at pad_size tokens; at P < pad_size times the ratio its
token-indexed table measured at P and at pad_size, galaxy.planner.chunked_prefill.tokens_time),
each layer its plan's forward transitions at P tokens
(TP: an all-reduce out, or under CON SP an all-gather in and a reduce-scatter out; SP under CON
None: an all-gather out; SP attention: its K/V all-gather), each stage boundary one send of the
carry. The sampler (the last Galaxy rank of the last stage) runs the LM head on the last position.
A prompt in prefill_chunks token chunks (tokens whole on every rank) crosses the pipeline as a
flow shop of its stages and links (galaxy.planner.chunked_prefill); with choose_chunks (the
search) the estimate takes the count in CHUNK_CHOICES that gives the quickest prefill.

Decode. One token, so no token split: CON runs the whole token on every rank, an SP ATT projects
it with every head and attends to its own cached keys (its prompt tokens and the decoded tokens it
owns, round-robin), a TP sub-block its heads or columns, an SP MLP its decode columns (the plan's
decode_columns, which the search chooses: every rank holds the whole MLP). Each piece's seconds
come from galaxy.planner.decode_time: the device profile's measured one-token steps where
profile-devices --objective latency took them (ATT at its heads, a line in the keys it attends
to; the MLP at its columns; each CON; the layer's glue beyond its sub-blocks; the embedding; the
LM head at its vocabulary rows; the sampler), else matrix FLOPs over the one-token rate. Per
layer: one one-token sum of [1, h] per TP sub-block and SP MLP ("token_sum": the engine's default
primitive, on CPU the group's own sockets; at its measured time where the link profile has it,
else priced as an all-reduce), one all-gather of [1, heads, head_dim + 1] (output and log-sum-exp)
per SP ATT (over the same token link: priced as a one-token sum of its bytes where measured).
The last stage's group splits the LM head by vocabulary rows (in proportion to the
decode step's MLP columns) and exchanges each rank's best logit and index (a greedy row's pick,
galaxy.inference.split_head; a measured 16-byte "token_sum"). The prefill ends with the sampler's [1, 2] broadcast over
the group and the pipeline (its measured "broadcast", else a one-call all-gather of 16 bytes), a
decode step with the pipeline's alone: every rank of the group chooses from the same logits.

Memory per rank: the baseline + the weights of its shards (fp32) + its KV caches as
galaxy.layers.cached_attention allocates them (TP and serial: its K/V heads of P + M slots; SP:
every K/V head of its s_r prompt tokens + ceil(M / group) decoded ones; k, v and a keep mask per
layer) + the prefill's working activations (the largest sub-block's bytes at its share, P / pad_size
of the profiled row, and the carry), counted once: no backward keeps them.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from galaxy.distributed.comm_bytes import ring_bytes
from galaxy.models.shape import with_shape_keys
from galaxy.plan import Plan
from galaxy.planner.chunked_prefill import ChunkedPrefillCost
from galaxy.planner.cost import SUB_BLOCKS, Estimate
from galaxy.planner.decode_time import PICK_BYTES, DecodeTimes, token_call_time, vocab_split
from galaxy.planner.link_model import link_time
from galaxy.planner.model_terms import FP32, MIB, ModelTerms
from galaxy.planner.profiles import ProfileError

TOKEN_MESSAGE_BYTES = 16            # the sampler's [1, 2] int64 (token, status)


@dataclass
class LatencyEstimate(Estimate):
    """Estimate with step_s = prefill + (M - 1) decode steps, and its parts."""
    prefill_s: float = 0.0
    decode_s_per_token: float = 0.0          # the mean decode step
    cache_mib: list[float] = field(default_factory=list)   # per rank


@dataclass
class _Pass:
    """One forward pass's figures per global rank, filled in stage by stage."""
    compute: list
    comm: list
    sent: list
    sub: list
    seconds: float = 0.0

    def add(self, other: "_Pass") -> None:
        """other's per-rank figures added to this pass's (its seconds are the caller's to place)."""
        for r, sub in enumerate(other.sub):
            self.compute[r] += other.compute[r]
            self.comm[r] += other.comm[r]
            self.sent[r] += other.sent[r]
            for k, v in sub.items():
                self.sub[r][k] = self.sub[r].get(k, 0.0) + v


class LatencyCostModel(ChunkedPrefillCost, ModelTerms):
    """estimate(plan): one request's prefill and decode time and every rank's memory (module
    docstring). The plan search (galaxy.planner.search.Searcher) drives it as it drives CostModel,
    and moves an SP MLP's decode columns too (charged as "MLP decode")."""
    decode_columns = True

    def __init__(self, model: dict, devices: list[dict], link: dict | None, *, prompt_tokens: int,
                 new_tokens: int, choose_chunks: bool = False):
        super().__init__(model, devices, link, batch_size=1)
        self.choose_chunks = choose_chunks
        hf = with_shape_keys(dict(model["hf_config"]), "the model profile")
        self.heads = hf["num_attention_heads"]
        self.kv_heads = hf.get("num_key_value_heads") or self.heads
        self.head_dim = hf.get("head_dim") or self.hidden // self.heads
        self.prompt, self.new = prompt_tokens, new_tokens
        for r, d in enumerate(devices):
            if not d.get("gemm_flops_per_s"):
                raise ProfileError(f"rank {r}'s device profile has no gemm_flops_per_s, which times decode steps; "
                                   "run plan.py profile-devices")
        per_token = {k: v["fwd"] / self.seq for k, v in model["flops_per_row"].items()}
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        # one token's matrix FLOPs, whole sub-blocks: ATT's projections (q, k, v in; o out), the MLP,
        # one CON, the LM head (the profile's "head" row: embeddings and head)
        self.token_flops = {"att": 2 * self.hidden * (q + 2 * kv) + 2 * q * self.hidden, "mlp": per_token["mlp"],
                            "con": per_token["con"], "head": per_token["head"]}
        self.vocab = hf.get("vocab_size") or 1
        self.decode = [DecodeTimes(d, self.token_flops, self.heads, self.head_dim, hf["intermediate_size"],
                                   self.vocab, f"rank {r}'s device profile") for r, d in enumerate(devices)]

    @property
    def backward_through_backbone(self) -> bool:
        return False                  # no backward: nothing to recompute

    def sub_blocks(self) -> list[tuple[int, str]]:
        return list(enumerate(SUB_BLOCKS))

    def prefill_tokens(self, plan: Plan) -> int:
        """P: pad_size where the plan splits tokens (galaxy.inference.engine.prefill_length), else N."""
        return self.seq if plan.splits_prompt() else self.prompt

    # --- time -----------------------------------------------------------------------------------

    def estimate(self, plan: Plan) -> LatencyEstimate:
        plan = self.with_chunks(plan)
        prefill, decode = self._blank(plan), self._blank(plan)
        self._prefill(plan, prefill)
        for p in range(plan.pp):
            self._decode_stage(plan, p, decode)
        self._broadcasts(plan, prefill, 1, (plan.group, plan.pp))
        self._broadcasts(plan, decode, self.new - 1, (plan.pp,))
        steps = max(1, self.new - 1)
        memory, cache = self.estimate_memory(plan), self.cache_mib(plan)
        add = lambda a, b: [x + y for x, y in zip(a, b)]       # noqa: E731
        subs = [{k: a.get(k, 0.0) + b.get(k, 0.0) for k in {**a, **b}} for a, b in zip(prefill.sub, decode.sub)]
        return LatencyEstimate(plan, prefill.seconds + decode.seconds, memory,
                               [int(x) for x in add(prefill.sent, decode.sent)], add(prefill.compute, decode.compute),
                               max(add(prefill.comm, decode.comm)), add(prefill.comm, decode.comm), subs,
                               prefill_s=prefill.seconds, decode_s_per_token=decode.seconds / steps, cache_mib=cache)

    @staticmethod
    def _blank(plan: Plan) -> _Pass:
        w = plan.world
        return _Pass([0.0] * w, [0.0] * w, [0.0] * w, [dict() for _ in range(w)])

    def _ranks(self, plan: Plan, p: int) -> list[int]:
        return [p * plan.group + j for j in range(plan.group)]

    def _prefill_stage(self, plan: Plan, p: int, out: _Pass, tokens: int | None = None, whole: bool = True) -> None:
        """Stage p's part of the prefill at `tokens` (default P, the whole prompt): its layers'
        sub-blocks at the slowest rank, their transitions, the embedding (first stage); where
        `whole`, the head on the last position (the sampler) and the carry's send to the next stage."""
        L, ranks = plan.stages[p], self._ranks(plan, p)
        P = self.prefill_tokens(plan) if tokens is None else tokens
        kinds = [self._kinds(plan, j) for j in range(plan.group)]
        for label, pick in (("ATT", lambda k: k[0]), ("CON", lambda k: ("con", k[2])), ("MLP", lambda k: k[1]),
                            ("CON", lambda k: ("con", k[2]))):
            times = [self.tokens_time(r, *pick(kinds[j]), P) for j, r in enumerate(ranks)]
            self._charge(out, ranks, label, [L * t for t in times])
        if p == 0:
            self._charge(out, ranks, "EMB", [self.tokens_time(r, "embed", self.seq, P) for r in ranks])
        if p == plan.pp - 1 and whole:
            self._prefill_head(plan, out, ranks)
        calls = self.prefill_calls(plan, P)
        self._communicate(plan, out, ranks, calls, L)
        if p < plan.pp - 1 and whole:
            tokens = max(plan.tokens) if plan.con == "SP" and plan.group > 1 else P
            self._hop(out, ranks, self.carry * tokens * self.hidden * FP32)

    def _prefill_head(self, plan: Plan, out: _Pass, ranks: list[int]) -> None:
        """The last stage's head after the prefill: the sampler's (the last Galaxy rank) LM head on
        the last position and its choice."""
        self._charge(out, ranks[-1:], "HEAD", [self.sampler_head_s(ranks[-1])])

    def sampler_head_s(self, r: int) -> float:
        """The sampler's LM head on the last position and its choice: measured on one token where
        the profile has a decode section, else the head's table (or FLOPs) per token."""
        d = self.decode[r]
        if d.measured:
            return d.head(self.vocab) + d.sampler()
        return self.compute[r]("head", self.seq, 1)[0] / self.seq

    def _decode_stage(self, plan: Plan, p: int, out: _Pass) -> None:
        """Stage p's part of the M - 1 decode steps (module docstring): ATT's time grows with the
        keys cached, the other sub-blocks' does not; every layer's glue; the embedding (first
        stage); the LM head split by vocabulary rows over the last stage's group, its logits
        gathered, and the sampler's choice."""
        L, ranks, steps = plan.stages[p], self._ranks(plan, p), self.new - 1
        if steps < 1:
            return
        times = [self.decode[r] for r in ranks]
        own, path = self._decode_attention(plan, tuple(ranks))
        self._charge(out, ranks, "ATT", [L * t for t in own], L * path)
        mlp = self._decode_shares(plan, "mlp")
        self._charge(out, ranks, "MLP" if plan.mlp == "TP" else "MLP decode",
                     [L * steps * d.mlp(u) for d, u in zip(times, mlp)])
        self._charge(out, ranks, "CON", [L * steps * (2 * d.con() + d.glue()) for d in times])
        if p == 0:
            self._charge(out, ranks, "EMB", [steps * d.embed() for d in times])
        if p == plan.pp - 1:
            self._decode_head(plan, out, ranks, steps)
        self._communicate(plan, out, ranks, self.decode_calls(plan), L * steps)
        if p < plan.pp - 1:
            self._hop(out, ranks, self.carry * self.hidden * FP32, steps)

    def _decode_head(self, plan: Plan, out: _Pass, ranks, steps: int) -> None:
        """The last stage's LM head on each decoded token: a group splits it by vocabulary rows
        (galaxy.inference.split_head) and, greedy, exchanges each rank's best logit and index
        (PICK_BYTES; sampling gathers the logits, not priced here: the latency objective is the
        greedy request's); a rank alone runs it whole. Then the sampler chooses."""
        times = [self.decode[r] for r in ranks]
        if plan.group == 1:
            self._charge(out, ranks, "HEAD", [steps * (times[0].head(self.vocab) + times[0].sampler())])
            return
        rows = vocab_split(self.vocab, plan.decode_mlp_columns())
        self._charge(out, ranks, "HEAD", [steps * d.head(v) for d, v in zip(times, rows)])
        # a greedy row's pick (split_head.greedy_tokens): one exchange of its best logit and index,
        # at the measured one-token call; else (older profiles) the gather of the logits
        pick = token_call_time(self.link, "token_sum", plan.group, PICK_BYTES)
        if pick is not None:
            wire = ring_bytes("all_gather", PICK_BYTES // FP32, FP32, plan.group)
            t = steps * pick
        else:
            wire = ring_bytes("all_gather", max(rows), FP32, plan.group)
            t = steps * link_time(self.link, "all_gather", plan.group, wire, 1, len(set(rows)) > 1, tuple(ranks))
        for r in ranks:
            out.comm[r] += t
            out.sent[r] += steps * wire
        out.seconds += t
        self._charge(out, ranks[-1:], "HEAD", [steps * times[-1].sampler()])

    def decode_rate(self, r: int) -> float:
        """Rank r's FLOPs per second on one token: its profile's decode_flops_per_s (one token's
        product reads the whole weight: memory-bound), else its GEMM rate (older profiles)."""
        return self.devices[r].get("decode_flops_per_s") or self.devices[r]["gemm_flops_per_s"]

    def _decode_shares(self, plan: Plan, sub: str) -> list[int]:
        """Per Galaxy rank, the heads (ATT) or columns (MLP) it runs for one token: TP its share, an
        SP MLP its decode columns, an SP ATT (and a group of one) all of them."""
        if plan.group == 1:
            return [self.heads if sub == "att" else sum(plan.columns)]
        if sub == "mlp":
            return list(plan.decode_mlp_columns())
        return list(plan.heads) if plan.att == "TP" else [self.heads] * plan.group

    def _decode_attention(self, plan: Plan, ranks: tuple) -> tuple[list[float], float]:
        """(each Galaxy rank's seconds of ATT over the S = M - 1 steps, the steps' sum of the
        slowest rank's: the step's collective waits for it). A rank's step k (0-based) is a line
        in its keys, a + b x keys (DecodeTimes.att_line at its heads); the keys are P + k + 1
        (TP, serial), under SP its s_r prompt tokens and the decoded tokens it owns (owner k mod group)."""
        steps = self.new - 1
        lines = tuple(self.decode[r].att_line(h) for r, h in zip(ranks, self._decode_shares(plan, "att")))
        if plan.group > 1 and plan.att == "SP":
            return self._sp_decode_attention(plan.tokens, lines)
        # every rank's step grows alike in k: the slowest rank is the same at every step
        keys = steps * (self.prefill_tokens(plan) + 1) + steps * (steps - 1) / 2
        own = [a * steps + b * keys for a, b in lines]
        return own, max(own)

    @functools.lru_cache(maxsize=4096)
    def _sp_decode_attention(self, tokens: tuple, lines: tuple) -> tuple[list[float], float]:
        """_decode_attention under SP, step by step (the slowest rank changes as keys arrive)."""
        g = len(tokens)
        own, path = [0.0] * g, 0.0
        for k in range(self.new - 1):
            t = [a + b * (tokens[j] + max(0, (k - j) // g + 1)) for j, (a, b) in enumerate(lines)]
            own = [x + y for x, y in zip(own, t)]
            path += max(t)
        return own, path

    def _charge(self, out: _Pass, ranks: list[int], label: str, seconds: list[float],
                path: float | None = None) -> None:
        """Ranks run a sub-block side by side: the pass takes the slowest (path, when the slowest
        changes from step to step), each rank its own seconds."""
        for r, t in zip(ranks, seconds):
            out.compute[r] += t
            out.sub[r][label] = out.sub[r].get(label, 0.0) + t
        out.seconds += max(seconds) if path is None else path

    def prefill_calls(self, plan: Plan, P: int) -> list[tuple[str, int]]:
        """(kind, elements per rank) of one layer's forward transitions in the prefill."""
        if plan.group == 1:
            return []
        con_s = plan.con == "SP"
        shard, full = max(plan.tokens) * self.hidden, P * self.hidden
        calls = []
        for method in (plan.att, plan.mlp):
            if method == "TP":
                calls += [("all_gather", shard), ("reduce_scatter", shard)] if con_s else [("all_reduce", full)]
            elif not con_s:
                calls.append(("all_gather", shard))         # S -> R out (R -> S in is a local split)
        if plan.att == "SP":
            calls.append(("all_gather", max(plan.tokens) * 2 * self.kv_heads * self.head_dim))
        return calls

    def decode_calls(self, plan: Plan) -> list[tuple[str, int]]:
        """(kind, elements per rank) of one layer's collectives in a decode step: a TP sub-block's
        and the MLP's (TP or SP, each on its columns) one-token sum ("token_sum":
        galaxy.parallel.decode_layout's default), an SP ATT's exchange of [1, heads, head_dim + 1]
        ("token_gather": one round of messages as the sum's, over the same token link, so priced
        as a measured "token_sum" of its bytes; else, older profiles, as the all-gather it was)."""
        if plan.group == 1:
            return []
        att = ("token_sum", self.hidden) if plan.att == "TP" else ("token_gather", self.heads * (self.head_dim + 1))
        return [att, ("token_sum", self.hidden)]

    def _call_time(self, kind: str, g: int, numel: int, uneven: bool, ranks) -> tuple[float, float]:
        """(seconds, bytes sent) of one call: a one-token sum at its measured time where the link
        profile has it (profile-devices --objective latency), else priced as the all-reduce it
        replaced (older profiles)."""
        if kind in ("token_sum", "token_gather"):
            measured = token_call_time(self.link, "token_sum", g, numel * FP32)
            if measured is not None:
                return measured, ring_bytes("all_gather", numel, FP32, g)
            kind = "all_reduce" if kind == "token_sum" else "all_gather"
        b = ring_bytes(kind, numel, FP32, g)
        return link_time(self.link, kind, g, b, 1, uneven and kind != "all_reduce", tuple(ranks)), b

    def _communicate(self, plan: Plan, out: _Pass, ranks, calls, times: int) -> None:
        """`times` rounds of `calls` over the stage's group: on the path, and each rank's."""
        g, uneven = plan.group, len(set(plan.tokens)) > 1
        for kind, numel in calls:
            one, b = self._call_time(kind, g, numel, uneven, ranks)
            t = times * one
            for r in ranks:
                out.comm[r] += t
                out.sent[r] += times * b
            out.seconds += t

    def _hop(self, out: _Pass, ranks, nbytes: float, times: int = 1) -> None:
        """The carry's sends (one per carry tensor) to the next stage (dp 1: its ranks follow these;
        every rank sends its counterpart at once, so the slowest pair's link)."""
        ranks = list(ranks)
        t = times * self.carry * max(link_time(self.link, "send_recv", 2, nbytes / self.carry, 1, ranks=(r, r + len(ranks)))
                                     for r in ranks)
        for r in ranks:
            out.comm[r] += t
            out.sent[r] += times * nbytes
        out.seconds += t

    def _broadcasts(self, plan: Plan, out: _Pass, times: int, sizes) -> None:
        """The sampler's token broadcast after a pass, over the group and the pipeline (`sizes`: a
        decode step's goes over the pipeline alone: every rank of the group chooses the token itself
        from the same gathered logits, galaxy.inference.engine)."""
        for n in sizes:
            if n > 1 and times > 0:
                one = token_call_time(self.link, "broadcast", n, TOKEN_MESSAGE_BYTES)
                t = times * (one if one is not None else
                             link_time(self.link, "all_gather", n, TOKEN_MESSAGE_BYTES * (n - 1), 1))
                out.seconds += t
                for r in range(plan.world):
                    out.comm[r] += t

    # --- memory ---------------------------------------------------------------------------------

    def cache_bytes(self, plan: Plan, p: int, j: int) -> int:
        """Rank j of stage p's KV caches, as galaxy.layers.cached_attention.start_cache makes them:
        k and v [1, kv_heads_r, slots, d] (fp32) and keep [1, slots] (bool) per layer."""
        g = plan.group
        if g > 1 and plan.att == "SP":
            kv, slots = self.kv_heads, plan.tokens[j] + math.ceil(self.new / g)
        else:
            kv = plan.heads[j] // (self.heads // self.kv_heads) if g > 1 else self.kv_heads
            slots = self.prefill_tokens(plan) + self.new
        return plan.stages[p] * (2 * kv * slots * self.head_dim * FP32 + slots)

    def cache_mib(self, plan: Plan) -> list[float]:
        return [self.cache_bytes(plan, r // plan.group, r % plan.group) / MIB for r in range(plan.world)]

    def estimate_memory(self, plan: Plan) -> list[float]:
        """MiB per rank: baseline, weights, KV caches, the prefill's working activations."""
        out = []
        P = self.prefill_tokens(plan)
        for r in range(plan.world):
            p, j = divmod(r, plan.group)
            weights = self.params_of(plan, p, j) * FP32
            (ak, au), (mk, mu), con = self._kinds(plan, j)
            working = max(self._act(ak, au), self._act(mk, mu), self._act("con", con)) * P / self.seq
            working += self.carry * con * self.hidden * FP32 * P / self.seq
            out.append(self.devices[r].get("baseline_mib", 0.0) + (weights + self.cache_bytes(plan, p, j) + working) / MIB)
        return out
