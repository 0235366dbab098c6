"""Every config key, declared once: its type, default, range and one-line doc, in sections.

The JSON stays flat (`"pad_size": 128`, not nested): section names only group the declarations,
and GalaxyConfig is all sections in one flat object (`cfg.pad_size`). The parser
(galaxy.config.load), the range checks and the key reference in docs/configuration.md
(galaxy.config.reference) all read these declarations; a new key is one field here.

The plan's keys (PlanKeys) are read together into one galaxy.plan.Plan: `cfg.plan`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Literal, get_args, get_origin

from galaxy.config.schema import declared, default_of, key, members
from galaxy.plan import Plan

Method = Literal["TP", "SP"]
LayerSpec = Literal["none", "full"] | int | list[int]
CHECKPOINTS = ('"none", "full", a number of leading layers or a list of layer indices')


@dataclass
class ModelKeys:
    model_path: str | None = key(None, "Hugging Face model folder (config.json, weights, tokenizer); null: a "
                                 "random model of model_type and the shape keys", path="folder_in")
    model_type: str | None = key(None, "the family of a random model (bert, llama, qwen2, gpt2, bart, t5); "
                                 "must match model_path's")
    task: Literal["classification", "causal_lm", "seq2seq"] | None = key(None, "what to train; null: the entry "
                                                                         "script's task")
    train: bool = key(True, "false: no training; a classifier predicts the test set (test_path, or the embedded "
                      "one) under the plan, as --predict FILE does")
    hidden_size: int | None = key(None, "shape key: without model_path a random model of this shape; with it "
                                  "it must agree with config.json", at_least=1)
    intermediate_size: int | None = key(None, "shape key (MLP width)", at_least=1)
    num_attention_heads: int | None = key(None, "shape key", at_least=1)
    num_key_value_heads: int | None = key(None, "shape key (grouped-query attention)", at_least=1)
    num_hidden_layers: int | None = key(None, "shape key", at_least=1)
    vocab_size: int | None = key(None, "shape key", at_least=1)
    type_vocab_size: int | None = key(None, "shape key (BERT)", at_least=1)
    max_position_embeddings: int | None = key(None, "shape key", at_least=1)
    d_model: int | None = key(None, "shape key (BART, T5: the width)", at_least=1)
    encoder_layers: int | None = key(None, "shape key (BART)", at_least=1)
    decoder_layers: int | None = key(None, "shape key (BART)", at_least=1)
    encoder_attention_heads: int | None = key(None, "shape key (BART: both stacks' heads)", at_least=1)
    encoder_ffn_dim: int | None = key(None, "shape key (BART: both stacks' MLP width)", at_least=1)
    num_layers: int | None = key(None, "shape key (T5: encoder layers)", at_least=1)
    num_decoder_layers: int | None = key(None, "shape key (T5)", at_least=1)
    num_heads: int | None = key(None, "shape key (T5)", at_least=1)
    d_kv: int | None = key(None, "shape key (T5: the head width)", at_least=1)
    d_ff: int | None = key(None, "shape key (T5: the MLP width)", at_least=1)
    dropout: float | None = key(None, "every dropout probability of the model; null: the model config's",
                                at_least=0, below=1)
    ignore_mismatched_sizes: bool = key(False, "a classifier head in model_path sized for another label set: "
                                        "start a new one (Hugging Face's option)")


@dataclass
class DataKeys:
    train_path: str | None = key(None, "training data (JSONL, TSV or text); null: the embedded pydoc-topics "
                                 "dataset", path="read")
    dev_path: str | None = key(None, "dev set, evaluated every eval_interval steps and at the end", path="read")
    test_path: str | None = key(None, "test set, evaluated at the end", path="read")
    class_list: list[str] | str | None = key(None, "label names, or a text file with one per line; null: "
                                             "from the data", kind="a list of strings or the path of a "
                                             "text file")
    pad_size: int = key(128, "tokens per row (padded or truncated); an encoder-decoder's source", at_least=1)
    target_pad_size: int | None = key(None, "an encoder-decoder's target tokens per row (padded or truncated); "
                                      "null: pad_size", at_least=1)
    batch_size: int = key(8, "rows per optimizer step, over all data-parallel replicas", at_least=1)
    shuffle: bool = key(True, "shuffle the training rows every epoch")
    max_eval_samples: int | None = key(None, "evaluate only the first N dev / test examples", at_least=1)


@dataclass
class OptimKeys:
    optimizer: Literal["sgd", "adamw"] = key("adamw", "the optimizer")
    learning_rate: float = key(5e-5, "peak learning rate", above=0)
    weight_decay: float = key(0.0, "decoupled weight decay (AdamW) or L2 (SGD)", at_least=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = key("constant", "after warmup_steps of linear "
                                                               "warm-up")
    warmup_steps: int = key(0, "steps of linear warm-up", at_least=0)
    num_epochs: int = key(1, "passes over the training set", at_least=1)
    max_steps: int | None = key(None, "stop after this many optimizer steps", at_least=1)
    clip_grad: float | None = key(None, "max global gradient norm; null: no clipping", above=0)
    mixed_precision: Literal["bf16", "none"] | None = key("none", "bf16: autocast the forward pass",
                                                          null_as="none")
    seed: int = key(42, "model init, dropout and data order", at_least=0)


@dataclass
class PlanKeys:
    att_parallel_method: Method = key("TP", "ATT in the Galaxy group: heads split (TP) or tokens split (SP)")
    mlp_parallel_method: Method = key("TP", "MLP in the Galaxy group: columns split (TP) or tokens split (SP)")
    con_parallel_method: Literal["SP", "None"] | None = key("SP", "CON: tokens split (SP) or replicated "
                                                            "(None; JSON null too)", null_as="None")
    tp_num_attention_heads_list: list[int] | None = key(None, "query heads per Galaxy rank (TP ATT); null: "
                                                        "even, in whole K/V groups")
    tp_intermediate_size_list: list[int] | None = key(None, "MLP columns per Galaxy rank (TP MLP); null: "
                                                      "even")
    seq_scatter_list: list[int] | None = key(None, "tokens per Galaxy rank (SP sub-blocks); null: even")
    decode_intermediate_size_list: list[int] | None = key(None, "MLP columns per Galaxy rank that an SP MLP "
                                                          "computes for each decoded token (generation); null: "
                                                          "in proportion to seq_scatter_list")
    pp_deg: int = key(1, "pipeline stages", at_least=1)
    dp_deg: int = key(1, "data-parallel replicas of every stage", at_least=1)
    dp_batch_list: list[int] | None = key(None, "rows of every global batch per data-parallel replica, in "
                                          "dp-rank order, summing to batch_size (faster devices more); "
                                          "null: even")
    dp_sharding: Literal["none", "full", "no_reshard"] = key("none", "shard the replicas' parameters, "
                                                             "gradients and optimizer state (FSDP2); "
                                                             "needs dp_deg > 1")
    stage_num_hidden_layers_list: list[int] | None = key(None, "layers per pipeline stage (an encoder-decoder's: "
                                                         "the encoder's, then the decoder's); null: even")
    num_microbatches: int = key(1, "pipeline micro-batches per step (pp_deg > 1)", at_least=1)
    pipeline_schedule: Literal["gpipe", "1f1b"] = key("1f1b", "pipeline schedule; 1f1b needs num_microbatches "
                                                      ">= pp_deg")
    pipeline_warmup_list: list[int] | None = key(None, "1f1b: forwards each stage runs before its first "
                                                 "backward, in stage order, never rising; more than pp_deg - "
                                                 "stage hides a slower downstream's round trip, holding that "
                                                 "many micro-batches' activations; null: pp_deg - stage "
                                                 "(torch's 1F1B); gloo only (Galaxy's pipeline engine)",
                                                 at_least=1)
    mesh_rank_order: list[int] | None = key(None, "the launch ranks (--rank, RANK) in mesh order: the process "
                                            "started as rank mesh_rank_order[i] holds mesh position i "
                                            "((stage x dp_deg + replica) x group + Galaxy rank); null: "
                                            "position = launch rank. plan.py search writes it", at_least=0)
    grad_accum_steps: int = key(1, "micro-batches per optimizer step without a pipeline (batch_size stays "
                                "the global batch)", at_least=1)
    activation_checkpointing: LayerSpec = key("none", "layers that recompute in backward: " + CHECKPOINTS,
                                              kind=CHECKPOINTS)
    comm_chunks: int = key(1, "a TP sub-block's collectives travel in this many chunks of the sequence, "
                           "overlapped with its GEMMs", at_least=1)
    kv_blocks: bool = key(False, "SP attention attends to its own keys while the other ranks' K/V travel")
    batch_streams: int = key(1, "each micro-batch's rows run as this many streams through every layer, one's "
                             "collectives travelling while another's sub-block computes", at_least=1)
    prefill_chunks: int = key(1, "generation: the prompt crosses the pipeline in this many token chunks, stage "
                              "s running chunk k + 1 while stage s + 1 runs chunk k (no SP sub-block: tokens "
                              "stay whole on every rank); the latency planner writes it", at_least=1)
    xatt_parallel_method: Method | None = key(None, "XATT, an encoder-decoder's cross-attention: heads split "
                                              "(TP) or the decoder's tokens split (SP); null: as ATT")
    decoder_seq_scatter_list: list[int] | None = key(None, "an encoder-decoder's decoder tokens per Galaxy "
                                                     "rank (SP sub-blocks); null: even")

    @property
    def plan(self) -> Plan:
        """The plan these keys describe (shares not yet resolved: galaxy.config.world.resolved_plan)."""
        return Plan.from_keys(self)


def with_plan(cfg, plan: Plan):
    """A copy of cfg whose plan keys say `plan` (every other plan key back at its default, none of
    them counted as given by the JSON)."""
    plan_keys = {f.name for f in fields(PlanKeys)}
    values = {f.name: default_of(f) for f in fields(PlanKeys)}
    values.update(plan.to_keys())
    return replace(cfg, **values, _given=frozenset(cfg._given) - plan_keys)


@dataclass
class PeftKeys:
    full_model: bool = key(False, "full fine-tuning (the default when no method flag is true)")
    use_lora: bool = key(False, "LoRA on lora_target_modules")
    use_adapter: bool = key(False, "bottleneck adapters after every CON's dropout")
    use_side: bool = key(False, "ladder side-tuning beside the frozen backbone")
    use_side_only: bool = key(False, "the side network alone on the backbone's embeddings")
    lora_dim: int = key(8, "LoRA rank", at_least=1)
    lora_alpha: float = key(16.0, "LoRA scale numerator (scale = alpha / rank)")
    lora_dropout: float = key(0.0, "dropout on LoRA's input", at_least=0, below=1)
    lora_target_modules: list[str] | None = key(None, "projections LoRA wraps; null: query and value")
    lora_path: str | None = key(None, "a peft adapter folder to start from", path="adapter")
    merge_lora: bool = key(False, "export merged weights instead of an adapter")
    adapter_reduction_dim: int = key(64, "adapter bottleneck width", at_least=1)
    non_linearity: str = key("relu", "adapter activation (a transformers ACT2FN name)")
    side_reduction_factor: int = key(8, "side network width = hidden_size / this", at_least=1)


@dataclass
class CheckpointKeys:
    save_dir: str | None = key(None, "checkpoint folder (step-N subfolders); null: no checkpoints",
                               path="folder")
    save_interval: int | None = key(None, "save every N steps; null: at the end only", at_least=1)
    keep_checkpoints: int | None = key(None, "keep the newest N; null: all", at_least=1)
    resume: str | None = key(None, '"latest" (in save_dir), a checkpoint folder or save_dir/step-N',
                             path="checkpoint")
    export_dir: str | None = key(None, "Hugging Face folder (or peft adapter) written at the end",
                                 path="folder")


@dataclass
class RuntimeKeys:
    metrics_file: str | None = key(None, "JSON lines of every step and evaluation (a plot beside it)",
                                   path="folder")
    eval_interval: int | None = key(None, "evaluate the dev set every N steps; null: at the end only",
                                    at_least=1)
    distributed_backend: Literal["gloo", "nccl"] | None = key(None, "null: nccl when CUDA is available, "
                                                              "else gloo")
    timeout_s: float = key(120.0, "seconds a rank waits for its peers before it stops", above=0)
    init_method: str | None = key(None, "the default of --init_method (tcp://, file:// or env://)")
    comm_wait: Literal["auto", "poll", "block"] = key("auto", "how a rank waits for CPU collectives: poll "
                                                      "(yielding the core) or block; auto polls when every "
                                                      "rank has a core")
    cpu_allocator: Literal["keep", "system"] = key("keep", "keep: glibc keeps freed memory mapped (no fresh "
                                                   "pages every step); system: as it is")


SECTIONS = {"model": ModelKeys, "data": DataKeys, "optimisation and schedule": OptimKeys, "plan": PlanKeys,
            "PEFT": PeftKeys, "checkpoints": CheckpointKeys, "runtime": RuntimeKeys}


@dataclass
class GalaxyConfig(RuntimeKeys, CheckpointKeys, PeftKeys, PlanKeys, OptimKeys, DataKeys, ModelKeys):
    """Every key of every section, flat; plus what loading learnt (not keys)."""
    # Set by apply_preset, not read from JSON: which entry script's preset runs this config.
    preset: str = "galaxy"
    # Keys the JSON set explicitly, so a preset can tell "left at default" from "asked for".
    _given: frozenset = field(default=frozenset(), repr=False, compare=False)
    _script: str | None = field(default=None, repr=False, compare=False)
    # What loading did that the user should hear about (rank 0 prints them): note lines, and the
    # keys dropped for having no meaning here (printed as one warning line).
    _notes: tuple = field(default=(), repr=False, compare=False)
    _ignored: tuple = field(default=(), repr=False, compare=False)


SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "num_hidden_layers", "vocab_size", "type_vocab_size", "max_position_embeddings",
              # the encoder-decoders' own names (Galaxy-LM's bart and t5 configs use them)
              "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads", "encoder_ffn_dim",
              "num_layers", "num_decoder_layers", "num_heads", "d_kv", "d_ff")
# PEFT method flags -> galaxy.peft's method names; at most one flag true, none means full.
PEFT_FLAGS = {"full_model": "full", "use_lora": "lora", "use_adapter": "adapter", "use_side": "side",
              "use_side_only": "side_only"}


def choices(name: str) -> tuple:
    """The strings a Literal-typed key takes (e.g. choices("comm_wait")), from its declaration."""
    for f, typ in declared(GalaxyConfig):
        if f.name == name:
            return tuple(v for m in members(typ) if get_origin(m) is Literal for v in get_args(m))
    raise KeyError(name)
