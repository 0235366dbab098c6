"""What the encoder-decoder families (BART, T5) share: one layer list over two stacks, the
encoder's output gathered once for every cross-attention, and the LM head on the decoder.

    layers      the encoder's layers (TransformerBlock, sequence "source"), then the decoder's
                (DecoderBlock, sequence "target"): layer i < encoder_layers is the encoder's
                layer i, the others the decoder's layer i - encoder_layers. One list, so that
                pipeline stages, recomputation and checkpoints index them like any family's
                (a stage may hold encoder and decoder layers).
    carry       (the encoder's carry_size tensors [b, s_src, h], the decoder's [b, s_tgt, h]):
                both stacks' streams in the CON layout, each split by its own token shares
                (the plan's tokens and decoder_tokens). Both are embedded on the first
                stage; the decoder's waits in the carry until the first decoder layer.
    memory      the encoder's output, moved once per forward of a stage (not once per layer)
                from the CON layout to R by `self.memory`, a gather for a sharded consumer:
                every XATT reads it whole and uses only its heads (TP) or its queries (SP), so
                its gradient is partial on every rank, summed over the layers locally and then
                over the group once by the gather's backward (reduce-scatter under CON SP,
                all-reduce under CON None), back to the encoder's ranks exactly.
    context     {"source": the encoder's ATT context, "target": the decoder's ATT context,
                 "cross": XATT's}, from the source mask [b, S] and the target mask [b, T].

The head is the causal LMs' (galaxy.models.causal_lm_head) on the decoder's output, with labels
aligned to positions (Hugging Face's seq2seq loss: the decoder's inputs are the labels shifted
right, the loss the token mean over labels that are not -100).

Generation (galaxy.inference.seq2seq_engine) runs the encoder once under the plan and the decoder
one token per row per step from the start token: `cached_prefills` names the caches (each
decoder ATT's, empty at first, and each XATT's, the memory's K/V), `decoding_context` is a step's
layer context, `embed_target` a step's entered embeddings at its position. A pass whose XATTs
hold the memory already skips the memory's gather (run_layers).
"""
from __future__ import annotations

import torch
from torch import nn

from galaxy.distributed.transitions import Layout, Transition
from galaxy.layers.kv_cache import KEY_BIAS, STEP_KEY
from galaxy.models.causal_lm_head import IGNORE_INDEX, CausalLMHead, causal_padding_mask
from galaxy.models.family import GalaxyModel


def shift_right(labels: torch.Tensor, start_id: int, pad_id: int) -> torch.Tensor:
    """Hugging Face's decoder inputs from labels [b, T]: the start token, then labels[:, :-1],
    ignored labels (-100) as padding."""
    out = torch.full_like(labels, start_id)
    out[:, 1:] = labels[:, :-1]
    return out.masked_fill(out == IGNORE_INDEX, pad_id)


