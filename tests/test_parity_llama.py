"""The decoder families (Llama, Qwen2, GPT-2) under per-sub-block plans train exactly like HF.

Llama (HF LlamaForCausalLM) and Qwen2 (HF Qwen2ForCausalLM: Llama with non-zero q/k/v biases,
sharded with their query heads / K/V groups under TP and summed under SP), tiny, with
grouped-query attention (8 query heads sharing 4 K/V heads: 2 per group); tiny GPT-2 (4 heads,
fused Q/K/V c_attn stored as Conv1D [in, out], biases and LayerNorms away from their initial
values, LM head tied to wte) against GPT2LMHeadModel. Right padding and labels that ignore it
(world 3: no padding, the plain causal mask the attention kernel applies itself).
Llama and GPT-2: all 8 ATT x MLP x CON combinations at world 2 with uneven shares (Llama: whole
K/V groups per TP rank; GPT-2: heads 3 / 1, so a rank's c_attn share is three column ranges of
HF's tensor; SP attention causal across shards with global positions), three plans at world 3,
and serial (at world 3 a TP ATT's and a TP MLP's transitions travel in 2 chunks, comm_chunks: the
chunks' projections are put back in sequence order for the causal mask and the rotary positions;
an SP ATT attends in blocks of keys, kv_blocks, under the causal mask: rank 0's later blocks are
wholly masked);
Llama's tied embeddings under both CON methods (GPT-2's are always tied); GPT-2 with
scale_attn_by_inverse_layer_idx under the Galaxy plan. Qwen2, whose difference is in ATT only:
four plans at world 2 that pair each ATT and each MLP method with both CON methods, the galaxy
and sp plans at world 3, tied embeddings and serial. Each: logits, loss, every gathered
gradient, 5 SGD steps' losses and the final gathered weights within 1e-5 relative (fp32).
Qwen2's sliding-window layers are refused.
"""
import itertools

import pytest
import torch

from support.parity import check_report, hf_qwen2, rel_err
from support.parity_runners import train_plan_and_compare
from support.tiny_models import GPT2_INTERMEDIATE, TINY_SEQ, tiny_lm_batch, tiny_lm_batch_unpadded

from galaxy.distributed.group import GalaxyGroup
from galaxy.plan import Plan
from galaxy.runtime.assemble import build_model

COMBOS = list(itertools.product(("TP", "SP"), ("TP", "SP"), ("SP", "None")))
QWEN2_COMBOS = [("TP", "SP", "SP"), ("SP", "TP", "SP"), ("TP", "TP", "None"), ("SP", "SP", "None")]
UNEVEN_2 = ((6, 2), (64, 32), (7, 5))          # query heads, MLP columns, tokens
UNEVEN_3 = ((4, 2, 2), (40, 32, 24), (5, 4, 3))
SERIAL = ((8,), (96,), (TINY_SEQ,))
# family -> shares at world 2, at world 3, serial (GPT-2: 4 heads, MLP 4 x 48)
SHARES = {
    "llama": (UNEVEN_2, UNEVEN_3, SERIAL),
    "qwen2": (UNEVEN_2, UNEVEN_3, SERIAL),
    "gpt2": (((3, 1), (120, 72), (7, 5)), ((2, 1, 1), (64, 64, 64), (5, 4, 3)),
             ((4,), (GPT2_INTERMEDIATE,), (TINY_SEQ,))),
}
WORLD3_PLANS = [("TP", "TP", "SP"), ("SP", "SP", "SP"), ("TP", "SP", "None")]
WORLD2 = ([("llama", *c) for c in COMBOS] + [("qwen2", *c) for c in QWEN2_COMBOS]
          + [("gpt2", *c) for c in COMBOS])
WORLD3 = ([("llama", *c) for c in WORLD3_PLANS] + [("qwen2", "TP", "TP", "SP"), ("qwen2", "SP", "SP", "SP")]
          + [("gpt2", *c) for c in WORLD3_PLANS])


def plan_id(family, att, mlp, con):
    return f"{family}-att{att}-mlp{mlp}-con{con}"


def check(reports):
    for rank, report in enumerate(reports):
        check_report(report, rank)


@pytest.mark.parametrize("family,att,mlp,con", WORLD2, ids=[plan_id(*c) for c in WORLD2])
def test_plan_matches_hf_world2_uneven(dist_pool, tiny_lm_dir, family, att, mlp, con):
    # Batch streams under Llama's CON SP plans (3: a row each, the middle one out of phase) and
    # GPT-2's Galaxy plan (2: the tiny batch's 3 rows in 2 and 1); the others run one stream
    streams = 3 if family == "llama" and con == "SP" else 2 if (family, att, mlp, con) == ("gpt2", "TP", "TP", "SP") else 1
    check(dist_pool(2).run(train_plan_and_compare, family, tiny_lm_dir(family), Plan(att, mlp, con),
                           SHARES[family][0], tiny_lm_batch, 5, None, {"batch_streams": streams}))


