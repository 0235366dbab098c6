"""The config space of the combination test (tests/test_combinations.py): its factors, the pairs
of values Galaxy refuses up front, a row of values as an entry-script config, and the tiny models
and data the rows train.

A row trains 2 steps of a tiny model (2 layers, 6 heads: uneven shares [4, 2] of whole K/V
groups) from its family's entry script, pretrain_galaxy.py for BERT and finetune_llama.py for
the causal LMs, which run whatever mesh and plan the config gives.
"""
from __future__ import annotations

import json
import os

from support.tiny_models import make_tiny_bert_with_minilm_tokenizer

FACTORS = {
    "family": ["bert", "llama", "qwen2", "gpt2"],
    "optimizer": ["sgd", "adamw"],
    "peft": ["full", "lora", "adapter", "side", "side_only"],
    "mesh": ["serial", "galaxy2", "dp2", "dp2_full", "dp2_no_reshard", "pp2"],
    "recompute": ["none", "full", "some"],
    "precision": ["none", "bf16"],
    "accum": [1, 2],
    "clip": ["off", "on"],
    "overlap": ["off", "on"],          # comm_chunks 2 (a TP ATT's or MLP's), kv_blocks (an SP ATT's), and
    #                                    batch_streams 2 on a Galaxy group or pipeline without accumulation
}
# Combinations the whole product found failing, run in the suite too (pairs do not hold them).
FOUND = [
    # a pipeline stage sent the bf16 side state into an fp32 buffer: NaN from step 1
    # (galaxy.pipeline.stage.carry_dtype)
    {"family": "llama", "optimizer": "adamw", "peft": "side_only", "mesh": "pp2", "recompute": "none",
     "precision": "bf16", "accum": 1, "clip": "on", "overlap": "on"},
    # kv_blocks under bf16: the blocks' kernel got Q, K, V of mixed dtypes and refused them
    # (galaxy.layers.attention_blocks._as_sdpa_would)
    {"family": "llama", "optimizer": "adamw", "peft": "side", "mesh": "galaxy2", "recompute": "none",
     "precision": "bf16", "accum": 1, "clip": "off", "overlap": "on"},
]
# Pairs of values Galaxy refuses before any process group starts, and a piece of the one line it
# prints: no row that trains holds one, and each is tried in a row of its own.
REFUSED = {
    (("mesh", "pp2"), ("accum", 2)): "grad_accum_steps does not apply with pp_deg > 1",
}

PAD, BATCH, STEPS = 12, 4, 2
LR = {"sgd": 0.1, "adamw": 1e-4}       # tests/test_data_parallel.py: AdamW's rounding at 1e-3
CLIP = 0.05                            # below the tiny models' gradient norms: clipping scales
SHARES = dict(tp_num_attention_heads_list=[4, 2], seq_scatter_list=[7, 5])
# The Galaxy group's plan: TP MLP and SP CON always (uneven columns and tokens); ATT TP (uneven
# heads, chunked by comm_chunks) for BERT and Qwen2, SP (blocks of keys with kv_blocks) for Llama
# and GPT-2, so that each pair of the family and the overlap knobs meets both.
ATT_SP = ("llama", "gpt2")
SCRIPTS = {"bert": "pretrain_galaxy.py", "llama": "finetune_llama.py", "qwen2": "finetune_llama.py",
           "gpt2": "finetune_llama.py"}
MESHES = {"serial": (1, {}), "galaxy2": (2, {}), "dp2": (2, {"dp_deg": 2}),
          "dp2_full": (2, {"dp_deg": 2, "dp_sharding": "full"}),
          "dp2_no_reshard": (2, {"dp_deg": 2, "dp_sharding": "no_reshard"}),
          "pp2": (2, {"pp_deg": 2, "num_microbatches": 2})}
PEFT = {"full": {}, "lora": {"use_lora": True}, "adapter": {"use_adapter": True, "adapter_reduction_dim": 8},
        "side": {"use_side": True}, "side_only": {"use_side_only": True}}
RECOMPUTE = {"none": "none", "full": "full", "some": [1]}


def name(row: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in row.items())


def refusal(row: dict) -> str | None:
    """The line Galaxy must refuse `row` with (a piece of it), or None: the row must train."""
    for (a, b), line in REFUSED.items():
        if row[a[0]] == a[1] and row[b[0]] == b[1]:
            return line
    return None


def tolerance(row: dict) -> float:
    """How far the row's losses may be from its serial twin's, relative: 1e-5 where the plan is
    exact (fp32, dropout off); under bf16 (8-bit mantissa: 3.9e-3 a rounding) 2e-2, far below
    what a wrong carry or gradient does, far above what another order of bf16 sums does."""
    return 1e-5 if row["precision"] == "none" else 2e-2


def serial_twin(row: dict) -> dict:
    return {**row, "mesh": "serial"}


