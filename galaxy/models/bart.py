"""BART (Hugging Face BartForConditionalGeneration, BartForSequenceClassification): the one
definition every plan is applied to (one backbone, BartModel; two heads).

Post-norm layers, as BERT's (CON = LayerNorm(dropout(x + bias) + residual)):
  encoder layer   ATT (self_attn, padding mask) -> CON1 (self_attn_layer_norm)
                  -> MLP (fc1, activation, activation_dropout, fc2) -> CON2 (final_layer_norm)
  decoder layer   ATT (self_attn, causal) -> CON1 (self_attn_layer_norm)
                  -> XATT (encoder_attn: queries from the decoder, K/V from the encoder's output)
                  -> CONX (encoder_attn_layer_norm) -> MLP -> CON2 (final_layer_norm)
Embeddings: the shared token table (scaled by sqrt(d_model) under scale_embedding) plus learned
positions with BART's offset 2 (position p reads row p + 2), then layernorm_embedding and
dropout, one set per stack. The LM head is tied to the shared table; final_logits_bias (a buffer
in Hugging Face, so never trained) is added to the logits. The classifier reads the decoder's
output at each row's last EOS (galaxy.models.seq2seq_classifier).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from galaxy.layers.activation import activation
from galaxy.layers.block import TransformerBlock
from galaxy.layers.connector import Connector
from galaxy.layers.cross_attention import CrossAttention
from galaxy.layers.decoder_block import DecoderBlock
from galaxy.layers.mlp import FeedForward
from galaxy.layers.self_attention import SelfAttention
from galaxy.models.encdec_forms import EncDecShape, comm_entry, flops_entry
from galaxy.models.family import checked_config
from galaxy.models.seq2seq import EncoderDecoder, Seq2SeqLMHead, stack_names
from galaxy.models.seq2seq_classifier import ClassificationHead, Seq2SeqClassifierHead, classifier_dropout
from galaxy.models.weights import NameMap

POSITION_OFFSET = 2      # BartLearnedPositionalEmbedding: position p is row p + 2


def unsupported(cfg) -> str | None:
    """What of BartConfig this definition does not compute, or None."""
    if cfg.encoder_attention_heads != cfg.decoder_attention_heads:
        return (f"encoder_attention_heads {cfg.encoder_attention_heads} and decoder_attention_heads "
                f"{cfg.decoder_attention_heads} differ; galaxy splits one head count "
                "(the plan's heads) over both stacks")
    if cfg.encoder_ffn_dim != cfg.decoder_ffn_dim:
        return (f"encoder_ffn_dim {cfg.encoder_ffn_dim} and decoder_ffn_dim {cfg.decoder_ffn_dim} differ; galaxy "
                f"splits one MLP width (the plan's columns) over both stacks")
    if cfg.encoder_layerdrop or cfg.decoder_layerdrop:
        return "encoder_layerdrop / decoder_layerdrop (skipping layers at random) is not supported"
    for name in ("decoder_start_token_id", "pad_token_id"):
        if getattr(cfg, name, None) is None:
            return (f"config.json has {name} null; BART starts the decoder with decoder_start_token_id (its "
                    f"</s>, 2) and pads with pad_token_id (1): set {name} to the tokenizer's id")
    return None


def random_shape(shape: dict, tokenizer) -> dict:
    """A random BART's config keys from the shape keys: galaxy splits one head count and one MLP
    width over both stacks, so the decoder's follow the encoder's unless given."""
    mirrored = {f"decoder_{k}": shape[f"encoder_{k}"] for k in ("attention_heads", "ffn_dim")
                if f"encoder_{k}" in shape}
    return {**mirrored, **shape}


def _attention(cfg, kind=SelfAttention, **kwargs):
    return kind(cfg.d_model, cfg.encoder_attention_heads, qkv=("q_proj", "k_proj", "v_proj"), out="out_proj",
                dropout_p=cfg.attention_dropout, **kwargs)


def _con(cfg) -> Connector:
    return Connector(nn.LayerNorm(cfg.d_model), cfg.dropout, post_norm=True)


def _mlp(cfg) -> FeedForward:
    return FeedForward(cfg.d_model, cfg.encoder_ffn_dim, activation(cfg.activation_function), names=("fc1", "fc2"),
                       dropout_p=cfg.activation_dropout)


def bart_encoder_layer(cfg) -> TransformerBlock:
    return TransformerBlock(_attention(cfg), _con(cfg), _mlp(cfg), _con(cfg))   # [b, 1, 1, S] mask: no query rows


def bart_decoder_layer(cfg) -> DecoderBlock:
    return DecoderBlock(_attention(cfg, query_dims={"mask": 2}), _con(cfg), _attention(cfg, CrossAttention),
                        _con(cfg), _mlp(cfg), _con(cfg))


class BartModel(EncoderDecoder):
    """Both stacks and their embeddings: what BART's two heads share."""
    carry_size = 1           # post-norm: each stack's stream is its next input
    first_stage_modules = ("shared", "encoder_positions", "encoder_norm", "decoder_positions", "decoder_norm")

    def __init__(self, cfg):
        super().__init__(cfg)
        problem = unsupported(cfg)
        if problem:
            raise ValueError(problem)
        h = cfg.d_model
        self.embed_scale = math.sqrt(h) if cfg.scale_embedding else 1.0
        self.shared = nn.Embedding(cfg.vocab_size, h, padding_idx=cfg.pad_token_id)
        for stack in ("encoder", "decoder"):
            setattr(self, f"{stack}_positions", nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET, h))
            setattr(self, f"{stack}_norm", nn.LayerNorm(h))
        self.encoder_layers = cfg.encoder_layers
        self.layers = nn.ModuleList([bart_encoder_layer(cfg) for _ in range(cfg.encoder_layers)]
                                    + [bart_decoder_layer(cfg) for _ in range(cfg.decoder_layers)])

    def _embeddings(self, ids, stack: str, start: int = 0):
        # ids [b, S] at positions start.. -> [b, S, h], replicated: every rank draws the same dropout mask
        positions = torch.arange(start, start + ids.shape[1], device=ids.device) + POSITION_OFFSET
        h = self.shared(ids) * self.embed_scale + getattr(self, f"{stack}_positions")(positions)
        return F.dropout(getattr(self, f"{stack}_norm")(h), self.config.dropout, self.training)

    def source_embeddings(self, input_ids):
        return self._embeddings(input_ids, "encoder")

    def target_embeddings(self, decoder_input_ids, start: int = 0):
        """start: the first id's position (a decode step's, generating with a cache)."""
        return self._embeddings(decoder_input_ids, "decoder", start)