class EncoderDecoder(GalaxyModel):
    """The backbone of both stacks. A family's subclass builds `layers` (encoder first), sets
    `encoder_layers`, and implements source_embeddings / target_embeddings ([b, S] ids -> [b, S,
    h], replicated) and, pre-norm, `start_stack` (the first layer's input norm)."""
    # Batch keys beyond input_ids / attention_mask / labels that the forward takes; a pipeline
    # gives them to every stage (the first embeds decoder_input_ids, all mask with the target mask).
    extra_inputs = ("decoder_input_ids", "decoder_attention_mask")
    encoder_layers = 0

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.enter = Transition()             # source embeddings (R) -> the CON layout
        self.enter_decoder = Transition()     # target embeddings (R) -> the decoder's CON layout
        self.memory = Transition()            # the encoder's output (CON layout) -> R, once
        self.encoder_output = nn.Identity()   # on the gathered memory (T5: its dropout)
        # Side-tuning (galaxy.peft.side_seq2seq): the side encoder's output -> whole on every rank
        # (a gather under CON SP, set by add_side)
        self.side_memory = _whole

    def plan_memory(self, con_layout, group):
        """The decoder's entry on the decoder's token shares, the memory's gather on the encoder's;
        returns the decoder's group."""
        decoder = group.decoder()
        self.enter_decoder.set(Layout.R, con_layout, sharded_consumer=False, group=decoder)
        self.memory.set(con_layout, Layout.R, sharded_consumer=True, group=group)
        return decoder

    # -- the forward pass in stage-sized pieces ------------------------------------------------

    def start_stack(self, h, which: str) -> tuple:
        """A stack's carry from its entered embeddings [b, s_con, h]: (h,) post-norm."""
        return (h,)

    def decoder_inputs(self, input_ids, decoder_input_ids=None, labels=None):
        """The decoder's ids: given, or the labels shifted right, or (a classifier) the source
        shifted right, as Hugging Face does."""
        if decoder_input_ids is not None:
            return decoder_input_ids
        cfg = self.config
        return shift_right(labels if labels is not None else input_ids, cfg.decoder_start_token_id,
                           cfg.pad_token_id)

    def embed(self, input_ids, token_type_ids=None, decoder_input_ids=None, **_) -> tuple:
        # input_ids [b, S], decoder_input_ids [b, T] on every rank -> (source carry, target carry)
        decoder_input_ids = self.decoder_inputs(input_ids, decoder_input_ids)
        with self.backbone_grad():
            source = self.start_stack(self.enter(self.source_embeddings(input_ids)), "source")
            target = self.start_stack(self.enter_decoder(self.target_embeddings(decoder_input_ids)), "target")
        side = () if self.side_in is None else self.side_in(source[0], target[0])   # each stack's s_0
        return (*source, *target, *side)

    def layer_context(self, attention_mask, decoder_attention_mask=None, **_) -> dict:
        """Each stack's context from the source mask [b, S] and the target mask [b, T] (None: no
        target padding, the target as long as the source: a classifier's decoder). Only the
        stacks whose layers this model holds (a pipeline stage may hold one of them)."""
        keep = attention_mask.bool()
        target = keep.new_ones(keep.shape) if decoder_attention_mask is None else decoder_attention_mask.bool()
        keys = keep[:, None, None, :]                                     # [b, 1, 1, S]
        held = {layer.sequence for layer in self.layers}
        context = {"cross": {"mask": keys}}
        if "source" in held:
            context["source"] = {"mask": self.source_mask(keys)}
        if "target" in held:
            context["target"] = {"mask": self.target_mask(target)}
        if self.side_mode:      # the side network's own boolean masks (galaxy.peft.side_seq2seq)
            context["side_source"] = {"mask": keys}
            context["side_target"] = {"mask": causal_padding_mask(target), "cross": keys}
        return context

    def source_mask(self, keys):
        """The encoder's ATT mask from the source keys' [b, 1, 1, S]."""
        return keys

    def target_mask(self, keep):
        """The decoder's ATT mask from the target's [b, T]: causal and padding, [b, 1, T, T]."""
        return causal_padding_mask(keep)

    def layer_steps(self, carry: tuple, context: dict, layers, interleave: bool):
        """The layers over one stream's carry, as steps (GalaxyModel.run_layers drives them):
        (source, target) streams, then under side-tuning the side states (side encoder's, side
        decoder's), each side layer after its backbone layer."""
        n = self.carry_size
        source, target, side = carry[:n], carry[n:2 * n], carry[2 * n:]
        memory = side_memory = None
        run_backbone = self.side_mode != "side_only"     # side-only never runs the backbone's layers
        for layer in layers:
            if layer.sequence == "source":
                if run_backbone:
                    with self.backbone_grad():       # (no yield inside under side-tuning: one stream)
                        source = (yield from layer.steps(source[0], source[-1], context["source"], interleave))[:n]
                if side:
                    side = (layer.side(side[0], source[0], context["side_source"]), side[1])
                continue
            if run_backbone:
                with self.backbone_grad():
                    if memory is None and not layer.xatt.memory_cached:   # once per stage: the encoder's output, whole
                        memory = self.encoder_output(self.memory(source[-1]))
                    decoder_context = {**context["target"], "memory": memory, "cross": context["cross"]}
                    target = (yield from layer.steps(target[0], target[-1], decoder_context, interleave))[:n]
            if side:
                if side_memory is None:      # once per stage too: the side encoder's output, whole
                    side_memory = self.side_memory(side[0])
                side = (side[0], layer.side(side[1], target[0], context["side_target"], side_memory))
        return (*source, *target, *side)

    # -- generation: the encoder once, then one decoder token per row and step ------------------

    def cached_prefills(self, source_length: int) -> list:
        """(module, prefill length) of every cache generation keeps (galaxy.layers.kv_cache): each
        decoder ATT starts empty (no prefill), each XATT holds the memory's source_length keys."""
        decoder = [layer for layer in self.layers if layer.sequence == "target"]
        return [(layer.att, 0) for layer in decoder] + [(layer.xatt, source_length) for layer in decoder]

    def embed_target(self, ids, start: int) -> tuple:
        """A decode step's target carry: ids [b, 1] at position `start`, entered into the decoder."""
        return self.start_stack(self.enter_decoder(self.target_embeddings(ids, start)), "target")

    def decoding_context(self, attention_mask, position: int, step) -> dict:
        """The layer context of a pass whose decoder runs one token per row at `position` (step:
        its CacheStep): at position 0, the first pass, the encoder's too (layer_context's); the
        decoder's ATT reads its cache, XATT the source's padding mask [b, 1, 1, S]. Only the stacks
        whose layers this model holds (a pipeline stage's: T5's bias tables are where their stack is)."""
        keys = attention_mask.bool()[:, None, None, :]
        held = {layer.sequence for layer in self.layers}
        target = {STEP_KEY: step}
        bias = self.decoder_key_bias(position) if "target" in held else None
        if bias is not None:
            target[KEY_BIAS] = bias
        context = {"target": target, "cross": {"mask": keys}}
        if position == 0 and "source" in held:
            context["source"] = {"mask": self.source_mask(keys)}
        return context

    def decoder_key_bias(self, position: int):
        """An additive bias over the decoded keys 0..position for the query at `position`
        ([1, heads, 1, position + 1]), or None (a family with absolute positions)."""
        return None

    def decoder_carry(self, carry: tuple) -> tuple:
        return carry[self.carry_size:2 * self.carry_size]

    def final_hidden(self, carry: tuple):
        """The decoder's output [b, s_con, h] a head reads (through the side network's output
        under side-tuning); T5 adds its dropout."""
        x = self.decoder_carry(carry)[-1]          # None under side-only past the first stage
        side = carry[2 * self.carry_size:]           # (side encoder's state, side decoder's)
        return self.side_out(x, side[-1]) if side else x

    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                labels=None, token_type_ids=None):
        # input_ids, attention_mask [b, S]; decoder_input_ids, decoder_attention_mask, labels [b, T]
        # (a classifier's labels [b]); every rank gets the whole rows
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        decoder_input_ids = self.decoder_inputs(input_ids, decoder_input_ids,
                                                labels if self.task == "seq2seq" else None)
        if decoder_attention_mask is None:        # as Hugging Face: no target padding, causal only
            decoder_attention_mask = torch.ones_like(decoder_input_ids)
        carry = self.embed(input_ids, decoder_input_ids=decoder_input_ids)
        carry = self.run_layers(carry, self.layer_context(attention_mask, decoder_attention_mask), self.layers)
        return self.head(carry, labels)


def _whole(x):
    return x


class Seq2SeqLMHead(CausalLMHead):
    """The LM head of an EncoderDecoder: the causal LMs' head on the decoder's output, labels
    aligned to the decoder's positions (Hugging Face's ...ForConditionalGeneration loss)."""
    task, peft_task_type = "seq2seq", "SEQ_2_SEQ_LM"
    label_shift = 0
    forward = EncoderDecoder.forward      # not the causal LM's

    def plan_head(self, con_layout, group) -> dict:
        return super().plan_head(con_layout, self.plan_memory(con_layout, group))

    def head_input(self, carry: tuple):
        return self.final_hidden(carry)


def stack_names(encoder, decoder, encoder_layers: int):
    """galaxy name -> Hugging Face name of an encoder-decoder: a name under "layers.{i}" goes to
    encoder(name) with i < encoder_layers, else to decoder(name with the decoder's own index);
    every other name to encoder (the encoder's map holds the model-level names)."""
    def to_hf(name: str) -> str:
        parts = name.split(".")
        if parts[0] == "layers" and int(parts[1]) >= encoder_layers:
            return decoder(".".join(["layers", str(int(parts[1]) - encoder_layers), *parts[2:]]))
        return encoder(name)
    return to_hf