@pytest.mark.parametrize("family,att,mlp,con", WORLD3, ids=[plan_id(*c) for c in WORLD3])
def test_plan_matches_hf_world3(dist_pool, tiny_lm_dir, family, att, mlp, con):
    chunks = 2 if "TP" in (att, mlp) else 1
    streams = 2 if (family, att, mlp, con) == ("llama", "TP", "TP", "SP") else 1     # streams of chunks
    # No padding at world 3: a whole-sequence ATT (serial, TP in chunks) lets the kernel apply the
    # causal mask (CAUSAL); an SP ATT cuts the mask to its rows (the world-2 cases pad)
    check(dist_pool(3).run(train_plan_and_compare, family, tiny_lm_dir(family), Plan(att, mlp, con),
                           SHARES[family][1], tiny_lm_batch_unpadded, 5, None,
                           {"comm_chunks": chunks, "kv_blocks": att == "SP", "batch_streams": streams}))


@pytest.mark.parametrize("family,con", [("llama", "SP"), ("llama", "None"), ("qwen2", "SP")])
def test_tied_embeddings_match_hf(dist_pool, tiny_lm_dir, family, con):
    check(dist_pool(2).run(train_plan_and_compare, family, tiny_lm_dir(family, tie_word_embeddings=True),
                           Plan("TP", "TP", con), UNEVEN_2, tiny_lm_batch))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_serial_matches_hf(dist_pool, tiny_lm_dir, family):
    check(dist_pool(1).run(train_plan_and_compare, family, tiny_lm_dir(family), Plan(),
                           SHARES[family][2], tiny_lm_batch))


def test_gpt2_attention_scaled_by_inverse_layer_index_matches_hf(dist_pool, tiny_lm_dir):
    """scale_attn_by_inverse_layer_idx: layer i's scores also divided by i + 1, as HF does.
    initializer_range 0.2: scores large enough that the scaling moves the logits ~10%."""
    model_dir = tiny_lm_dir("gpt2", scale_attn_by_inverse_layer_idx=True, initializer_range=0.2)
    check(dist_pool(2).run(train_plan_and_compare, "gpt2", model_dir, Plan.preset("galaxy"),
                           SHARES["gpt2"][0], tiny_lm_batch))


def _serial_qwen2(model_dir):
    return build_model(model_dir, Plan(), GalaxyGroup.serial(8, 96, TINY_SEQ))


def test_qwen2_sliding_window_layers_are_refused(tiny_lm_dir):
    """use_sliding_window slides the layers from max_window_layers on (HF's layer_types): refused.
    With max_window_layers past the last layer no layer slides, and HF computes full attention."""
    sliding = tiny_lm_dir("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    with pytest.raises(ValueError, match=r"sliding-window attention on layers \[1\].*use_sliding_window"):
        _serial_qwen2(sliding)
    full = tiny_lm_dir("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    batch = tiny_lm_batch(0)
    with torch.no_grad():
        ours = _serial_qwen2(full)(**batch)[0]
        assert rel_err(ours, hf_qwen2(full)(**batch).logits) < 1e-5


def test_rotary_function_is_hf_rotary_bit_for_bit():
    """galaxy's one-function rotary (forward and backward) gives the bits of HF's
    apply_rotary_pos_emb, heads broadcast from [b, S, 1, d] tables, on HF's own tables."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from galaxy.layers.rotary import apply_rotary
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 7, 4, 16, generator=g), torch.randn(2, 7, 2, 16, generator=g)     # [b, S, heads, d]
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    cos, sin = LlamaRotaryEmbedding(cfg)(q, torch.arange(7).expand(2, 7))                # [b, S, d]
    ours = [t.clone().requires_grad_() for t in (q, k)]
    theirs = [t.transpose(1, 2).clone().requires_grad_() for t in (q, k)]                 # HF: [b, heads, S, d]
    out = [apply_rotary(t, cos[:, :, None], sin[:, :, None]) for t in ours]
    ref = [t.transpose(1, 2) for t in apply_rotary_pos_emb(*theirs, cos, sin)]
    grads = [torch.randn(t.shape, generator=g) for t in out]
    torch.autograd.backward(out + ref, grads + grads)
    for o, r, a, b in zip(out, ref, ours, theirs):
        assert torch.equal(o, r) and torch.equal(a.grad, b.grad.transpose(1, 2))
