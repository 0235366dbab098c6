"""The family contract: what every model family implements, and the spec that describes it.

A family is one Hugging Face architecture (BERT, Llama, ...) written once, in plain PyTorch, as
a `GalaxyModel`; every parallel mode is a plan applied to that one definition (galaxy.parallel,
galaxy.pipeline, galaxy.peft). Code outside galaxy/models never branches on a family's name: it
asks the model (the methods and class attributes below) or the family's `FamilySpec` (the
registry, galaxy.models.registry). docs/adding_a_model.md walks through adding one.

The forward pass, in the three pieces a pipeline stage runs (docs/design.md section 5):

    carry   = model.embed(input_ids, token_type_ids)           first stage: [b, S] ids -> carry
    context = model.layer_context(attention_mask)              every stage: masks, rotary tables
    carry   = model.run_layers(carry, context, model.layers)   each stage over its own layers
    logits, loss = model.head(carry, labels)                   last stage

`carry` is a tuple: the backbone's `carry_size` tensors [b, s_con, hidden] (s_con = this rank's
tokens when the plan shards the CON layout), then the side network's state under side-tuning.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from galaxy.distributed.streams import (cut_context, cut_rows, join_rows, round_robin, run_to_end, stream_delays,
                                        stream_rows)
from galaxy.models.attached import Attached


class GalaxyModel(nn.Module):
    """Base class of every family's model. A subclass builds, in __init__(cfg, num_labels=None):

      self.config   the Hugging Face config it was built from
      self.layers   nn.ModuleList of galaxy.layers.block.TransformerBlock(att, con1, mlp, con2)
      self.enter    a Transition: embeddings (R) -> the CON layout (set by the plan)

    and the modules named in first_stage_modules / last_stage_modules. The sub-blocks are the
    shared ones (galaxy.layers: SelfAttention, FeedForward, Connector), built with the family's
    Hugging Face names, its norms and its attention core (scale, rotary positions, mask layout);
    they own everything a plan sets (TP sharding, the SP K/V gather, dropout streams, overlap).
    """

    # -- facts every family states (class attributes) --------------------------------------
    task: str = ""                    # "classification" | "causal_lm": data, metrics, export
    peft_task_type: str = ""          # peft's task_type of this head ("SEQ_CLS", "CAUSAL_LM")
    modules_to_save: tuple[str, ...] = ()   # head modules PEFT trains in full (peft's modules_to_save)
    output_heads: tuple[str, ...] = ()      # modules LoRA may not wrap (applied through their weight)
    classes_layer: str = ""           # a classifier's last Linear, one row per class (ignore_mismatched_sizes)
    con_params: tuple[str, ...] = ()        # top-level modules acting on the CON layout (a first norm)
    first_stage_modules: tuple[str, ...] = ()   # kept by the first pipeline stage only
    last_stage_modules: tuple[str, ...] = ()    # kept by the last pipeline stage only
    carry_size: int = 1               # backbone tensors in the carry (1 post-norm, 2 pre-norm)
    # An encoder-decoder's encoder layers: layers[:encoder_layers] are the encoder's ("source"
    # layers), the rest the decoder's ("target"); 0: one stack (galaxy.models.seq2seq).
    encoder_layers: int = 0
    # Modules that layer_context uses for the layers of one stack only ({layer.sequence: module
    # names}, T5's relative position bias tables): a pipeline stage keeps those of its layers' stacks.
    stack_modules: dict = {}
    # The group whose tokens the head scores one share per rank (a plan sets it when the head
    # runs on sequence shards); None: the head's logits are whole on every rank.
    head_group = None

    def __init__(self):
        super().__init__()
        # What plans, pipeline stages and PEFT attach later (galaxy.models.attached).
        self.attached = Attached()
        # Ladder side-tuning (galaxy.peft.side) sets these: the side network's input and output
        # projections (its per-layer blocks are `layers[i].side`) and "side" | "side_only".
        self.side_in, self.side_out, self.side_mode = None, None, None

    # -- building -------------------------------------------------------------------------

    def materialize(self) -> None:
        """(Re)create what is not a checkpoint tensor (rotary tables, weight ties) after the
        model moves off the meta device. Default: nothing."""

    def plan_head(self, con_layout, group) -> dict:
        """Set up the head for a plan whose CON layout is `con_layout`; return gradient rules
        ({param name: ParamRule}) for head parameters that need other than the default."""
        raise NotImplementedError

    # -- the forward pass in stage-sized pieces ---------------------------------------------

    def backbone_grad(self):
        """Side-tuning never back-propagates through the frozen backbone: run it without autograd."""
        return torch.no_grad() if self.side_mode else nullcontext()

    def embed(self, input_ids, token_type_ids=None, positions=None) -> tuple:
        """[b, S] ids (the full sequence on every rank) -> the carry entering the first layer.
        positions: [b, S], each token's position (generation's left-padded rows; a causal LM's
        families take it here or in layer_context); None: 0..S-1."""
        raise NotImplementedError

    def layer_context(self, attention_mask, positions=None) -> dict:
        """Keyword arguments every layer's ATT takes, from the [b, S] padding mask (or None) and
        the positions (as embed takes them)."""
        raise NotImplementedError

    def run_layers(self, carry: tuple, context: dict, layers) -> tuple:
        """Run `layers` (all, or a pipeline stage's) over the carry. Under the plan's
        batch_streams > 1 (training), the carry's rows and the context are cut into streams that
        take turns at every sub-block boundary (galaxy.distributed.streams)."""
        sizes = self.stream_sizes(carry)
        if sizes is None:
            return run_to_end(self.layer_steps(carry, context, layers, interleave=False))
        streams = [self.layer_steps(c, k, layers, interleave=True)
                   for c, k in zip(cut_rows(carry, sizes), cut_context(context, sum(sizes), sizes))]
        return join_rows(round_robin(streams, stream_delays(len(streams))))

    def stream_sizes(self, carry: tuple) -> list[int] | None:
        """Rows per batch stream of this forward; None for one stream: always unless training
        under a plan with batch_streams > 1 on at least 2 rows. Side-tuning runs one stream (its
        backbone runs without autograd)."""
        plan = self.attached.plan
        if plan is None or plan.batch_streams == 1 or not self.training or self.side_mode:
            return None
        sizes = stream_rows(carry[0].shape[0], plan.batch_streams)
        return sizes if len(sizes) > 1 else None

    def layer_steps(self, carry: tuple, context: dict, layers, interleave: bool):
        """run_layers' loop over one stream, as steps (TransformerBlock.steps): yields while a
        boundary's collective travels (interleave), returns the carry after `layers`."""
        n = self.carry_size
        backbone, side = carry[:n], carry[n:]
        for layer in layers:
            if self.side_mode != "side_only":       # side-only never runs the backbone's layers
                with self.backbone_grad():          # (no yield inside under side-tuning: one stream)
                    backbone = (yield from layer.steps(backbone[0], backbone[-1], context, interleave))[:n]
            if side:
                side = (layer.side(side[0], backbone[0], context),)
        return (*backbone, *side)

    def head(self, carry: tuple, labels=None):
        """The carry after the last layer -> (logits, loss or None)."""
        raise NotImplementedError

    # True when loss_units(labels) is the number of rows (one loss term per example): the global
    # batch's count is then known on every replica without an all-reduce (galaxy.parallel.loss_scale).
    loss_units_are_rows = False

    def loss_units(self, labels) -> torch.Tensor:
        """How many terms `head`'s loss averages over (rows, or label tokens): the weights of
        micro-batch losses, so that accumulated losses equal the full batch's mean."""
        raise NotImplementedError

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
        carry = self.embed(input_ids, token_type_ids)
        carry = self.run_layers(carry, self.layer_context(attention_mask), self.layers)
        return self.head(carry, labels)


@dataclass(frozen=True)
class FamilySpec:
    """Every per-family fact the rest of galaxy needs, in one place (the registry holds one each).

    hf_names(cfg) returns a function galaxy parameter name -> Hugging Face name; the same map
    reads checkpoints, writes exports and checkpoints, and names LoRA tensors in peft's format.
    Galaxy holds every projection as nn.Linear, weight [out, in]; a Hugging Face tensor named in
    hf_transposed is stored [in, out] (GPT-2's Conv1D), and every read and write of Hugging Face
    tensors goes through hf_layout / hf_state, which transpose exactly those.
    """
    name: str
    model_types: tuple[str, ...]                 # Hugging Face config.model_type values it reads
    tasks: dict[str, type[GalaxyModel]]          # task kind -> the model class that does it
    hf_names: Callable[[object], Callable[[str], str]]
    hf_base_prefix: str = ""                     # prefix a bare base-model checkpoint lacks
    hf_head_params: tuple[str, ...] = ()         # galaxy names a checkpoint may lack (new task head)
    hf_transposed: tuple[str, ...] = ()          # HF weights stored [in, out] (Conv1D): HF-name suffixes
    # (head, table): HF names of a weight the config ties to another, kept apart when a checkpoint
    # holds both with other values (as Hugging Face does: T5 v1.1's untied LM head)
    hf_tied: tuple[str, ...] = ()
    lora_targets: tuple[str, ...] = ()           # peft's default target_modules for the family
    padding_side: str = "right"                  # the tokenizer's padding side galaxy trains with
    # The profiler's closed forms, beside the family's model (e.g. galaxy.models.bert): matmul
    # FLOPs of one forward pass, (cfg, batch, seq, num_labels) -> {"total": ..., per part}; and the
    # bytes per collective kind a plan moves per rank and step, (plan, cfg, batch, seq_shares) ->
    # {kind: bytes} (built on galaxy.distributed.comm_bytes). An encoder-decoder's also take
    # target= (decoder tokens) and num_labels= (its classifier) (galaxy.models.encdec_forms).
    matmul_flops: Callable[..., dict] | None = None
    plan_comm_bytes: Callable[..., dict] | None = None
    notes: tuple[str, ...] = field(default=())   # what the family does not support, for errors
    # The sizes galaxy.config's plan checks read, from the raw config.json dict, for a family
    # whose config names them otherwise (GPT-2's n_embd, n_head, n_inner, ...): raw -> {hidden_size,
    # num_attention_heads, intermediate_size, num_hidden_layers, max_position_embeddings} (the
    # keys it knows; a missing one is reported by the check). None: config.json uses those names.
    config_shape: Callable[[dict], dict] | None = None
    # A config with shape keys and no model_path builds a randomly initialised model of the family
    # (galaxy.models.random_init): transformers' auto class whose model is written (its own seeded
    # init), and a tokenizer to ship with it () -> tokenizer (galaxy.assets), described for the
    # note line.
    random_init_class: str = "AutoModelForCausalLM"
    default_tokenizer: Callable[[], object] | None = None
    default_tokenizer_name: str = ""
    # (shape keys given, the default tokenizer) -> the config keys of the random model, for a
    # family whose config needs more than the shape (BART's decoder sizes, T5's start token).
    random_shape: Callable[[dict, object], dict] | None = None

    def hf_layout(self, hf_name: str) -> bool:
        """Whether Hugging Face stores tensor `hf_name` transposed against galaxy ([in, out])."""
        return any(hf_name == s or hf_name.endswith("." + s) for s in self.hf_transposed)

    def hf_state(self, cfg, full: dict) -> dict:
        """Whole tensors by galaxy name -> the same by Hugging Face name, in Hugging Face's layout
        (what exports, checkpoints and peft files hold)."""
        to_hf = self.hf_names(cfg)
        out = {}
        for name, tensor in full.items():
            hf = to_hf(name)
            out[hf] = tensor.t().contiguous() if self.hf_layout(hf) else tensor
        return out

    def from_hf(self, hf_name: str, tensor):
        """A Hugging Face tensor -> galaxy's layout (a transposed view where hf_layout says so)."""
        return tensor.t() if self.hf_layout(hf_name) else tensor

    @property
    def lora_fan_in_fan_out(self) -> bool:
        """peft's fan_in_fan_out for the family's projections: True when Hugging Face stores them
        [in, out] (Conv1D). peft's LoRA tensors are [r, in] and [out, r] either way; the flag only
        tells peft how to merge into the base weight."""
        return bool(self.hf_transposed)

    def model_class(self, task: str) -> type[GalaxyModel]:
        try:
            return self.tasks[task]
        except KeyError:
            raise ValueError(f"{self.name} models do not do {task}; they do {', '.join(sorted(self.tasks))}") from None


def checked_config(config_class, raw: dict, unsupported: Callable[[object], str | None]):
    """A family's transformers config from a config.json dict (the class's defaults for keys it
    leaves out); ValueError with unsupported(cfg)'s line when the family cannot compute it."""
    cfg = config_class.from_dict(raw)
    problem = unsupported(cfg)
    if problem:
        raise ValueError(problem)
    return cfg
