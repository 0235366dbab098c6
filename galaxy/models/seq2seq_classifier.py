"""The sequence-classification head of the encoder-decoders (Hugging Face's
BartForSequenceClassification and T5ForSequenceClassification).

Both read the same thing: the decoder runs over the source shifted right (the start token, then
input_ids[:, :-1]; no target padding, causal only), and each row is represented by the decoder's
final hidden state at the row's last EOS token of the source (input_ids == eos_token_id); then
dropout, dense, tanh, dropout, out_proj. The loss is the mean cross-entropy over the rows.

The decoder's stream is in the CON layout, split by the decoder's token shares under CON SP, so
the pooled token may live on any rank: galaxy.models.pooling gathers the b tokens with one
[b, h] all-reduce and the logits are whole on every rank (head_group stays None).

Which token: Hugging Face requires every row to hold the same number of EOS tokens and takes the
last; galaxy takes each row's rightmost EOS (the same token on the rows Hugging Face accepts), and
for a row without one the last token the attention mask keeps. The positions are taken from the
source ids (`head_inputs`) and recorded by `layer_context`; `head` of the same forward pass reads
them. A pipeline's last stage sees no source ids: the runner computes head_inputs from the batch
and hands them to that stage as a keyword tensor ([b], cut into micro-batches with the masks), and
torch's schedules run a micro-batch's loss right after its last-stage forward (as Llama's
classifier relies on).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from galaxy.distributed.transitions import Layout
from galaxy.models.pooling import pooled_tokens
from galaxy.models.seq2seq import EncoderDecoder


class ClassificationHead(nn.Module):
    """dropout -> dense [h, h] -> tanh -> dropout -> out_proj [num_labels, h], Hugging Face's names."""

    def __init__(self, hidden: int, num_labels: int, dropout: float):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(dropout)
        self.out_proj = nn.Linear(hidden, num_labels)

    def forward(self, x):
        # x [b, h] (replicated: every rank draws the same dropout masks) -> [b, num_labels]
        return self.out_proj(self.dropout(torch.tanh(self.dense(self.dropout(x)))))


def last_eos(input_ids, attention_mask, eos_id: int):
    """[b] position of each row's rightmost EOS; the last kept token of a row without one."""
    slots = torch.arange(input_ids.shape[1], device=input_ids.device)
    eos = input_ids == eos_id
    last_kept = (slots * attention_mask.bool()).argmax(-1)
    return torch.where(eos.any(-1), (slots * eos).argmax(-1), last_kept)


class Seq2SeqClassifierHead:
    """Mixin before a family's EncoderDecoder backbone, whose __init__ then sets
    `self.classification_head = ClassificationHead(...)`."""
    task, peft_task_type = "classification", "SEQ_CLS"
    pool_group = None         # the decoder's group under CON SP (plan_head)
    pooled_at = None          # [b] positions of the current forward pass
    loss_units_are_rows = True
    modules_to_save = output_heads = ("classification_head",)
    classes_layer = "classification_head.out_proj"
    last_stage_modules = ("classification_head",)

    def plan_head(self, con_layout, group) -> dict:
        decoder = self.plan_memory(con_layout, group)
        self.pool_group = decoder if con_layout == Layout.S and group.size > 1 else None
        return {}     # the head runs on the gathered [b, h]: its gradients are complete everywhere

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None, decoder_input_ids=None,
                decoder_attention_mask=None):
        # input_ids, attention_mask [b, S]; labels [b]; token_type_ids: taken as every family's
        # forward takes them (classification batches carry them), unused
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        self.pooled_at = self.head_inputs(input_ids, attention_mask)["pooled_at"]
        return EncoderDecoder.forward(self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask,
                                      labels)

    def head_inputs(self, input_ids, attention_mask) -> dict:
        """What `head` reads beyond the carry, from the source ids and mask [b, S]: {"pooled_at": [b]}."""
        return {"pooled_at": last_eos(input_ids, attention_mask, self.config.eos_token_id)}

    def layer_context(self, attention_mask, decoder_attention_mask=None, pooled_at=None, **rest) -> dict:
        """EncoderDecoder's; a pipeline's last stage also records its micro-batch's pooled_at [b]."""
        if pooled_at is not None:
            self.pooled_at = pooled_at
        return super().layer_context(attention_mask, decoder_attention_mask, **rest)

    def head(self, carry: tuple, labels=None):
        pooled = pooled_tokens(self.final_hidden(carry), self.pooled_at, self.pool_group)    # [b, h]
        logits = self.classification_head(pooled)                                            # [b, labels]
        loss = F.cross_entropy(logits.float(), labels) if labels is not None else None
        return logits, loss

    def loss_units(self, labels) -> torch.Tensor:
        """How many terms `head`'s loss averages over: one per row."""
        return torch.tensor(labels.shape[0], device=labels.device)


def classifier_dropout(cfg) -> float:
    """The head's dropout: the config's classifier_dropout (BART's, T5's; 0.0 by default)."""
    return getattr(cfg, "classifier_dropout", None) or 0.0