def galaxy_plan(family: str, model: dict) -> dict:
    att = "SP" if family in ATT_SP else "TP"
    return {"att_parallel_method": att, "mlp_parallel_method": "TP", "con_parallel_method": "SP",
            "tp_intermediate_size_list": model["columns"], **SHARES}


def config(row: dict, model: dict, folder: str) -> tuple[str, str, int, str]:
    """(script, config path, world, metrics file) of the row, its config written to folder."""
    world, mesh = MESHES[row["mesh"]]
    if row["mesh"] == "galaxy2":
        mesh = galaxy_plan(row["family"], model)
    metrics = os.path.join(folder, name(row) + ".jsonl")
    keys = {"model_path": model["dir"], "train_path": model["train"], **model["keys"], "pad_size": PAD,
            "batch_size": BATCH, "max_steps": STEPS, "shuffle": False, "dropout": 0.0, "timeout_s": 60,
            "optimizer": row["optimizer"], "learning_rate": LR[row["optimizer"]], "metrics_file": metrics,
            **PEFT[row["peft"]], **mesh, "activation_checkpointing": RECOMPUTE[row["recompute"]],
            "mixed_precision": row["precision"], "grad_accum_steps": row["accum"],
            "clip_grad": CLIP if row["clip"] == "on" else None}
    if row["overlap"] == "on":
        keys.update(comm_chunks=2, kv_blocks=True)
        if row["mesh"] in ("galaxy2", "pp2") and row["accum"] == 1:     # micro-batches of 4 or 2 rows
            keys["batch_streams"] = 2
    path = os.path.join(folder, name(row) + ".json")
    with open(path, "w") as f:
        json.dump(keys, f)
    if os.path.exists(metrics):
        os.remove(metrics)
    return SCRIPTS[row["family"]], path, world, metrics


def make_models(folder: str) -> dict:
    """family -> {"dir", "train", "keys" (config keys the data needs), "columns" (MLP shares)}."""
    from galaxy.assets import tiny_llama
    llama_tokenizer = tiny_llama.train_tokenizer(300)        # Llama's and Qwen2's: trained once
    return {"bert": _bert(os.path.join(folder, "bert")),
            **{family: _causal_lm(family, os.path.join(folder, family), llama_tokenizer)
               for family in ("llama", "qwen2", "gpt2")}}


def _bert(folder: str) -> dict:
    from galaxy.data import pydoc_topics_dataset
    examples, names = pydoc_topics_dataset("train")
    by_class = [[text for text, label in examples if label == c] for c in range(len(names))]
    rows = [(by_class[i % len(names)][i // len(names)], i % len(names)) for i in range(BATCH * STEPS)]
    model_dir = make_tiny_bert_with_minilm_tokenizer(os.path.join(folder, "model"), len(names))
    train = os.path.join(folder, "train.tsv")
    with open(train, "w") as f:
        f.write("".join(f"{text}\t{names[label]}\n" for text, label in rows))
    return {"dir": model_dir, "train": train, "keys": {"class_list": names}, "columns": [64, 32]}


# The causal LMs' tiny shape: BERT's (hidden 48, MLP 96; GPT-2's MLP is 4 x 48), 6 query heads in
# 3 K/V groups, 2 layers; a 300-token BPE (about the byte alphabet) trains in a second.
LM_SHAPE = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=3, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
GPT2_SHAPE = dict(n_embd=48, n_layer=2, n_head=6, n_positions=64, bos_token_id=0, eos_token_id=0)


def _causal_lm(family: str, folder: str, llama_tokenizer) -> dict:
    import pydoc_data.topics
    from galaxy.assets import tiny_gpt2, tiny_llama, tiny_qwen2
    from transformers import LlamaConfig, LlamaForCausalLM
    llama = lambda **keys: LlamaForCausalLM(LlamaConfig(**keys, tie_word_embeddings=False))  # noqa: E731
    make, tokenizer, shape = {"llama": (llama, lambda vocab: llama_tokenizer, LM_SHAPE),
                              "qwen2": (tiny_qwen2._tiny_qwen2, lambda vocab: llama_tokenizer, LM_SHAPE),
                              "gpt2": (tiny_gpt2._tiny_gpt2, tiny_gpt2.train_tokenizer, GPT2_SHAPE)}[family]
    model_dir = tiny_llama.write_tiny_model(os.path.join(folder, "model"), make, 300, seed=1,
                                            tokenizer=tokenizer, shape=shape)
    texts = list(pydoc_data.topics.topics.values())[:BATCH * STEPS]
    train = os.path.join(folder, "train.txt")
    with open(train, "w") as f:
        f.write("".join(" ".join(t.split()[:12 - i]) + "\n" for i, t in enumerate(texts)))
    return {"dir": model_dir, "train": train, "keys": {}, "columns": [128, 64] if family == "gpt2" else [64, 32]}
