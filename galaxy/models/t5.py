"""T5 (Hugging Face T5ForConditionalGeneration, v1.0 and v1.1 / flan; T5ForSequenceClassification):
the one definition every plan is applied to (one backbone, T5Model; two heads).

Pre-norm layers, shifted as Llama's are (galaxy.models.llama): each CON adds its sub-block's
output (dropout_rate on it) to the stream and normalises the stream for the next sub-block.
  encoder layer   ATT (q, k, v, o without biases, no score scaling, the stack's relative
                  position bias) -> CON1 (the FF layer's norm) -> MLP (wi, activation, wo; v1.1:
                  gated wi_0 / wi_1) -> CON2 (the next block's first norm, final_layer_norm after
                  the last)
  decoder layer   ATT (causal, the decoder's position bias) -> CON1 (the cross-attention's norm)
                  -> XATT (EncDecAttention) -> CONX (the FF layer's norm) -> MLP -> CON2
Norms are RMS norms with a weight and no bias (T5LayerNorm). Each stack's first norm runs before
its first layer (`encoder_first_norm`, `decoder_first_norm`, on the CON layout). The relative
position bias is one table per stack (galaxy.layers.position_bias), split by heads like the
heads it biases; the layer context adds it to the padding or causal mask, one additive mask per
stack. Embeddings: the shared table, no positions, dropout. After the decoder's final norm:
dropout, then (v1.0, scale_decoder_outputs) a scale of d_model^-0.5, then the LM head (tied to
the shared table unless the checkpoint holds its own); or the classifier, unscaled, at each
row's last EOS (galaxy.models.seq2seq_classifier).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from galaxy.layers.activation import activation
from galaxy.layers.block import TransformerBlock
from galaxy.layers.connector import Connector
from galaxy.layers.cross_attention import CrossAttention
from galaxy.layers.decoder_block import DecoderBlock
from galaxy.layers.mlp import FeedForward
from galaxy.layers.position_bias import RelativePositionBias
from galaxy.layers.rng import Dropout
from galaxy.layers.self_attention import SelfAttention
from galaxy.models.encdec_forms import EncDecShape, comm_entry, flops_entry
from galaxy.models.family import checked_config
from galaxy.layers.rms_norm import RMSNorm
from galaxy.models.seq2seq import EncoderDecoder, Seq2SeqLMHead, stack_names
from galaxy.models.seq2seq_classifier import ClassificationHead, Seq2SeqClassifierHead, classifier_dropout
from galaxy.models.weights import NameMap, pre_norm_names

# The additive mask's value for a hidden key: finite (a bf16 score stays finite) and far below any score.
HIDDEN = torch.finfo(torch.bfloat16).min


def _attention(cfg, kind=SelfAttention, **kwargs):
    return kind(cfg.d_model, cfg.num_heads, head_dim=cfg.d_kv, qkv=("q", "k", "v"), out="o", qkv_bias=False,
                out_bias=False, dropout_p=cfg.dropout_rate, scale=1.0, **kwargs)


def _con(cfg) -> Connector:
    return Connector(RMSNorm(cfg.d_model, cfg.layer_norm_epsilon), cfg.dropout_rate)


def _mlp(cfg) -> FeedForward:
    names = ("wi_0", "wi_1", "wo") if cfg.is_gated_act else ("wi", "wo")
    return FeedForward(cfg.d_model, cfg.d_ff, activation(cfg.dense_act_fn), names=names, bias=False,
                       dropout_p=cfg.dropout_rate)


def t5_encoder_layer(cfg) -> TransformerBlock:
    # the mask is [b, heads, S, S] (bias + padding): query rows on dim 2
    return TransformerBlock(_attention(cfg, query_dims={"mask": 2}), _con(cfg), _mlp(cfg), _con(cfg))


def t5_decoder_layer(cfg) -> DecoderBlock:
    return DecoderBlock(_attention(cfg, query_dims={"mask": 2}), _con(cfg), _attention(cfg, CrossAttention),
                        _con(cfg), _mlp(cfg), _con(cfg))


class T5Model(EncoderDecoder):
    """Both stacks, their first norms and position biases: what T5's two heads share."""
    carry_size = 2           # (stream, normalised input of the next sub-block), per stack
    con_params = ("encoder_first_norm", "decoder_first_norm", "decoder_output")
    att_params = ("encoder_bias", "decoder_bias")      # split by heads like ATT
    stack_modules = {"source": ("encoder_bias",), "target": ("decoder_bias",)}   # kept where their stack is
    first_stage_modules = ("shared", "encoder_first_norm", "decoder_first_norm")

    def __init__(self, cfg):
        super().__init__(cfg)
        problem = unsupported(cfg)
        if problem:
            raise ValueError(problem)
        h, p = cfg.d_model, cfg.dropout_rate
        self.shared = nn.Embedding(cfg.vocab_size, h)
        self.encoder_first_norm = RMSNorm(h, cfg.layer_norm_epsilon)
        self.decoder_first_norm = RMSNorm(h, cfg.layer_norm_epsilon)
        for stack, both_ways in (("encoder", True), ("decoder", False)):
            setattr(self, f"{stack}_bias", RelativePositionBias(cfg.relative_attention_num_buckets, cfg.num_heads,
                                                                cfg.relative_attention_max_distance, both_ways))
        self.encoder_layers = cfg.num_layers
        self.layers = nn.ModuleList([t5_encoder_layer(cfg) for _ in range(cfg.num_layers)]
                                    + [t5_decoder_layer(cfg) for _ in range(cfg.num_decoder_layers)])
        self.encoder_output = nn.Dropout(p)     # on the gathered memory: replicated, the default stream
        self.decoder_output = Dropout(p)        # on the CON layout: the rank's own stream under CON SP

    def source_embeddings(self, input_ids):
        return F.dropout(self.shared(input_ids), self.config.dropout_rate, self.training)

    def target_embeddings(self, decoder_input_ids, start: int = 0):
        return self.source_embeddings(decoder_input_ids)       # positions enter as the attention's bias

    def start_stack(self, h, which: str) -> tuple:
        norm = self.encoder_first_norm if which == "source" else self.decoder_first_norm
        return h, norm(h)

    def source_mask(self, keys):
        # keys [b, 1, 1, S] -> [b, heads, S, S]: the encoder's bias, hidden keys at HIDDEN
        bias = self.encoder_bias(keys.shape[-1], keys.shape[-1])
        return bias.masked_fill(~keys, HIDDEN)

    def target_mask(self, keep):
        mask = super().target_mask(keep)                                   # [b, 1, T, T] causal, padding
        return self.decoder_bias(mask.shape[-1], mask.shape[-1]).masked_fill(~mask, HIDDEN)

    def decoder_key_bias(self, position: int):
        # the decoder's bias of keys 0..position for the query at position, as Hugging Face's
        # cached decoder computes it: [1, heads (the rank's under TP), 1, position + 1]
        return self.decoder_bias(1, position + 1, query_start=position)

    def final_hidden(self, carry: tuple):
        return self.decoder_output(super().final_hidden(carry))


