"""The model families galaxy trains, one FamilySpec each (galaxy.models.family).

Adding a family is one model file and one entry here (docs/adding_a_model.md). Everything
outside galaxy/models finds a family through `family_of` (a Hugging Face model_type) or
`family_of_model` (a built model), and asks the spec; nothing else names a family.
"""
from __future__ import annotations

from galaxy.assets import packaged_minilm, tiny_bart, tiny_llama, tiny_t5
from galaxy.models import bart, bert, gpt2, llama, qwen2, t5
from galaxy.models.family import FamilySpec
from galaxy.models.weights import NameMap

# The encoder-decoders' classifier (galaxy.models.seq2seq_classifier), drawn afresh when a checkpoint
# (a ...ForConditionalGeneration) lacks it; out_proj's weight first: its rows are the classes.
CLASSIFICATION_HEAD = tuple(f"classification_head.{m}.{w}" for m in ("out_proj", "dense") for w in ("weight", "bias"))

FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in (
    FamilySpec(
        name="bert", model_types=("bert",),
        tasks={"classification": bert.BertForClassification},
        hf_names=lambda cfg: NameMap(bert.HF_NAMES),
        hf_base_prefix=bert.HF_BASE_PREFIX, hf_head_params=bert.HF_HEAD_PARAMS,
        lora_targets=("query", "value"),
        matmul_flops=bert.flops_of, plan_comm_bytes=bert.comm_of,
        random_init_class="AutoModel",      # encoder + pooler, like all-MiniLM-L6-v2; the head is galaxy's
        default_tokenizer=packaged_minilm.tokenizer,
        default_tokenizer_name="the all-MiniLM-L6-v2 WordPiece tokenizer"),
    FamilySpec(
        name="llama", model_types=("llama",),
        tasks={"causal_lm": llama.LlamaForCausalLM, "classification": llama.LlamaForSequenceClassification},
        hf_names=llama.hf_names,
        hf_head_params=("score.weight",),   # a causal LM's checkpoint has no classifier: drawn from the seed
        lora_targets=("q_proj", "v_proj"),
        matmul_flops=llama.flops_of, plan_comm_bytes=llama.comm_of,
        default_tokenizer=tiny_llama.default_tokenizer,
        default_tokenizer_name="the tiny-llama byte-level BPE tokenizer (galaxy.assets.tiny_llama)"),
    FamilySpec(     # Llama with q/k/v biases: Llama's names, FLOPs; its own "sum" parameters
        name="qwen2", model_types=("qwen2",),
        tasks={"causal_lm": qwen2.Qwen2ForCausalLM},
        hf_names=llama.hf_names,
        lora_targets=("q_proj", "v_proj"),
        matmul_flops=llama.flops_of, plan_comm_bytes=qwen2.comm_of,
        notes=("sliding-window attention (use_sliding_window) is refused",)),
    FamilySpec(
        name="gpt2", model_types=("gpt2",),
        tasks={"causal_lm": gpt2.GPT2ForCausalLM},
        hf_names=gpt2.hf_names,
        hf_base_prefix=gpt2.HF_BASE_PREFIX, hf_transposed=gpt2.HF_TRANSPOSED,
        lora_targets=("c_attn",),
        matmul_flops=gpt2.flops_of, plan_comm_bytes=gpt2.comm_of,
        config_shape=gpt2.config_shape),
    FamilySpec(
        name="bart", model_types=("bart",),
        tasks={"seq2seq": bart.BartForConditionalGeneration, "classification": bart.BartForSequenceClassification},
        hf_names=bart.hf_names,
        hf_head_params=CLASSIFICATION_HEAD,
        lora_targets=("q_proj", "v_proj"),
        matmul_flops=bart.flops_of, plan_comm_bytes=bart.comm_of,
        config_shape=bart.config_shape,
        random_init_class="AutoModelForSeq2SeqLM", random_shape=bart.random_shape,
        default_tokenizer=tiny_bart.default_tokenizer,
        default_tokenizer_name="the tiny-bart byte-level BPE tokenizer (galaxy.assets.tiny_bart)"),
    FamilySpec(
        name="t5", model_types=("t5",),
        tasks={"seq2seq": t5.T5ForConditionalGeneration, "classification": t5.T5ForSequenceClassification},
        hf_names=t5.hf_names, hf_tied=t5.HF_TIED,
        hf_base_prefix=t5.CLASSIFIER_PREFIX, hf_head_params=CLASSIFICATION_HEAD,
        lora_targets=("q", "v"),
        matmul_flops=t5.flops_of, plan_comm_bytes=t5.comm_of,
        config_shape=t5.config_shape,
        random_init_class="AutoModelForSeq2SeqLM", random_shape=t5.random_shape,
        default_tokenizer=tiny_t5.default_tokenizer,
        default_tokenizer_name="the tiny-t5 byte-level BPE tokenizer (galaxy.assets.tiny_t5)"),
)}

_BY_MODEL_TYPE = {t: spec for spec in FAMILIES.values() for t in spec.model_types}


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


def family_of(model_type: str) -> FamilySpec:
    """The family that reads Hugging Face models of this config.model_type."""
    try:
        return _BY_MODEL_TYPE[model_type]
    except KeyError:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(supported_model_types())}") from None


def family_of_model(model) -> FamilySpec:
    """The family of a built galaxy model."""
    return family_of(model.config.model_type)


def families_for(task: str) -> list[FamilySpec]:
    """The families that do `task` ("classification", "causal_lm")."""
    return [spec for spec in FAMILIES.values() if task in spec.tasks]
