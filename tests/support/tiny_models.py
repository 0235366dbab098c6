"""Tiny Hugging Face checkpoints written on the fly for fidelity tests."""
from __future__ import annotations

import torch

TINY_BERT = dict(vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                 intermediate_size=96, max_position_embeddings=64, type_vocab_size=2,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
TINY_SEQ = 12


def make_tiny_bert(path: str, seed: int = 0, **overrides) -> str:
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(seed)
    model = BertForSequenceClassification(BertConfig(**{**TINY_BERT, **overrides}))
    # Non-trivial biases and norm weights, so that every gradient rule is exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


MINILM_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def make_tiny_bert_with_minilm_tokenizer(path: str, num_labels: int, **overrides) -> str:
    """A tiny BERT classifier over all-MiniLM-L6-v2's vocabulary (30522 tokens), with the packaged
    MiniLM tokenizer's files linked into its folder: what the entry scripts read real text with."""
    import os

    from galaxy.assets.packaged_minilm import packaged_minilm_dir
    make_tiny_bert(path, **{"vocab_size": 30522, **overrides, "num_labels": num_labels})
    for name in MINILM_TOKENIZER_FILES:
        os.symlink(os.path.join(packaged_minilm_dir(), name), os.path.join(path, name))
    return path


def tiny_batch(seed: int, batch: int = 4, seq: int = TINY_SEQ, vocab: int = 120, num_labels: int = 3):
    """A batch with padding: row i keeps seq - 3*i tokens (at least 2)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for i in range(batch):
        mask[i, max(2, seq - 3 * i):] = 0
    ids[mask == 0] = 0
    types = (torch.arange(seq) >= seq // 2).long().expand(batch, seq).clone()
    labels = torch.randint(0, num_labels, (batch,), generator=g)
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)


TINY_LLAMA = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, intermediate_size=96, max_position_embeddings=64,
                  rms_norm_eps=1e-6, attention_dropout=0.0, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)


def make_tiny_llama(path: str, seed: int = 0, **overrides) -> str:
    """8 query heads sharing 4 K/V heads (grouped-query attention, 2 query heads per group)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return _save_tiny_lm(lambda: LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides})), path, seed)


def make_tiny_qwen2(path: str, seed: int = 0, **overrides) -> str:
    """Llama's tiny shape as HF Qwen2ForCausalLM: biases on q/k/v (none on o_proj or the MLP)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _save_tiny_lm(lambda: Qwen2ForCausalLM(Qwen2Config(**{**TINY_LLAMA, **overrides})), path, seed)


def _save_tiny_lm(make_model, path: str, seed: int) -> str:
    torch.manual_seed(seed)
    model = make_model()
    # Norm weights away from 1 and biases away from 0 (HF initialises them to 1 and 0), so that
    # every gradient rule is exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def make_tiny_llama_classifier(path: str, seed: int = 0, num_labels: int = 3, **overrides) -> str:
    """make_tiny_llama's model as HF LlamaForSequenceClassification (its `score` head saved too)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(LlamaConfig(**{**TINY_LLAMA, **overrides}, num_labels=num_labels))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def tiny_cls_batch(seed: int, batch: int = 3, seq: int = TINY_SEQ, vocab: int = 128, num_labels: int = 3):
    """tiny_lm_batch's right-padded rows (row i keeps seq - 4*i tokens, pad id 0) with one class
    label per row: the pooled last tokens fall on different sequence shards."""
    out = tiny_lm_batch(seed, batch, seq, vocab)
    out["labels"] = torch.randint(0, num_labels, (batch,), generator=torch.Generator().manual_seed(seed + 1000))
    return out


