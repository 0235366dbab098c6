"""The latency cost model of an encoder classifier (plan.py search --objective latency on BERT):
how long one request, one input at batch 1, takes under a plan, and what each rank holds.

A classifier's request is one forward, as `pretrain_*.py --predict` runs it
(galaxy.inference.predict): the input padded to pad_size tokens (P, whatever the text's length),
the layers under the plan, then the pooler and the classifier on the [CLS] token. No KV cache, no
decode steps, no LM head, no sampler: the causal model's prefill (galaxy.planner.latency_cost)
with its own end.

  layers    each sub-block at its slowest rank's share, forward only, from the device's table at
            pad_size tokens and one row (profile-devices --objective latency), each layer's forward
            transitions at P tokens, each stage boundary one send of the carry [1, s, h]
  embed     the first stage's embeddings (replicated on its ranks)
  exit      under CON SP, the [CLS] candidates' all-gather: one token [1, h] from every rank
            (BertForClassification.plan_head); CON None holds the whole stream already
  head      the pooler and the classifier on one rank (every rank of the last stage runs them on
            the same token; the request's answer is global rank 0's)
  answer    with a pipeline, the logits broadcast from the last stage to the first over the
            pipeline group (PipelineRunner: broadcast_object_list, a size and the pickled bytes:
            two small broadcasts)

Memory per rank: the baseline, the weights of its shards and stage (fp32) and the forward's
working activations (the largest sub-block's at its share, and the carry); no gradients,
optimizer state, saved activations or cache.
"""
from __future__ import annotations

from galaxy.models.shape import with_shape_keys
from galaxy.plan import Plan
from galaxy.planner.decode_time import token_call_time
from galaxy.planner.latency_cost import TOKEN_MESSAGE_BYTES, LatencyCostModel, LatencyEstimate, _Pass
from galaxy.planner.link_model import link_time
from galaxy.planner.model_terms import ModelTerms

ANSWER_BROADCASTS = 2           # broadcast_object_list: the pickled size, then the bytes


class EncoderLatencyCostModel(LatencyCostModel):
    """estimate(plan): one classification request's forward and every rank's memory (module
    docstring); prefill_s is the whole request, decode_s_per_token 0, no cache."""

    def __init__(self, model: dict, devices: list[dict], link: dict | None):
        ModelTerms.__init__(self, model, devices, link, batch_size=1)
        hf = with_shape_keys(dict(model["hf_config"]), "the model profile")
        self.heads = hf["num_attention_heads"]
        self.kv_heads = hf.get("num_key_value_heads") or self.heads
        self.head_dim = hf.get("head_dim") or self.hidden // self.heads
        self.prompt, self.new = self.seq, 0

    def prefill_tokens(self, plan: Plan) -> int:
        """predict.py pads every input to pad_size, whatever the plan."""
        return self.seq

    def estimate(self, plan: Plan) -> LatencyEstimate:
        world = plan.world
        one = _Pass([0.0] * world, [0.0] * world, [0.0] * world, [dict() for _ in range(world)])
        for p in range(plan.pp):
            self._prefill_stage(plan, p, one)
        self._answer(plan, one)
        return LatencyEstimate(plan, one.seconds, self.estimate_memory(plan), [int(x) for x in one.sent],
                               one.compute, max(one.comm), one.comm, one.sub, prefill_s=one.seconds,
                               decode_s_per_token=0.0, cache_mib=[0.0] * world)

    def _prefill_head(self, plan: Plan, out: _Pass, ranks: list[int]) -> None:
        """The [CLS] token's exit (CON SP: an all-gather of one [1, h] token per rank), then the
        pooler and the classifier on the stage's first rank (the table's forward "head")."""
        if plan.group > 1 and plan.con == "SP":
            self._communicate_even(out, ranks, "all_gather", self.hidden)
        self._charge(out, ranks[:1], "HEAD", [self.compute[ranks[0]]("head", self.seq, 1)[0]])

    def _communicate_even(self, out: _Pass, ranks: list[int], kind: str, numel: int) -> None:
        """One collective of `numel` elements per rank, equal on every rank."""
        seconds, sent = self._call_time(kind, len(ranks), numel, False, ranks)
        for r in ranks:
            out.comm[r] += seconds
            out.sent[r] += sent
        out.seconds += seconds

    def _answer(self, plan: Plan, out: _Pass) -> None:
        """With a pipeline, the logits from the last stage to the first: two small broadcasts over
        the pipeline group (its measured "broadcast", else a one-call all-gather of 16 bytes)."""
        if plan.pp == 1:
            return
        one = token_call_time(self.link, "broadcast", plan.pp, TOKEN_MESSAGE_BYTES)
        if one is None:
            one = link_time(self.link, "all_gather", plan.pp, TOKEN_MESSAGE_BYTES * (plan.pp - 1), 1)
        t = ANSWER_BROADCASTS * one
        out.seconds += t
        for r in range(plan.world):
            out.comm[r] += t

    def cache_bytes(self, plan: Plan, p: int, j: int) -> int:
        return 0