class BartForConditionalGeneration(Seq2SeqLMHead, BartModel):
    carry_size = BartModel.carry_size       # not the causal LMs' (CausalLMHead comes first)
    last_stage_modules = ("lm_head", "final_logits_bias")

    def __init__(self, cfg, **_):
        super().__init__(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.final_logits_bias = FinalLogitsBias(cfg.vocab_size)
        self.head_group = None
        self.materialize()

    def materialize(self) -> None:
        """(Re)make the tie lm_head.weight = shared.weight (a pipeline end may hold one of them)."""
        if self.config.tie_word_embeddings and hasattr(self, "shared") and hasattr(self, "lm_head"):
            self.lm_head.weight = self.shared.weight

    def lm_logits(self, x, weight):
        return F.linear(x, weight) + self.final_logits_bias.bias


class BartForSequenceClassification(Seq2SeqClassifierHead, BartModel):
    """Hugging Face's BartForSequenceClassification (galaxy.models.seq2seq_classifier)."""

    def __init__(self, cfg, num_labels: int, **_):
        super().__init__(cfg)
        self.num_labels = num_labels
        self.classification_head = ClassificationHead(cfg.d_model, num_labels, classifier_dropout(cfg))


class FinalLogitsBias(nn.Module):
    """BART's final_logits_bias [1, vocab]: a buffer in Hugging Face (read and exported with the
    weights, never trained), here a parameter that does not require a gradient."""

    def __init__(self, vocab: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(1, vocab), requires_grad=False)


def hf_names(cfg):
    """galaxy name -> BartForConditionalGeneration (or ...ForSequenceClassification) name (decoder
    layers: index - encoder_layers)."""
    encoder = NameMap({
        "shared.weight": "model.shared.weight",
        "{stack}_positions.weight": "model.{stack}.embed_positions.weight",
        "{stack}_norm.{w}": "model.{stack}.layernorm_embedding.{w}",
        "lm_head.weight": "lm_head.weight",
        "final_logits_bias.bias": "final_logits_bias",
        "classification_head.{rest}": "classification_head.{rest}",    # BartForSequenceClassification's
        "side_in.{rest}": "side.input.{rest}",       # side-tuning's ends (galaxy.peft.side_seq2seq)
        "side_out.{rest}": "side.output.{rest}",
        **_layer_names("encoder"),
    })
    decoder = NameMap({**_layer_names("decoder"),
                       "layers.{i}.xatt.{rest}": "model.decoder.layers.{i}.encoder_attn.{rest}",
                       "layers.{i}.conx.norm.{w}": "model.decoder.layers.{i}.encoder_attn_layer_norm.{w}",
                       "layers.{i}.conx.adapter.{w}": "model.decoder.layers.{i}.encoder_attn_adapter.{w}"})
    return stack_names(encoder, decoder, cfg.encoder_layers)


def _layer_names(stack: str) -> dict:
    layer = f"model.{stack}.layers.{{i}}"
    return {
        "layers.{i}.att.{rest}": f"{layer}.self_attn.{{rest}}",
        "layers.{i}.con1.norm.{w}": f"{layer}.self_attn_layer_norm.{{w}}",
        "layers.{i}.mlp.{rest}": f"{layer}.{{rest}}",
        "layers.{i}.con2.norm.{w}": f"{layer}.final_layer_norm.{{w}}",
        # Parameter-efficient fine-tuning (galaxy.peft): names of their own in the same style.
        "layers.{i}.con1.adapter.{w}": f"{layer}.self_attn_adapter.{{w}}",
        "layers.{i}.con2.adapter.{w}": f"{layer}.output_adapter.{{w}}",
        "layers.{i}.side.{rest}": f"side.{stack}.layer.{{i}}.{{rest}}",
    }


def config_shape(raw: dict) -> dict:
    """The sizes galaxy.config checks, under their standard names, from a BART config.json
    (BartConfig's defaults for keys it leaves out). Raises ValueError for what is unsupported."""
    from transformers import BartConfig
    cfg = checked_config(BartConfig, raw, unsupported)
    return {"hidden_size": cfg.d_model, "num_attention_heads": cfg.encoder_attention_heads,
            "intermediate_size": cfg.encoder_ffn_dim, "num_hidden_layers": cfg.encoder_layers + cfg.decoder_layers,
            "max_position_embeddings": cfg.max_position_embeddings, "is_encoder_decoder": True}


def encdec_shape(cfg) -> EncDecShape:
    """BART's shape for the closed forms (galaxy.models.encdec_forms). Summed gradients per layer:
    CON SP, each CON's LayerNorm (2h) and deferred output bias (h): 6h encoder, 9h decoder; an SP
    ATT or XATT, its q/k/v weights and biases and out_proj's weight, 4h^2 + 3h; an SP MLP, fc1's
    weight and bias and fc2's weight, 2hI + I. The embeddings' norms run replicated: not summed."""
    h, i = cfg.d_model, cfg.encoder_ffn_dim
    return EncDecShape(hidden=h, inner=h, heads=cfg.encoder_attention_heads, encoder_layers=cfg.encoder_layers,
                       decoder_layers=cfg.decoder_layers, intermediate=i, mlp_matrices=2, vocab=cfg.vocab_size,
                       sums={"con_encoder": 6 * h, "con_decoder": 9 * h, "att": 4 * h * h + 3 * h,
                             "mlp": 2 * h * i + i})


flops_of, comm_of = flops_entry(encdec_shape), comm_entry(encdec_shape)
