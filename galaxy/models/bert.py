"""BERT for sequence classification: the one definition every plan is applied to.

A layer is ATT -> CON1 -> MLP -> CON2 (post-norm), CON = LayerNorm(dropout(x + bias) + residual).
Plain PyTorch: the model knows where the sub-block boundaries are (Transitions, identities in
serial training) and how each sub-block splits itself (`shard_tp`, `gather_kv`); a plan
(galaxy.parallel.plan) decides which splits happen.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from galaxy.distributed.transitions import Layout, Transition
from galaxy.layers.attention import attention, attention_while_gathering, split_heads
from galaxy.layers.block import TransformerBlock
from galaxy.layers.linear import OutputProjection
from galaxy.models.family import GalaxyModel
from galaxy.layers.sharding import shard_column_parallel, shard_row_parallel


class BertEmbeddings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids):
        # input_ids, token_type_ids: [b, s] -> [b, s, h], replicated on every rank
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(positions)
        return self.dropout(self.LayerNorm(x))


class BertAttention(nn.Module):
    """ATT: Q/K/V projections, scaled dot-product attention, output projection (bias deferred)."""

    deferred_bias = "out.bias"     # added by CON, after the output's layout transition

    def __init__(self, cfg):
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = h // cfg.num_attention_heads
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.out = OutputProjection(h, h)
        self.dropout_p = cfg.attention_probs_dropout_prob
        self.kv_gather = None          # SP: gathers K/V of every rank's tokens
        self.kv_blocks = False         # SP: attend to the own keys while the gather travels (kv_blocks)
        self.local_rows = None         # SP: own query rows (unused: BERT's mask broadcasts over rows)
        self.rng_scope = nullcontext   # TP/SP: dropout draws from the rank's own stream

    def shard_tp(self, shares: tuple[int, ...], rank: int) -> dict:
        """Keep this rank's heads. Returns {param: (dim, per-rank sizes)} for gathering."""
        d, start, count = self.head_dim, sum(shares[:rank]), shares[rank]
        for proj in (self.query, self.key, self.value):
            shard_column_parallel(proj, start * d, count * d)
        shard_row_parallel(self.out, start * d, count * d)
        self.num_heads = count
        sizes = tuple(n * d for n in shares)
        column = {f"{p}.{w}": (0, sizes) for p in ("query", "key", "value") for w in ("weight", "bias")}
        return {**column, "out.weight": (1, sizes)}

    # The block protocol's three token-wise / whole-sequence pieces (galaxy.layers.block): a TP
    # ATT whose transitions travel in chunks runs project per chunk, attend once, finish per chunk.

    def project(self, x):
        """Token-wise: x [b, s, h] -> (q, k, v), each [b, s, heads*d]."""
        return self.query(x), self.key(x), self.value(x)

    def attend(self, q, k, v, mask):
        """q [b, s, heads*d] against k, v [b, S, heads*d] -> context [b, s, heads*d]."""
        q, k, v = (split_heads(t, self.head_dim) for t in (q, k, v))
        return attention(q, k, v, mask, dropout_p=self.dropout_p if self.training else 0.0, rng_scope=self.rng_scope)

    def finish(self, ctx):
        """Token-wise: context -> (output projection without its bias, the deferred bias)."""
        return self.out(ctx), self.out.bias

    def forward(self, x, mask):
        # x: [b, s, h] (s = local tokens under SP); mask: [b, 1, 1, S] bool, True = attend
        if self.kv_gather is None:
            return self.finish(self.attend(*self.project(x), mask))
        k, v = (split_heads(proj(x), self.head_dim) for proj in (self.key, self.value))   # [b, s, heads, d]
        ctx = attention_while_gathering(lambda: split_heads(self.query(x), self.head_dim), k, v, self.kv_gather,
                                        mask, dropout_p=self.dropout_p if self.training else 0.0,
                                        rng_scope=self.rng_scope, blocks=self.kv_blocks)
        return self.finish(ctx)