class T5ForConditionalGeneration(Seq2SeqLMHead, T5Model):
    last_stage_modules = ("lm_head",)

    def __init__(self, cfg, **_):
        super().__init__(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head_group = None
        self.materialize()

    def materialize(self) -> None:
        """(Re)make the tie lm_head.weight = shared.weight (a pipeline end may hold one of them)."""
        if self.config.tie_word_embeddings and hasattr(self, "shared") and hasattr(self, "lm_head"):
            self.lm_head.weight = self.shared.weight

    def lm_logits(self, x, weight):
        if self.config.scale_decoder_outputs:      # v1.0: the tied head reads the scaled output
            x = x * self.config.d_model ** -0.5
        return F.linear(x, weight)


class T5ForSequenceClassification(Seq2SeqClassifierHead, T5Model):
    """Hugging Face's T5ForSequenceClassification (galaxy.models.seq2seq_classifier): the head
    reads the decoder's output after its final norm and dropout, unscaled."""

    def __init__(self, cfg, num_labels: int, **_):
        super().__init__(_as_architecture(cfg, CLASSIFIER))
        self.num_labels = num_labels
        self.classification_head = ClassificationHead(cfg.d_model, num_labels, classifier_dropout(cfg))


# Hugging Face's T5ForSequenceClassification holds the T5Model under "transformer."; the
# ForConditionalGeneration holds it at the top. The name map tells them apart by the config's
# architectures, which the galaxy classifier states for itself (its checkpoint may be a
# ForConditionalGeneration: the family's hf_base_prefix then reads the names without the prefix).
CLASSIFIER = "T5ForSequenceClassification"
CLASSIFIER_PREFIX = "transformer."


def _as_architecture(cfg, name: str):
    cfg = copy.copy(cfg)
    cfg.architectures = [name]
    return cfg


def hf_names(cfg):
    """galaxy name -> T5ForConditionalGeneration name (T5ForSequenceClassification's under a
    classifier's config: "transformer." before the backbone's). CON2 of layer i holds block i+1's
    first norm (the stack's final_layer_norm after its last layer); decoder layers: index - num_layers."""
    def stack(name: str, layers: int, sublayers: dict) -> object:
        block = f"{name}.block.{{i}}.layer"
        table = NameMap({
            "shared.weight": "shared.weight",
            "lm_head.weight": "lm_head.weight",
            "classification_head.{rest}": "classification_head.{rest}",    # T5ForSequenceClassification's
            f"{name}_first_norm.weight": f"{name}.block.0.layer.0.layer_norm.weight",
            f"{name}_bias.relative_attention_bias.weight":
                f"{name}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            "layers.{i}.att.{rest}": f"{block}.0.SelfAttention.{{rest}}",
            **{f"layers.{{i}}.{ours}": f"{block}.{theirs}" for ours, theirs in sublayers.items()},
            # Parameter-efficient fine-tuning (galaxy.peft): names of their own in the same style.
            "layers.{i}.con1.adapter.{w}": f"{block}.0.adapter.{{w}}",
            "layers.{i}.side.{rest}": f"side.{name}.layer.{{i}}.{{rest}}",
            "side_in.{rest}": "side.input.{rest}",
            "side_out.{rest}": "side.output.{rest}",
        })
        return pre_norm_names(table, layers, f"{block}.0.layer_norm.{{w}}", f"{name}.final_layer_norm.{{w}}")
    decoder = stack("decoder", cfg.num_decoder_layers, {
        "con1.norm.{w}": "1.layer_norm.{w}", "xatt.{rest}": "1.EncDecAttention.{rest}",
        "conx.norm.{w}": "2.layer_norm.{w}", "mlp.{rest}": "2.DenseReluDense.{rest}",
        "conx.adapter.{w}": "1.adapter.{w}", "con2.adapter.{w}": "2.adapter.{w}"})
    encoder = stack("encoder", cfg.num_layers, {"con1.norm.{w}": "1.layer_norm.{w}", "mlp.{rest}": "1.DenseReluDense.{rest}",
                                                "con2.adapter.{w}": "1.adapter.{w}"})
    to_hf = stack_names(lambda n: _either(encoder, decoder, n), decoder, cfg.num_layers)
    if CLASSIFIER not in (getattr(cfg, "architectures", None) or ()):
        return to_hf
    return lambda name: name if name.startswith("classification_head.") else CLASSIFIER_PREFIX + to_hf(name)


def _either(encoder, decoder, name: str) -> str:
    """A model-level name: the encoder's map knows the encoder's and the shared ones, the decoder's its own."""
    return decoder(name) if name.startswith("decoder_") else encoder(name)


# The Hugging Face names of the head and the table the config ties it to: a checkpoint holding both,
# with other values (T5 v1.1 / flan), keeps them apart, as Hugging Face does.
HF_TIED = ("lm_head.weight", "shared.weight")
# Relative positions: no length limit of the model's own (pad_size is checked against this).
NO_POSITION_LIMIT = 2 ** 31 - 1


def unsupported(cfg) -> str | None:
    """What of a T5Config this definition cannot run: the decoder's inputs are the labels (or a
    classifier's source) shifted right behind decoder_start_token_id, padded with pad_token_id."""
    for name in ("decoder_start_token_id", "pad_token_id"):
        if getattr(cfg, name, None) is None:
            return (f"config.json has no {name}; T5 starts the decoder with decoder_start_token_id and pads "
                    f"with pad_token_id (both 0 in Google's T5 checkpoints): add \"{name}\": 0, or the id "
                    "the tokenizer's pad token has")
    return None


def random_shape(shape: dict, tokenizer) -> dict:
    """A random T5's config keys from the shape keys: the decoder starts with the pad token, as T5's does."""
    return {"decoder_start_token_id": tokenizer.pad_token_id, **shape}


def config_shape(raw: dict) -> dict:
    """The sizes galaxy.config checks, under their standard names, from a T5 config.json."""
    from transformers import T5Config
    cfg = checked_config(T5Config, raw, unsupported)
    return {"hidden_size": cfg.d_model, "num_attention_heads": cfg.num_heads, "intermediate_size": cfg.d_ff,
            "num_hidden_layers": cfg.num_layers + cfg.num_decoder_layers,
            "max_position_embeddings": NO_POSITION_LIMIT, "is_encoder_decoder": True}


def encdec_shape(cfg) -> EncDecShape:
    """T5's shape for the closed forms (galaxy.models.encdec_forms): a = num_heads x d_kv, no
    biases. Summed gradients per layer: CON SP, each CON's RMSNorm weight (2h encoder, 3h
    decoder) and, before the layers, both stacks' first norms (2h); an SP ATT or XATT, q, k, v, o
    (4ha) and, before the layers, both stacks' position bias tables (2 x buckets x heads, SP ATT);
    an SP MLP, its m [h, I] weights (v1.1: gated, m = 3)."""
    h, a, i = cfg.d_model, cfg.num_heads * cfg.d_kv, cfg.d_ff
    m = 3 if cfg.is_gated_act else 2
    return EncDecShape(hidden=h, inner=a, heads=cfg.num_heads, encoder_layers=cfg.num_layers,
                       decoder_layers=cfg.num_decoder_layers, intermediate=i, mlp_matrices=m, vocab=cfg.vocab_size,
                       sums={"con_encoder": 2 * h, "con_decoder": 3 * h, "att": 4 * h * a, "mlp": m * h * i,
                             "first_con": 2 * h, "first_att": 2 * cfg.relative_attention_num_buckets * cfg.num_heads})


flops_of, comm_of = flops_entry(encdec_shape), comm_entry(encdec_shape)
