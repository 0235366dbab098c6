"""The causal-LM head the decoder families share (Llama, GPT-2): masks, LM head, shifted loss,
and the closed forms of a decoder (its FLOPs, its head's collectives).

A decoder family's model inherits `CausalLMHead` next to GalaxyModel. The head runs on the CON
layout: under a sequence-sharded CON each rank scores its own tokens with the (replicated) LM
head weight, so no activation is gathered at the exit; the weight's gradient and the loss are
summed over the group instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from galaxy.distributed.comm_bytes import plan_comm_bytes
from galaxy.distributed.transitions import Layout, copy_for_sharded_consumer, reduce_to_replicated
from galaxy.layers.attention import CAUSAL
from galaxy.layers.token_loss import summed_token_cross_entropy

IGNORE_INDEX = -100


class CausalLMHead:
    """Mixin for a GalaxyModel with `self.lm_head` (nn.Linear [vocab, hidden], possibly tied to
    the input embeddings) and a carry (residual stream, normalised input of the next block).

    An encoder-decoder's LM head (galaxy.models.seq2seq) is this one on the decoder's output,
    with labels aligned to the positions (label_shift 0) instead of shifted inside the model."""

    task, peft_task_type = "causal_lm", "CAUSAL_LM"
    output_heads = ("lm_head",)     # applied through its weight (tied, sharded loss): no LoRA
    last_stage_modules = ("lm_head",)
    carry_size = 2           # (residual stream, normalised input of the next sub-block)
    label_shift = 1          # position t predicts label t + label_shift

    def plan_head(self, con_layout, group) -> dict:
        """The LM head and loss run on the CON layout: under S each rank scores its own tokens."""
        self.head_group = group if con_layout == Layout.S and group.size > 1 else None
        return {}     # the head weight's gradient is all-reduced in backward (see head)

    def head_input(self, carry: tuple):
        """The final hidden states [b, s_con, h] the LM head reads."""
        _, x, *side = carry
        return self.side_out(x, side[0]) if side else x

    def lm_logits(self, x, weight):
        """x [b, s_con, h] -> logits [b, s_con, vocab] with the LM head's (possibly copied) weight."""
        return F.linear(x, weight)

    def vocab_slice_logits(self, x, rows: slice):
        """x [b, s, h] -> the logits of the vocabulary `rows` [b, s, rows] (a decode step's head
        split by rows, galaxy.inference.split_head). A family whose lm_logits adds more than the
        product (BART's final_logits_bias) overrides this."""
        return self.lm_logits(x, self.lm_head.weight[rows])

    def head(self, carry: tuple, labels=None):
        x = self.head_input(carry)
        weight, rows = self.lm_head.weight, slice(None)
        if self.head_group is not None:
            # Each rank scores its own tokens: the replicated head weight gets partial gradients.
            g = self.head_group
            weight = copy_for_sharded_consumer(weight, g)
            rows = slice(g.token_offset, g.token_offset + g.tokens[g.rank])
        logits = self.lm_logits(x, weight)                               # [b, s_con, vocab]
        if labels is None:
            return logits, None
        # Causal LM: shift inside the model, as HF does (position t predicts token t + 1).
        shift = self.label_shift
        targets = F.pad(labels, (0, shift), value=IGNORE_INDEX)[:, shift:]     # [b, S]
        count = (targets != IGNORE_INDEX).sum().clamp_min(1)
        # F.cross_entropy's numbers with a third of its vocabulary-sized tensors (token_loss)
        local = summed_token_cross_entropy(logits.float().flatten(0, 1), targets[:, rows].flatten(),
                                           IGNORE_INDEX) / count
        loss = reduce_to_replicated(local, self.head_group) if self.head_group is not None else local
        return logits, loss

    def loss_units(self, labels) -> torch.Tensor:
        """How many terms `head`'s loss averages over: the label tokens (after the shift)."""
        return (labels[:, self.label_shift:] != IGNORE_INDEX).sum()

    def forward(self, input_ids, attention_mask=None, labels=None):
        # input_ids, attention_mask, labels: [b, S] on every rank; labels use IGNORE_INDEX
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return super().forward(input_ids, attention_mask, labels=labels)


def causal_context(keep) -> dict:
    """A causal decoder's layer-context masks from keep [b, S] bool (True = real token): the
    causal + padding mask, and where no token is padding the CAUSAL flag, under which a whole-
    sequence attention lets its kernel apply the causal mask (galaxy.layers.attention). The mask
    stays for what cuts or extends it: SP's rows, the KV cache's prefill, side networks."""
    plain = keep.shape[1] > 1 and bool(keep.all())
    return {"mask": causal_padding_mask(keep), **({CAUSAL: True} if plain else {})}


def causal_padding_mask(keep):
    """[b, S] bool (True = real token) -> [b, 1, S, S]: key k visible to query q if k <= q and real.

    A query that would see no key at all (a sample that is all padding) sees itself, so that
    attention stays finite; such rows carry no loss.
    """
    b, S = keep.shape
    if S == 1:                 # a decode step: the one query sees itself (the cache's keys come apart)
        return torch.ones(b, 1, 1, 1, dtype=torch.bool, device=keep.device)
    causal = torch.ones(S, S, dtype=torch.bool, device=keep.device).tril()
    mask = causal & keep[:, None, None, :]
    blind = ~mask.any(-1, keepdim=True)
    return mask | (blind & torch.eye(S, dtype=torch.bool, device=keep.device))


# -- closed forms every decoder family shares (its own file passes its shape) -----------------

def decoder_matmul_flops(*, batch: int, seq: int, hidden: int, layers: int, heads: int, kv_heads: int,
                         intermediate: int, vocab: int, head_dim: int | None = None,
                         mlp_matrices: int = 3) -> dict[str, int]:
    """Forward matmul FLOPs of a causal LM (2 per multiply-add): grouped-query attention, an MLP
    of `mlp_matrices` [H, I] products (3 for SwiGLU: gate, up, down; 2: up, down), the LM head on
    every position. Attention is dense: causal masking does not reduce the count (the report
    says so)."""
    d = head_dim or hidden // heads
    bs = batch * seq
    per_layer = {
        "q": 2 * bs * hidden * heads * d,
        "kv": 2 * 2 * bs * hidden * kv_heads * d,
        "attention": 2 * 2 * batch * heads * seq * seq * d,   # query heads: K/V are shared, not fewer products
        "o": 2 * bs * heads * d * hidden,
        "mlp": mlp_matrices * 2 * bs * hidden * intermediate,
    }
    parts = {k: layers * v for k, v in per_layer.items()}
    parts["lm_head"] = 2 * bs * hidden * vocab
    parts["total"] = sum(parts.values())
    return parts


def causal_lm_comm_bytes(plan, *, seq_shares, batch: int, hidden: int, layers: int, kv_features: int, vocab: int,
                         sum_param_units, comm_chunks: int = 1, element_size: int = 4) -> dict:
    """Collectives one rank of a causal LM issues in one training step (plan_comm_bytes). The head
    runs on the CON layout (CausalLMHead): nothing is gathered at the exit; under CON SP the LM
    head weight's gradient [vocab, H] (tied or not: the head's contribution is what is summed)
    is all-reduced in backward and the loss, a scalar, in forward."""
    return plan_comm_bytes(plan, seq_shares=seq_shares, batch=batch, hidden=hidden, layers=layers,
                           kv_features=kv_features, exit_tokens=None, head_all_reduces=(vocab * hidden, 1),
                           sum_param_units=sum_param_units, comm_chunks=comm_chunks, element_size=element_size)