def tiny_lm_batch(seed: int, batch: int = 3, seq: int = TINY_SEQ, vocab: int = 128, padded: bool = True):
    """Right-padded causal-LM batch: row i keeps seq - 4*i tokens; labels ignore padding.
    padded False: every row whole (the attention mask all ones: the plain causal mask)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for i in range(batch if padded else 0):
        mask[i, max(2, seq - 4 * i):] = 0
    ids[mask == 0] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def tiny_lm_batch_unpadded(seed: int, batch: int = 3, seq: int = TINY_SEQ, vocab: int = 128):
    """tiny_lm_batch without padding (a module-level function: the process pools pickle it)."""
    return tiny_lm_batch(seed, batch, seq, vocab, padded=False)


TINY_GPT2 = dict(vocab_size=128, n_embd=48, n_layer=2, n_head=4, n_inner=None, n_positions=64,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
GPT2_INTERMEDIATE = 4 * TINY_GPT2["n_embd"]     # n_inner None: 4 x n_embd


def make_tiny_gpt2(path: str, seed: int = 0, **overrides) -> str:
    """4 heads of 12 (hidden 48), MLP 192, LM head tied to wte (GPT-2's default)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**{**TINY_GPT2, **overrides}))
    # Non-trivial biases (HF initialises them to 0) and LayerNorm weights, so that every gradient
    # rule and every fused Q/K/V bias slice is exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


# The tiny causal LMs by family (conftest's tiny_lm_dir). Llama and Qwen2 share TINY_LLAMA's shape
# (and key names, so overrides such as num_hidden_layers serve both); GPT-2's is TINY_GPT2.
MAKE_TINY_LM = {"llama": make_tiny_llama, "qwen2": make_tiny_qwen2, "gpt2": make_tiny_gpt2}


def write_sharp_lm(family: str, path: str) -> str:
    """A tiny Llama, Qwen2 or GPT-2 with galaxy.assets' BPE tokenizer (512 tokens, seed 3) whose LM
    head is scaled by 8, so greedy picks are far from ties (a random model's logits are nearly
    flat). Qwen2's and GPT-2's heads are tied to the embeddings: one tensor on disk."""
    from safetensors.torch import load_file, save_file

    from galaxy.assets.tiny_gpt2 import write_tiny_gpt2
    from galaxy.assets.tiny_llama import write_tiny_llama
    from galaxy.assets.tiny_qwen2 import write_tiny_qwen2
    write = {"llama": write_tiny_llama, "qwen2": write_tiny_qwen2, "gpt2": write_tiny_gpt2}[family]
    path = write(path, vocab_size=512, seed=3)
    state = load_file(f"{path}/model.safetensors")
    head = next(k for k in ("lm_head.weight", "model.embed_tokens.weight", "transformer.wte.weight") if k in state)
    state[head] *= 8
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    return path


# Encoder-decoders: 2 encoder and 2 decoder layers, 4 heads of 12 (d_model 48), MLP 96; source
# rows of TINY_SEQ tokens, target rows of TINY_TARGET (unequal, so that the two stacks' token
# shares differ).
TINY_TARGET = 9
TINY_BART = dict(vocab_size=128, d_model=48, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=64,
                 dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)


def make_tiny_bart(path: str, seed: int = 0, **overrides) -> str:
    """BartForConditionalGeneration, LM head tied to the shared table, a non-zero final_logits_bias."""
    from transformers import BartConfig, BartForConditionalGeneration
    torch.manual_seed(seed)
    model = BartForConditionalGeneration(BartConfig(**{**TINY_BART, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name or "layernorm" in name:
                p.add_(0.1 * torch.randn_like(p))
        model.final_logits_bias.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path


def tiny_seq2seq_batch(seed: int, batch: int = 3, seq: int = TINY_SEQ, target: int = TINY_TARGET, vocab: int = 128):
    """Right-padded source rows (row i keeps seq - 4*i tokens) and target rows (row i keeps
    target - 3*i tokens): labels ignore the target's padding, the decoder's inputs are the labels
    shifted right (start token 2), and its mask keeps the real targets."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    tgt = torch.randint(3, vocab, (batch, target), generator=g)
    tgt_mask = torch.ones(batch, target, dtype=torch.long)
    for i in range(batch):
        mask[i, max(2, seq - 4 * i):] = 0
        tgt_mask[i, max(2, target - 3 * i):] = 0
    ids[mask == 0] = 0
    labels = tgt.masked_fill(tgt_mask == 0, -100)
    decoder_input_ids = torch.cat((torch.full((batch, 1), 2), tgt[:, :-1].masked_fill(tgt_mask[:, :-1] == 0, 0)), 1)
    return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_input_ids,
                decoder_attention_mask=tgt_mask, labels=labels)


def tiny_seq2seq_unmasked(seed: int, batch: int = 3):
    """tiny_seq2seq_batch without decoder_attention_mask: the decoder attends causally over the
    whole target, as Hugging Face's does without one. (The decoder's inputs stay: the fidelity
    loop's logits call leaves the labels out. Labels alone are the trainer's batches.)"""
    return {k: v for k, v in tiny_seq2seq_batch(seed, batch).items() if k != "decoder_attention_mask"}


MAKE_TINY_LM["bart"] = make_tiny_bart


TINY_T5 = dict(vocab_size=128, d_model=48, d_kv=8, d_ff=96, num_layers=2, num_decoder_layers=2, num_heads=4,
               relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
               feed_forward_proj="relu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=2)


def make_tiny_t5(path: str, seed: int = 0, v1_1: bool = False, **overrides) -> str:
    """T5ForConditionalGeneration, 4 heads of 8 (inner width 32, not d_model 48), buckets 8 up to
    distance 16 (so that log-spaced buckets occur in 12 tokens). v1_1: gated-GELU MLP and an LM
    head of its own (a checkpoint holding lm_head.weight apart, untied, unscaled: flan-T5's form)."""
    import json
    import os

    from safetensors.torch import load_file, save_file
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(seed)
    keys = {**TINY_T5, **({"feed_forward_proj": "gated-gelu"} if v1_1 else {}), **overrides}
    model = T5ForConditionalGeneration(T5Config(**keys, tie_word_embeddings=not v1_1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    if v1_1:
        weights = os.path.join(path, "model.safetensors")
        state = load_file(weights)
        state["lm_head.weight"] = 0.05 * torch.randn_like(state["shared.weight"])
        save_file(state, weights, metadata={"format": "pt"})
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config["tie_word_embeddings"] = False
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    return path


MAKE_TINY_LM["t5"] = make_tiny_t5


# Encoder-decoder classifiers (Hugging Face's ...ForSequenceClassification): the tiny shapes above
# with a 3-class classification_head (dense, out_proj; non-zero biases).
def make_tiny_encdec_classifier(family: str, path: str, seed: int = 0, num_labels: int = 3) -> str:
    from transformers import (BartConfig, BartForSequenceClassification, T5Config,
                              T5ForSequenceClassification)
    torch.manual_seed(seed)
    if family == "bart":
        model = BartForSequenceClassification(BartConfig(**TINY_BART, num_labels=num_labels))
    else:
        model = T5ForSequenceClassification(T5Config(**TINY_T5, num_labels=num_labels))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name or "layernorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def tiny_encdec_cls_batch(seed: int, batch: int = 3, seq: int = TINY_SEQ, vocab: int = 128, eos: int = 2,
                          num_labels: int = 3):
    """Right-padded source rows (row i keeps seq - 4*i tokens, pad id 0) with two EOS tokens each,
    at position 2 and at the row's last kept token (the pooled one: 11, 7, 3 of 12, on different
    decoder shards), and one class label per row. Hugging Face's classifiers need every row to
    hold the same number of EOS tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for i in range(batch):
        kept = max(4, seq - 4 * i)
        mask[i, kept:] = 0
        ids[i, [2, kept - 1]] = eos
    ids[mask == 0] = 0
    labels = torch.randint(0, num_labels, (batch,), generator=g)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def tiny_t5_cls_batch(seed: int, batch: int = 3):
    """tiny_encdec_cls_batch with TINY_T5's EOS id (1)."""
    return tiny_encdec_cls_batch(seed, batch, eos=TINY_T5["eos_token_id"])
