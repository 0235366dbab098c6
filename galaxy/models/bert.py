"""BERT for sequence classification: the one definition every plan is applied to.

A layer is ATT -> CON1 -> MLP -> CON2 (post-norm), CON = LayerNorm(dropout(x + bias) + residual),
built of the shared sub-blocks (galaxy.layers) under BERT's names. Plain PyTorch: the model says
where the sub-block boundaries are (Transitions, identities in serial training); a plan
(galaxy.parallel.plan) decides how each sub-block splits.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from galaxy.distributed.comm_bytes import plan_comm_bytes, sum_param_units
from galaxy.distributed.transitions import Layout, Transition
from galaxy.layers.activation import activation
from galaxy.layers.block import TransformerBlock
from galaxy.layers.connector import Connector
from galaxy.layers.mlp import FeedForward
from galaxy.layers.self_attention import SelfAttention
from galaxy.models.family import GalaxyModel


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


def bert_layer(cfg) -> TransformerBlock:
    """ATT (biased query / key / value, padding mask, attention dropout; out's bias deferred),
    CON1, MLP (up, activation, down), CON2: each CON = LayerNorm(dropout(x + bias) + residual)."""
    h = cfg.hidden_size
    att = SelfAttention(h, cfg.num_attention_heads, qkv=("query", "key", "value"), out="out",
                        dropout_p=cfg.attention_probs_dropout_prob)   # the [b, 1, 1, S] mask: no query rows
    con1 = Connector(nn.LayerNorm(h, eps=cfg.layer_norm_eps), cfg.hidden_dropout_prob, post_norm=True)
    mlp = FeedForward(h, cfg.intermediate_size, activation(cfg.hidden_act), names=("up", "down"))
    con2 = Connector(nn.LayerNorm(h, eps=cfg.layer_norm_eps), cfg.hidden_dropout_prob, post_norm=True)
    return TransformerBlock(att, con1, mlp, con2)


class BertForClassification(GalaxyModel):
    task, peft_task_type = "classification", "SEQ_CLS"
    loss_units_are_rows = True
    modules_to_save = output_heads = ("classifier",)
    classes_layer = "classifier"
    first_stage_modules = ("embeddings",)
    last_stage_modules = ("pooler", "classifier")
    carry_size = 1           # (hidden,): post-norm, the stream is the next input

    def __init__(self, cfg, num_labels: int):
        super().__init__()
        self.config = cfg
        self.num_labels = num_labels
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(bert_layer(cfg) for _ in range(cfg.num_hidden_layers))
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
        """Keyword arguments every layer needs, from the [b, S] padding mask (or None). A mask that
        keeps every position is dropped, as Hugging Face drops it: attention without a mask gives
        the same result, and scaled_dot_product_attention's CPU kernel ran 1.6x slower with one
        (all-MiniLM-L6-v2, one 512-token input: bench/classify_latency.py)."""
        if attention_mask is None or bool(attention_mask.all()):
            return {"mask": None}
        return {"mask": attention_mask.bool()[:, None, None, :]}

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


# -- closed forms: what the profiler should measure, from the shape and the plan alone --------
# (FLOPs: 2 per multiply-add, forward; the backward is twice that. Bytes: per rank and training
# step, in the ring convention of galaxy.distributed.comm_bytes.)

def bert_matmul_flops(*, batch: int, seq: int, hidden: int, layers: int, intermediate: int,
                      num_labels: int) -> dict[str, int]:
    """BERT for sequence classification (encoder, pooler on [CLS], classifier)."""
    bs = batch * seq
    per_layer = {
        "qkv": 3 * 2 * bs * hidden * hidden,
        "attention": 2 * 2 * batch * seq * seq * hidden,      # Q K^T and P V over all heads
        "out": 2 * bs * hidden * hidden,
        "mlp": 2 * 2 * bs * hidden * intermediate,
    }
    parts = {k: layers * v for k, v in per_layer.items()}
    parts["pooler"] = 2 * batch * hidden * hidden
    parts["classifier"] = 2 * batch * hidden * num_labels
    parts["total"] = sum(parts.values())
    return parts


def bert_sum_param_units(plan, *, hidden: int, layers: int, intermediate: int, group_size: int) -> list[int]:
    """Elements of BERT's gradients summed over the group, per layer (GradientSync's units, in
    backward order; galaxy.distributed.buckets groups them into all-reduces).

    Per layer: CON SP: two LayerNorms (2 x 2H) and the two deferred output biases (2H);
    ATT SP: Q, K, V weights and biases, the output weight; MLP SP: up weight and bias, down weight.
    """
    h, i = hidden, intermediate
    return sum_param_units(plan, layers=layers, group_size=group_size, con=6 * h, att=4 * h * h + 3 * h,
                           mlp=2 * h * i + i)


def bert_plan_comm_bytes(plan, *, seq_shares, batch: int, hidden: int, layers: int, intermediate: int,
                         comm_chunks: int = 1, element_size: int = 4) -> dict:
    """Collectives one rank issues in one training step (plan_comm_bytes): SP attention gathers
    K and V [b, s, 2H]; the exit gathers one token per rank (the [CLS] candidate)."""
    n = len(seq_shares)
    return plan_comm_bytes(plan, seq_shares=seq_shares, batch=batch, hidden=hidden, layers=layers,
                           kv_features=2 * hidden, exit_tokens=1,
                           sum_param_units=bert_sum_param_units(plan, hidden=hidden, layers=layers,
                                                                intermediate=intermediate, group_size=n),
                           comm_chunks=comm_chunks, element_size=element_size)


# The spec's entries (galaxy.models.registry): the Hugging Face config in, the forms above out.

def flops_of(cfg, batch: int, seq: int, num_labels: int) -> dict[str, int]:
    return bert_matmul_flops(batch=batch, seq=seq, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers,
                             intermediate=cfg.intermediate_size, num_labels=num_labels)


def comm_of(plan, cfg, batch: int, seq_shares, comm_chunks: int = 1) -> dict:
    return bert_plan_comm_bytes(plan, seq_shares=seq_shares, batch=batch, hidden=cfg.hidden_size,
                                layers=cfg.num_hidden_layers, intermediate=cfg.intermediate_size,
                                comm_chunks=comm_chunks)