class BertMLP(nn.Module):
    """MLP: up projection, activation, down projection (bias deferred)."""

    deferred_bias = "down.bias"

    def __init__(self, cfg):
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down = OutputProjection(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACT2FN[cfg.hidden_act]

    def shard_tp(self, shares: tuple[int, ...], rank: int) -> dict:
        start, count = sum(shares[:rank]), shares[rank]
        shard_column_parallel(self.up, start, count)
        shard_row_parallel(self.down, start, count)
        return {"up.weight": (0, shares), "up.bias": (0, shares), "down.weight": (1, shares)}

    def forward(self, x):
        return self.down(self.act(self.up(x))), self.down.bias


class BertConnector(nn.Module):
    """CON: LayerNorm(dropout(x + bias) + residual). Post-norm: stream and next input coincide."""

    def __init__(self, cfg):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout_p = cfg.hidden_dropout_prob
        self.rng_scope = nullcontext   # SP: each rank draws for its own tokens
        self.adapter = None            # a bottleneck adapter (galaxy.peft.adapter), when one is applied

    def forward(self, x, bias, residual):
        if bias is not None:
            x = x + bias
        if self.training and self.dropout_p > 0:
            with self.rng_scope():
                x = F.dropout(x, self.dropout_p, True)
        if self.adapter is not None:
            x = self.adapter(x)        # x + up(act(down(x))): the adapter's own skip connection
        y = self.norm(x + residual)
        return y, y


class BertForClassification(GalaxyModel):
    task, peft_task_type = "classification", "SEQ_CLS"
    loss_units_are_rows = True
    modules_to_save = output_heads = ("classifier",)
    first_stage_modules = ("embeddings",)
    last_stage_modules = ("pooler", "classifier")
    carry_size = 1           # (hidden,): post-norm, the stream is the next input

    def __init__(self, cfg, num_labels: int):
        super().__init__()
        self.config = cfg
        self.num_labels = num_labels
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(
            TransformerBlock(BertAttention(cfg), BertConnector(cfg), BertMLP(cfg), BertConnector(cfg))
            for _ in range(cfg.num_hidden_layers))
        self.enter = Transition()       # embeddings (R) -> CON layout
        self.exit = Transition()        # CON layout -> R, for the [CLS] token only
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        p = cfg.classifier_dropout if getattr(cfg, "classifier_dropout", None) is not None else cfg.hidden_dropout_prob
        self.dropout = nn.Dropout(p)
        self.classifier = nn.Linear(cfg.hidden_size, num_labels)

    def plan_head(self, con_layout, group) -> dict:
        """Only the first token leaves the encoder: gather one token per rank (S -> R)."""
        self.exit.set(con_layout, Layout.R, sharded_consumer=False, group=replace(group, tokens=(1,) * group.size))
        return {}     # pooler and classifier run replicated: their gradients are complete

    def embed(self, input_ids, token_type_ids=None) -> tuple:
        # input_ids, token_type_ids: [b, S] (full sequence on every rank) -> ([b, s_con, h],)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        with self.backbone_grad():
            h = self.enter(self.embeddings(input_ids, token_type_ids))
        return (h,) if self.side_in is None else (h, self.side_in(h))

    def layer_context(self, attention_mask) -> dict:
        """Keyword arguments every layer needs, from the [b, S] padding mask (or None)."""
        return {"mask": None if attention_mask is None else attention_mask.bool()[:, None, None, :]}

    def head(self, carry: tuple, labels=None):
        h, *side = carry
        if side:
            h = self.side_out(h, side[0])
        # Under SP each rank's first local token is gathered; rank 0's is the global [CLS].
        cls = self.exit(h[:, :1])[:, 0]                                 # [b, h]
        pooled = torch.tanh(self.pooler(cls))
        logits = self.classifier(self.dropout(pooled))                  # [b, num_labels]
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return logits, loss

    def loss_units(self, labels) -> torch.Tensor:
        """How many terms `head`'s loss averages over: one per example."""
        return torch.tensor(labels.shape[0], device=labels.device)



# galaxy name pattern -> Hugging Face BertForSequenceClassification name ({i} = layer index)
HF_NAMES = {
    "embeddings.{rest}": "bert.embeddings.{rest}",
    "layers.{i}.att.query.{w}": "bert.encoder.layer.{i}.attention.self.query.{w}",
    "layers.{i}.att.key.{w}": "bert.encoder.layer.{i}.attention.self.key.{w}",
    "layers.{i}.att.value.{w}": "bert.encoder.layer.{i}.attention.self.value.{w}",
    "layers.{i}.att.out.{w}": "bert.encoder.layer.{i}.attention.output.dense.{w}",
    "layers.{i}.con1.norm.{w}": "bert.encoder.layer.{i}.attention.output.LayerNorm.{w}",
    "layers.{i}.mlp.up.{w}": "bert.encoder.layer.{i}.intermediate.dense.{w}",
    "layers.{i}.mlp.down.{w}": "bert.encoder.layer.{i}.output.dense.{w}",
    "layers.{i}.con2.norm.{w}": "bert.encoder.layer.{i}.output.LayerNorm.{w}",
    "pooler.{w}": "bert.pooler.dense.{w}",
    "classifier.{w}": "classifier.{w}",
    # Parameter-efficient fine-tuning (galaxy.peft): LoRA's lora_A / lora_B sit inside the
    # projections above; adapters and the side network have no Hugging Face module, so they get
    # names of their own in the same style.
    "layers.{i}.con1.adapter.{w}": "bert.encoder.layer.{i}.attention.output.adapter.{w}",
    "layers.{i}.con2.adapter.{w}": "bert.encoder.layer.{i}.output.adapter.{w}",
    "layers.{i}.side.{rest}": "side.layer.{i}.{rest}",
    "side_in.{rest}": "side.input.{rest}",
    "side_out.{rest}": "side.output.{rest}",
}
# Checkpoints of a bare BertModel (e.g. all-MiniLM-L6-v2) have no "bert." prefix.
HF_BASE_PREFIX = "bert."
HF_HEAD_PARAMS = ("classifier.weight", "classifier.bias")
