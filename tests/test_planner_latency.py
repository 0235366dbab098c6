"""plan.py search --objective latency: one request's prefill and decode time by hand on synthetic
profiles, the search giving the quicker device more of the work, every rank's KV cache equal to
what galaxy.inference allocates for the same plan, and the refusals; an encoder classifier's one
forward by hand, and its forward-only device entry. The end-to-end runs (a searched config that
generate.py runs at world 2 with Hugging Face's tokens, one that pretrain_galaxy.py --predict runs
with Hugging Face's probabilities) are in tests/test_inference_scripts.py."""
import json
import os
from dataclasses import replace

import pytest
import torch
from support.script_runner import run_script

from galaxy.distributed.group import GalaxyGroup
from galaxy.layers.kv_cache import open_caches
from galaxy.plan import Plan
from galaxy.planner import cli
from galaxy.planner.chunked_prefill import flow_shop
from galaxy.planner.encoder_latency import EncoderLatencyCostModel
from galaxy.planner.latency_cost import LatencyCostModel
from galaxy.planner.latency_devices import search_subsets
from galaxy.planner.latency_search import search_latency
from galaxy.planner.profiles import check_cluster, check_link
from galaxy.planner.search import Searcher
from galaxy.runtime.assemble import build_model

# tiny-llama's shape (models/tiny-llama): hidden 128, 4 heads of 32 in 2 K/V groups, 344 MLP columns
H, HEADS, KV, D, COLS, LAYERS, SEQ = 128, 4, 2, 32, 344, 4, 24
ATT_F, MLP_F, HEAD_F = 4e6, 6e6, 3e6        # forward matrix FLOPs per row at SEQ tokens, whole sub-blocks
PROJ = 2 * H * (HEADS * D + 2 * KV * D) + 2 * HEADS * D * H      # one token's q, k, v and o products
MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
TINY_T5, TINY_LLAMA = os.path.join(MODELS, "tiny-t5"), os.path.join(MODELS, "tiny-llama")
MINILM = os.path.join(MODELS, "all-MiniLM-L6-v2")
FREE_LINK = check_link({"latency_s": 0.0, "bytes_per_s": 1e18}, "free link")


def causal_lm_profile():
    """A hand-written model profile of a causal LM of tiny-llama's shape: FLOPs in ATT, MLP and the head."""
    flops = lambda f: {"fwd": f, "bwd": 2 * f, "fwd_elementwise": 0, "bwd_elementwise": 0}  # noqa: E731
    return {
        "format": "galaxy-model-profile", "version": 1, "model_type": "llama", "family": "llama",
        "task": "causal_lm", "pad_size": SEQ, "dropout": 0.0,
        "hf_config": {"model_type": "llama", "hidden_size": H, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
                      "num_key_value_heads": KV, "head_dim": D, "intermediate_size": COLS, "vocab_size": 1000,
                      "max_position_embeddings": 512},
        "carry_tensors": 1,
        "units": {"att_tp": [HEADS, HEADS // KV], "att_sp": [SEQ, 1], "mlp_tp": [COLS, 1], "mlp_sp": [SEQ, 1],
                  "con": [SEQ, 1], "embed": [SEQ, SEQ], "head": [SEQ, 1]},
        "params": {"embed": 1000, "head": 2000, "tied": 0, "other": 0, "total": 3000 + LAYERS * 100 * (HEADS + COLS),
                   "layer": {"att_tp": [0, 100], "mlp_tp": [0, 100], "att_sp": 100 * HEADS, "mlp_sp": 100 * COLS,
                             "con": 0}},
        "act_bytes_per_row": {k: [0, 0] for k in ("att_tp", "att_sp", "mlp_tp", "mlp_sp", "con", "embed", "head")},
        "flops_per_row": {"att": flops(ATT_F), "mlp": flops(MLP_F), "con": flops(0), "head": flops(HEAD_F)},
    }


def device(rate, memory=1e6, name=None):
    return {"name": name or f"{rate:g} FLOP/s", "gemm_flops_per_s": rate, "memory_mib": memory, "baseline_mib": 0.0}


def plan(att, mlp, con, heads, columns, tokens, stages=(LAYERS,)):
    return Plan(att=att, mlp=mlp, con=con, pp=len(stages), dp=1, heads=heads, columns=columns, tokens=tokens,
                stages=stages, microbatches=1, schedule="1f1b", checkpoint=(), dp_sharding="none")


def test_prefill_and_decode_by_hand():
    """Two devices at 2R and R. TP ATT and MLP, CON None: the prompt's N tokens are not padded to
    pad_size, so the prefill is N / SEQ of each profiled sub-block at the slower rank's share; each
    of the M - 1 decode steps runs one token, its projections at the rank's heads and 4 d FLOPs per
    head and key over the N + k + 1 keys of step k; the prefill's LM head runs on one token on the
    sampler (the last rank), a decode step's is split by vocabulary rows in proportion to the MLP
    columns (669 and 331 of 1000). A link of latency lat (no bandwidth cost, nothing measured) adds
    per pass two one-token sums a layer priced as all-reduces (2 (n - 1) steps each), to the
    prefill the token's broadcast (n - 1 steps), to a decode step the logits' all-gather (every rank
    then chooses the token: no broadcast). A pipeline of the two devices
    (3 layers, then 1) adds its stages' times: at batch 1 nothing overlaps."""
    R, N, M, lat = 1e9, 12, 5, 1e-4
    rate = (2 * R, R)
    cost = LatencyCostModel(causal_lm_profile(), [device(r) for r in rate], FREE_LINK, prompt_tokens=N, new_tokens=M)
    heads, cols = (2, 2), (230, 114)
    est = cost.estimate(plan("TP", "TP", "None", heads, cols, (12, 12)))
    layer = max(ATT_F * h / HEADS / r for h, r in zip(heads, rate)) + max(MLP_F * c / COLS / r for c, r in zip(cols, rate))
    prefill = LAYERS * layer * N / SEQ + HEAD_F / SEQ / R
    assert est.prefill_s == pytest.approx(prefill, rel=1e-9)
    split_head = max(669 / 1000 / (2 * R), 331 / 1000 / R) * HEAD_F / SEQ
    steps = [LAYERS * (max((PROJ * h / HEADS + 4 * h * D * (N + k + 1)) / r for h, r in zip(heads, rate))
                       + max(MLP_F / SEQ * c / COLS / r for c, r in zip(cols, rate))) + split_head
             for k in range(M - 1)]
    assert est.decode_s_per_token == pytest.approx(sum(steps) / (M - 1), rel=1e-9)
    assert est.step_s == pytest.approx(prefill + sum(steps), rel=1e-9)

    slow = LatencyCostModel(causal_lm_profile(), [device(r) for r in rate], check_link(
        {"latency_s": lat, "bytes_per_s": 1e18}, "link"), prompt_tokens=N, new_tokens=M)
    passes = 1 + (M - 1)
    again = slow.estimate(plan("TP", "TP", "None", heads, cols, (12, 12)))
    assert again.step_s - est.step_s == pytest.approx(passes * LAYERS * 2 * 2 * lat + lat + (M - 1) * lat, rel=1e-6)

    pipe = cost.estimate(plan("TP", "TP", "SP", (HEADS,), (COLS,), (SEQ,), stages=(3, 1)))
    whole = (ATT_F + MLP_F) * N / SEQ
    assert pipe.prefill_s == pytest.approx(3 * whole / (2 * R) + whole / R + HEAD_F / SEQ / R, rel=1e-9)
    step = lambda k, layers, r: layers * ((PROJ + 4 * HEADS * D * (N + k + 1)) + MLP_F / SEQ) / r  # noqa: E731
    assert pipe.decode_s_per_token * (M - 1) == pytest.approx(
        sum(step(k, 3, 2 * R) + step(k, 1, R) + HEAD_F / SEQ / R for k in range(M - 1)), rel=1e-9)

    # a profile's rate on one token (decode_flops_per_s) times the decode steps, not its GEMM rate;
    # the prefill keeps the GEMM rate
    weight_bound = LatencyCostModel(causal_lm_profile(), [{**device(r), "decode_flops_per_s": r / 4} for r in rate],
                                    FREE_LINK, prompt_tokens=N, new_tokens=M)
    slower = weight_bound.estimate(plan("TP", "TP", "None", heads, cols, (12, 12)))
    assert slower.decode_s_per_token == pytest.approx(4 * est.decode_s_per_token, rel=1e-9)
    assert slower.prefill_s == pytest.approx(est.prefill_s, rel=1e-9)


def test_an_sp_mlp_decodes_its_decode_columns_by_hand():
    """ATT TP, MLP SP, CON None on devices at 2R and R: the prompt is padded to pad_size (tokens are
    split), so step k attends to SEQ + k + 1 keys; each rank's MLP runs its decode columns (the
    plan's decode_columns, 260 and 84, not the 230 / 114 columns a TP MLP would take) at its rate,
    and the split head's vocabulary rows follow them (756 and 244 of 1000). A link of latency lat
    adds a step two one-token sums a layer (the SP MLP's as a TP MLP's, priced as all-reduces) and
    the logits' all-gather. The search moves the decode columns to the
    quicker rank."""
    R, N, M, lat = 1e9, 12, 5, 1e-4
    rate, heads, dcols = (2 * R, R), (2, 2), (260, 84)
    split = replace(plan("TP", "SP", "None", heads, (230, 114), (12, 12)), decode_columns=dcols)
    est = LatencyCostModel(causal_lm_profile(), [device(r) for r in rate], FREE_LINK, prompt_tokens=N,
                           new_tokens=M).estimate(split)
    split_head = max(756 / 1000 / (2 * R), 244 / 1000 / R) * HEAD_F / SEQ
    steps = [LAYERS * (max((PROJ * h / HEADS + 4 * h * D * (SEQ + k + 1)) / r for h, r in zip(heads, rate))
                       + max(MLP_F / SEQ * c / COLS / r for c, r in zip(dcols, rate))) + split_head
             for k in range(M - 1)]
    assert est.decode_s_per_token == pytest.approx(sum(steps) / (M - 1), rel=1e-9)
    slow = LatencyCostModel(causal_lm_profile(), [device(r) for r in rate], check_link(
        {"latency_s": lat, "bytes_per_s": 1e18}, "link"), prompt_tokens=N, new_tokens=M).estimate(split)
    assert slow.decode_s_per_token - est.decode_s_per_token == pytest.approx(LAYERS * 2 * 2 * lat + lat, rel=1e-6)

    cost = LatencyCostModel(causal_lm_profile(), [device(r) for r in rate], FREE_LINK, prompt_tokens=SEQ,
                            new_tokens=8)
    best = Searcher(cost, [1e6, 1e6], meshes=[(1, 1)], methods=[("TP", "SP", "SP")]).run(1).ranked[0].plan
    assert best.decode_columns[0] > 1.8 * best.decode_columns[1], best
    assert best.to_keys()["decode_intermediate_size_list"] == list(best.decode_columns)


def decode_section(scale):
    """A measured decode section (galaxy.planner.decode_profile) by hand, every figure linear in its
    units (so the planner's interpolation is exact) and times `scale`: ATT 2e-3 s at 2 heads and
    3e-3 at 4 with K = 24 keys cached, the MLP 1e-4 + 1e-6 per column, the head 1e-5 + 1e-7 per
    vocabulary row, a CON 2e-4, the whole layer its sub-blocks + 5e-4 of glue, the embedding 3e-4,
    the sampler 4e-4."""
    mlp = lambda u: (1e-4 + 1e-6 * u) * scale    # noqa: E731
    head = lambda u: (1e-5 + 1e-7 * u) * scale   # noqa: E731
    return {"keys": SEQ, "statistic": "median",
            "att_tp": {"units": [2, 4], "s": [2e-3 * scale, 3e-3 * scale]},
            "mlp_tp": {"units": [1, 172, COLS], "s": [mlp(1), mlp(172), mlp(COLS)]},
            "head": {"units": [1, 500, 1000], "s": [head(1), head(500), head(1000)]},
            "con_s": 2e-4 * scale, "layer_s": 3e-3 * scale + mlp(COLS) + 2 * 2e-4 * scale + 5e-4 * scale,
            "embed_s": 3e-4 * scale, "sampler_s": 4e-4 * scale}


def test_measured_decode_steps_and_one_token_calls():
    """Devices with measured decode sections (profile-devices --objective latency), the fast one's
    times half the slow one's: a decode step takes per layer each piece at its slowest rank's
    share (ATT at its heads, a line in its keys: the measured time at K keys plus 4 x heads_r x d
    FLOPs per key more at the one-token rate; the MLP at its columns; two CONs and the layer's
    glue), the embedding, the LM head split by vocabulary rows (669 and 331), the sampler's
    choice; the prefill's head is the measured head on one token and the sampler. The link's
    measured one-token sum (token_sum) and broadcast (the prefill's; a decode step has none)
    replace the all-reduce and all-gather its fit would price (latency lat), and the split
    head's greedy pick (16 bytes: the one-token sum's time) replaces the logits' all-gather."""
    R, N, M, lat = 1e9, 12, 5, 1e-2
    devices = [{**device(2 * R), "decode_flops_per_s": 2 * R, "decode": decode_section(0.5)},
               {**device(R), "decode_flops_per_s": R, "decode": decode_section(1.0)}]
    cost = LatencyCostModel(causal_lm_profile(), devices, FREE_LINK, prompt_tokens=N, new_tokens=M)
    heads, cols, vocab = (2, 2), (230, 114), (669, 331)
    est = cost.estimate(plan("TP", "TP", "None", heads, cols, (12, 12)))
    scale, rate = (0.5, 1.0), (2 * R, R)
    att = lambda j, keys: 2e-3 * scale[j] + 4 * heads[j] * D * (keys - SEQ) / rate[j]   # noqa: E731
    mlp = max((1e-4 + 1e-6 * c) * f for c, f in zip(cols, scale))
    rest = 2 * 2e-4 + 5e-4                       # two CONs and the glue, on the slower device
    steps = [LAYERS * (max(att(j, N + k + 1) for j in range(2)) + mlp + rest) + 3e-4
             + max((1e-5 + 1e-7 * v) * f for v, f in zip(vocab, scale)) + 4e-4 for k in range(M - 1)]
    assert est.decode_s_per_token == pytest.approx(sum(steps) / (M - 1), rel=1e-9)
    layer = max(ATT_F * h / HEADS / r for h, r in zip(heads, rate)) + max(MLP_F * c / COLS / r for c, r in zip(cols, rate))
    assert est.prefill_s == pytest.approx(LAYERS * layer * N / SEQ + (1e-5 + 1e-7 * 1000) + 4e-4, rel=1e-9)

    token_sum, broadcast = 2e-4, 1e-4
    link = check_link({"latency_s": lat, "bytes_per_s": 1e18, "measured": [
        {"kind": "token_sum", "group": 2, "bytes": 4096, "uneven": False, "seconds": token_sum},
        {"kind": "token_sum", "group": 2, "bytes": 16384, "uneven": False, "seconds": 2 * token_sum},
        {"kind": "broadcast", "group": 2, "bytes": 16, "uneven": False, "seconds": broadcast}]}, "link")
    slow = LatencyCostModel(causal_lm_profile(), devices, link, prompt_tokens=N, new_tokens=M)
    again = slow.estimate(plan("TP", "TP", "None", heads, cols, (12, 12)))
    # [1, h] is 512 bytes, under the smallest measured: its time; so is the head's 16-byte pick
    assert again.decode_s_per_token - est.decode_s_per_token == pytest.approx(
        LAYERS * 2 * token_sum + token_sum, rel=1e-9)
    assert again.prefill_s - est.prefill_s == pytest.approx(LAYERS * 2 * 2 * lat + broadcast, rel=1e-9)


def test_a_pipeline_prefill_in_chunks_by_hand():
    """Two devices at 2R and R with measured decode sections (a layer's one-token step: layer_s
    less its keys' 4 x heads x d FLOPs each), a link of latency lat and B bytes/s, stages 3 / 1,
    N = 12 tokens in 3 chunks of 4. Each chunk takes at stage 0 its 3 layers at 4 / SEQ of the
    profiled sub-blocks and 3 one-token layer steps (each pass reads the weights once more), on
    the link lat + its carry [1, 4, H] fp32 / B, at stage 1 its layer and 1 step; the stages and the link
    take the chunks in order, so the prefill is their sum + 2 x the slowest (fill, drain and two
    turns), then the sampler's head and the token's broadcast over the pipeline. Unchunked: each
    stage and the link once at 12 tokens, no step. The search's cost model takes the quickest
    count of 1, 2, 4, 8 (at most N): 1 where a layer's pass costs more than the overlap saves; a
    plan that splits tokens runs its prompt whole."""
    R, N, M, lat, B, scale = 1e9, 12, 5, 1e-3, 1e6, (0.05, 0.1)
    devices = [{**device(r), "decode_flops_per_s": r, "decode": decode_section(f)} for r, f in zip((2 * R, R), scale)]
    link = check_link({"latency_s": lat, "bytes_per_s": B}, "link")
    cost = LatencyCostModel(causal_lm_profile(), devices, link, prompt_tokens=N, new_tokens=M)
    pipe = plan("TP", "TP", "SP", (HEADS,), (COLS,), (SEQ,), stages=(3, 1))
    layer = ATT_F + MLP_F                          # FLOPs per layer at SEQ tokens
    stage0 = lambda c: 3 * layer * c / SEQ / (2 * R)      # noqa: E731
    stage1 = lambda c: layer * c / SEQ / R               # noqa: E731
    hop = lambda c: lat + c * H * 4 / B                  # noqa: E731
    after = ((1e-5 + 1e-7 * 1000) + 4e-4) * scale[1] + (lat + 16 / B)   # the head and sampler, the broadcast
    layer_pass = lambda j: decode_section(scale[j])["layer_s"] - 4 * HEADS * D * SEQ / (2 * R, R)[j]  # noqa: E731
    chunk = [stage0(4) + 3 * layer_pass(0), hop(4), stage1(4) + layer_pass(1)]
    chunked = cost.estimate(replace(pipe, prefill_chunks=3))
    assert chunked.prefill_s == pytest.approx(sum(chunk) + 2 * max(chunk) + after, rel=1e-9)
    whole = cost.estimate(pipe)
    assert whole.prefill_s == pytest.approx(stage0(N) + hop(N) + stage1(N) + after, rel=1e-9)
    assert chunked.prefill_s < whole.prefill_s and chunked.decode_s_per_token == whole.decode_s_per_token
    assert flow_shop([[1.0, 5.0], [3.0, 1.0]]) == 7.0      # chunk 1 waits for the second resource

    search = LatencyCostModel(causal_lm_profile(), devices, link, prompt_tokens=N, new_tokens=M, choose_chunks=True)
    chosen = search.estimate(pipe)
    trials = {c: cost.estimate(replace(pipe, prefill_chunks=c)).prefill_s for c in (1, 2, 4, 8)}
    assert chosen.plan.prefill_chunks == min(trials, key=trials.get) > 1
    assert chosen.prefill_s == pytest.approx(min(trials.values()), rel=1e-12)
    heavy = [{**d, "decode": decode_section(10 * f)} for d, f in zip(devices, scale)]   # a pass dearer than the overlap
    assert LatencyCostModel(causal_lm_profile(), heavy, link, prompt_tokens=N, new_tokens=M,
                            choose_chunks=True).estimate(pipe).plan.prefill_chunks == 1
    tokens_split = plan("TP", "TP", "SP", (2, 2), (172, 172), (12, 12))
    assert search.estimate(tokens_split).plan.prefill_chunks == 1
    assert cost.estimate(replace(tokens_split, prefill_chunks=4)).prefill_s == cost.estimate(tokens_split).prefill_s


def token_tables(scale):
    """A forward-only compute table by hand (device profile "compute", at pad_size SEQ), times
    `scale`: ATT 4 ms at every head (TP), MLP 6 ms (TP, all columns); the token-indexed kinds at 8
    and 24 tokens, dearer per token at 8 (a pass of few tokens): ATT SP 2 / 4 ms, MLP SP 3 / 6 ms,
    a CON 0.1 / 0.2 ms; the embedding 0.3 ms."""
    def kind(units, secs):
        return {"units": units, "fwd_s": [[t * scale] for t in secs], "bwd_s": [[0.0] for _ in secs]}
    return {"rows": [1], "forward_only": True, "kinds": {
        "att_tp": kind([2, 4], [4e-3, 4e-3]), "mlp_tp": kind([COLS], [6e-3]), "att_sp": kind([8, SEQ], [2e-3, 4e-3]),
        "mlp_sp": kind([8, SEQ], [3e-3, 6e-3]), "con": kind([8, SEQ], [1e-4, 2e-4]), "embed": kind([SEQ], [3e-4])},
        "model": {"model_type": "llama", "hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV,
                  "intermediate_size": COLS, "vocab_size": 1000, "pad_size": SEQ}}


def test_a_chunk_takes_its_measured_share_of_the_whole_prompt():
    """Devices whose profile timed the sub-blocks at token counts (their tables, the fast one's
    times half the slow one's), stages 3 / 1, a prompt of SEQ = 24 tokens in 3 chunks of 8: a
    chunk's sub-block takes its whole-prompt time at the rank's share times the ratio of its
    token-indexed kind at 8 and at 24 tokens (ATT 2 / 4, the MLP 3 / 6: half the whole prompt's,
    not a third), a CON its time at 8 tokens, the embedding a third; no one-token layer step on
    top. The stages and the link take the chunks in order (the flow shop of the test above)."""
    R, M, lat, B, scale = 1e9, 5, 1e-3, 1e6, (0.5, 1.0)
    devices = [{**device(r), "compute": token_tables(f)} for r, f in zip((2 * R, R), scale)]
    link = check_link({"latency_s": lat, "bytes_per_s": B}, "link")
    cost = LatencyCostModel(causal_lm_profile(), devices, link, prompt_tokens=SEQ, new_tokens=M)
    pipe = plan("TP", "TP", "SP", (HEADS,), (COLS,), (SEQ,), stages=(3, 1))
    layer = lambda f, c: f * ((4e-3 * 2 / 4 + 6e-3 * 3 / 6 + 2 * 1e-4) if c == 8 else (4e-3 + 6e-3 + 2 * 2e-4))  # noqa: E731
    hop = lambda c: lat + c * H * 4 / B                  # noqa: E731
    after = HEAD_F / SEQ / R + lat + 16 / B              # the sampler's head on one token (FLOPs), the broadcast
    chunk = [3 * layer(0.5, 8) + 0.5 * 3e-4 * 8 / SEQ, hop(8), layer(1.0, 8)]
    chunked = cost.estimate(replace(pipe, prefill_chunks=3))
    assert chunked.prefill_s == pytest.approx(sum(chunk) + 2 * max(chunk) + after, rel=1e-9)
    whole = cost.estimate(pipe)
    assert whole.prefill_s == pytest.approx(3 * layer(0.5, SEQ) + 0.5 * 3e-4 + hop(SEQ) + layer(1.0, SEQ) + after,
                                            rel=1e-9)
    assert chunked.sub_block_s and not any("PASS" in sub for sub in chunked.sub_block_s)


def test_sequence_parallel_attention_decodes_against_its_own_keys():
    """ATT SP, MLP SP, CON SP on equal devices: the prompt is padded to pad_size (16 and 8 tokens),
    every rank projects each decoded token with all heads and attends to its prompt tokens and the
    decoded tokens it owns (step k's goes to rank k mod 2); its MLP runs its decode columns, by
    default in proportion to the tokens (229 and 115 of 344), and the decode step's LM head
    follows them (666 and 334 of 1000)."""
    R, N, M = 1e9, 10, 4
    cost = LatencyCostModel(causal_lm_profile(), [device(R), device(R)], FREE_LINK, prompt_tokens=N, new_tokens=M)
    est = cost.estimate(plan("SP", "SP", "SP", (2, 2), (172, 172), (16, 8)))
    assert est.prefill_s == pytest.approx(LAYERS * (ATT_F + MLP_F) * 16 / SEQ / R + HEAD_F / SEQ / R, rel=1e-9)
    owned = [[1, 0], [1, 1], [2, 1]]                # decoded keys per rank after steps 0, 1, 2
    steps = [LAYERS * (PROJ + 4 * HEADS * D * max(16 + owned[k][0], 8 + owned[k][1]) + MLP_F / SEQ * 229 / COLS) / R
             + HEAD_F / SEQ / R * 666 / 1000 for k in range(M - 1)]
    assert est.decode_s_per_token * (M - 1) == pytest.approx(sum(steps), rel=1e-9)


def test_search_gives_the_quicker_device_more_work():
    """Speeds 3:1 on a free link, one Galaxy group: every split the best plan uses gives rank 0
    more; a pipeline is dearer (its stages add up) and ranks below."""
    R = 1e9
    cost = LatencyCostModel(causal_lm_profile(), [device(3 * R), device(R)], FREE_LINK, prompt_tokens=SEQ,
                            new_tokens=8)
    result = search_latency(cost, [1e6, 1e6], top=40)
    best = result.ranked[0].plan
    assert best.pp == 1 and best.dp == 1 and all(e.plan.dp == 1 for e in result.ranked)
    shares = [getattr(best, name) for name in ("heads", "columns", "tokens") if best.uses(name)]
    assert shares and all(s[0] > s[1] for s in shares), best
    assert any(e.plan.pp == 2 for e in result.ranked)


def test_search_leaves_out_only_a_device_that_slows_every_plan():
    """Three equal devices. On a free link every subset's quickest plan is slower than the three
    together's: all are used. With rank 2 on a slow link (per-pair sends: 0-1 at 1e9 B/s, rank 2's
    pairs at 1e5; the world's fit at 1e5, a subgroup's bytes at its own slowest pair's rate),
    every plan that uses rank 2 moves activations over its link and loses to ranks 0 and 1
    together: the search leaves rank 2 out. Either way the chosen subset's request is the quickest
    of the seven searched, and its link is the pair's (renumbered 0-1)."""
    R = 1e9
    devices, budgets = [device(R), device(R), device(R)], [1e6] * 3
    free = search_subsets(causal_lm_profile(), devices, FREE_LINK, budgets, prompt=SEQ, new=8)
    assert len(free) == 7 and free[0][0] == (0, 1, 2)
    slow = {"latency_s": 1e-5, "bytes_per_s": 1e5}
    pairs = [{"ranks": [0, 1], "latency_s": 1e-5, "bytes_per_s": 1e9}, {"ranks": [0, 2], **slow},
             {"ranks": [1, 2], **slow}]
    link = check_link({**slow, "pairs": pairs}, "link")
    found = search_subsets(causal_lm_profile(), devices, link, budgets, prompt=SEQ, new=8)
    ranks, result, cost = found[0]
    assert ranks == (0, 1) and cost.link["pairs"] == [{**pairs[0], "ranks": [0, 1]}]
    assert cost.link["fit"]["all_gather"]["bytes_per_s"] == pytest.approx(1e9)
    best = {r: res.ranked[0].step_s for r, res, _ in found}
    assert result.ranked[0].step_s == min(best.values()) < best[(0, 1, 2)]
    assert [r for r, _, _ in search_subsets(causal_lm_profile(), devices, link, budgets, prompt=SEQ, new=8,
                                            every_device=True)] == [(0, 1, 2)]


def test_cache_memory_is_what_inference_allocates():
    """Each rank's predicted KV cache equals the bytes galaxy.layers.kv_cache.open_caches allocates
    on the model galaxy.runtime builds for that rank and stage (no process group: shapes only)."""
    path = TINY_LLAMA
    N, M = 10, 7
    cost = LatencyCostModel(causal_lm_profile(), [device(1e9), device(1e9)], FREE_LINK, prompt_tokens=N, new_tokens=M)
    cases = [(plan("TP", "TP", "SP", (HEADS,), (COLS,), (SEQ,), stages=(3, 1)), 0, 0),       # serial stage
             (plan("TP", "TP", "None", (2, 2), (200, 144), (12, 12)), 0, 1),                  # its K/V group
             (plan("SP", "TP", "SP", (2, 2), (200, 144), (16, 8)), 0, 0)]                     # its tokens
    for p, stage, j in cases:
        group = GalaxyGroup(j, p.group, None, p.heads, p.columns, p.tokens)
        first, last = stage == 0, stage == p.pp - 1
        model = build_model(path, p, group, task="causal_lm",
                            stage=None if p.pp == 1 else (p.stage_layers()[stage], first, last))
        caches = open_caches(model, 1, cost.prefill_tokens(p), M, torch.float32, "cpu")
        assert cost.cache_bytes(p, stage, j) == caches.nbytes, p
        assert cost.cache_mib(p)[stage * p.group + j] * 2 ** 20 == pytest.approx(caches.nbytes)


def _base(tmp_path, model_dir) -> str:
    path = tmp_path / "base.json"
    path.write_text(json.dumps({"model_path": model_dir, "pad_size": SEQ, "batch_size": 2}))
    return str(path)


@pytest.mark.parametrize("extra, words", [
    (["--dp", "2"], "--objective latency plans dp 1 only"),
    (["--prompt_tokens", "30"], "--prompt_tokens 30 must be from 1 to the config's pad_size 24"),
    (["--new_tokens", "0"], "--new_tokens must be at least 1"),
    (["--memory_mib", "0.1"], "no plan fits the memory budgets for a 24-token prompt and 64 new tokens; under"),
    (["--objective", "step", "--new_tokens", "8"], "--prompt_tokens and --new_tokens size a generation request"),
])
def test_bad_latency_requests_are_one_line_exit_2(tmp_path, capsys, extra, words):
    model = tmp_path / "model.json"
    model.write_text(json.dumps(causal_lm_profile()))
    devices = tmp_path / "devices.json"
    devices.write_text(json.dumps({"format": "galaxy-devices", "version": 1, "devices": [device(1e9), device(1e9)],
                                   "link": {"latency_s": 1e-5, "bytes_per_s": 1e9}}))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["search", "--objective", "latency", "--config_file", _base(tmp_path, TINY_LLAMA),
                  "--devices", str(devices), "--model", str(model), "--out", str(tmp_path / "x.json"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and words in err[0], err


def test_latency_profile_on_two_gloo_ranks_plans_generation_only(tmp_path, capsys):
    """profile-devices --objective latency on tiny Llama, 2 gloo ranks: the forward-only table (no
    backward timed, no LM head over every token, no optimizer), the decode section's pieces at
    their share grids, the profile's own peak, the link's one-token calls; search --objective
    latency plans from it, and a training search refuses it in one line, exit 2."""
    base = _base(tmp_path, TINY_LLAMA)
    out = tmp_path / "devices.json"
    stdout = run_script(["plan.py", "profile-devices"], base, 2, "--out", str(out), "--quick", "--objective", "latency")
    assert f"wrote {out}" in stdout[0] and "profile's peak" in stdout[0]
    doc = check_cluster(json.loads(out.read_text()), str(out))
    for d in doc["devices"]:
        assert d["objective"] == "latency" and not d["optimizer_s_per_param"]
        table = d["compute"]
        assert table["forward_only"] and set(table["kinds"]) == {"att_tp", "att_sp", "mlp_tp", "mlp_sp", "con", "embed"}
        assert all(t == [0.0] for k in table["kinds"].values() for t in k["bwd_s"])
        assert all(t[0] > 0 for k in table["kinds"].values() for t in k["fwd_s"])
        # the token-indexed kinds also at every chunk size the search tries (24 tokens in 2 .. 16)
        assert all({12, 6, 3, 2} <= set(table["kinds"][k]["units"]) for k in ("att_sp", "mlp_sp", "con"))
        dec = d["decode"]
        assert dec["keys"] == SEQ and dec["att_tp"]["units"] == [2, 4] and dec["mlp_tp"]["units"] == [1, 172, COLS]
        assert dec["head"]["units"][-1] == 2048 and min(dec["layer_s"], dec["embed_s"], dec["sampler_s"]) > 0
        assert 0 < d["profile_peak_mib"] < 2000
    calls = {(m["kind"], m["bytes"]) for m in doc["link"]["measured"]}
    assert {("token_sum", 4096), ("token_sum", 1024), ("broadcast", 16)} <= calls
    model = str(tmp_path / "model.json")
    cli.main(["profile-model", "--config_file", base, "--out", model])
    search = ["search", "--config_file", base, "--devices", str(out), "--model", model, "--out", str(tmp_path / "p.json")]
    cli.main([*search, "--objective", "latency", "--new_tokens", "4"])
    assert json.loads((tmp_path / "p.json").read_text())["_planned"]["objective"] == "latency"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(search)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "profiled with --objective latency" in err[0], err


def test_encoder_decoders_are_refused(tmp_path, capsys):
    """Before any profile is read: one line, exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["search", "--objective", "latency", "--config_file", _base(tmp_path, TINY_T5),
                  "--devices", "absent.json", "--model", "absent.json", "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1
    assert "--objective latency plans causal LMs and encoder classifiers only so far" in err[0]


# all-MiniLM-L6-v2's shape (models/all-MiniLM-L6-v2): hidden 384, 12 heads, 1536 MLP columns, 6 layers
EH, EHEADS, ECOLS, ELAYERS = 384, 12, 1536, 6


def encoder_profile():
    """A hand-written model profile of a BERT classifier of MiniLM's shape: FLOPs in ATT, MLP and the
    head (the pooler and classifier: one token, whatever the share), weights of 100 per unit."""
    doc = causal_lm_profile()
    hf = {"model_type": "bert", "hidden_size": EH, "num_hidden_layers": ELAYERS, "num_attention_heads": EHEADS,
          "intermediate_size": ECOLS, "vocab_size": 1000, "max_position_embeddings": 512}
    units = {**doc["units"], "att_tp": [EHEADS, 1], "mlp_tp": [ECOLS, 1]}
    layer = {**doc["params"]["layer"], "att_sp": 100 * EHEADS, "mlp_sp": 100 * ECOLS}
    return {**doc, "model_type": "bert", "family": "bert", "task": "classification", "num_labels": 2, "hf_config": hf,
            "units": units, "params": {**doc["params"], "total": 3000 + ELAYERS * 100 * (EHEADS + ECOLS),
                                       "layer": layer}}


def test_encoder_request_is_one_forward_by_hand():
    """A classifier's request (MiniLM's shape) on devices at 2R and R: each layer's sub-blocks at
    the slower rank's share over all pad_size tokens (predict.py pads every input), then the pooler
    and classifier once, on rank 0 (its rate); no decode, no cache. A link of latency lat adds
    under TP two all-reduces a layer (2 ring steps each); under SP-everywhere (16 / 8 tokens: equal
    times) one K/V all-gather a layer and the [CLS] candidates' all-gather (1 step each); a
    pipeline (4 layers, then 2) its send and the logits' two broadcasts back to the first stage,
    the head on the last stage's rank. Memory is the weights and the carry [1, pad_size, h] (no
    activations in this profile), and the search gives the quicker device the larger shares."""
    R, lat = 1e9, 1e-4
    rate, link = (2 * R, R), check_link({"latency_s": lat, "bytes_per_s": 1e18}, "link")
    cost = EncoderLatencyCostModel(encoder_profile(), [device(r) for r in rate], FREE_LINK)
    slow = EncoderLatencyCostModel(encoder_profile(), [device(r) for r in rate], link)
    heads, cols = (8, 4), (1000, 536)
    tp = plan("TP", "TP", "None", heads, cols, (12, 12), stages=(ELAYERS,))
    layer = max(ATT_F * h / EHEADS / r for h, r in zip(heads, rate)) + max(MLP_F * c / ECOLS / r
                                                                           for c, r in zip(cols, rate))
    est = cost.estimate(tp)
    assert est.step_s == est.prefill_s == pytest.approx(ELAYERS * layer + HEAD_F / (2 * R), rel=1e-9)
    assert est.decode_s_per_token == 0 and est.cache_mib == [0.0, 0.0]
    assert slow.estimate(tp).step_s - est.step_s == pytest.approx(ELAYERS * 2 * 2 * lat, rel=1e-6)
    for j in range(2):
        assert est.memory_mib[j] == pytest.approx((cost.params_of(tp, 0, j) + SEQ * EH) * 4 / 2 ** 20, rel=1e-9)

    sp = slow.estimate(plan("SP", "SP", "SP", heads, cols, (16, 8), stages=(ELAYERS,)))
    assert sp.step_s == pytest.approx(ELAYERS * ((ATT_F + MLP_F) * 8 / SEQ / R + lat) + lat + HEAD_F / (2 * R),
                                      rel=1e-6)
    pipe = slow.estimate(plan("TP", "TP", "SP", (EHEADS,), (ECOLS,), (SEQ,), stages=(4, 2)))
    whole = ATT_F + MLP_F
    assert pipe.step_s == pytest.approx(4 * whole / (2 * R) + 2 * whole / R + HEAD_F / R + lat + 2 * lat, rel=1e-6)

    best = search_latency(cost, [1e6, 1e6], top=10).ranked[0].plan
    shares = [getattr(best, name) for name in ("heads", "columns", "tokens") if best.uses(name)]
    assert best.pp == 1 and shares and all(s[0] > s[1] for s in shares), best


def test_encoder_latency_device_entry_is_forward_only(tmp_path):
    """profile-devices --objective latency's entry for a classifier (in-process, tiny BERT at pad
    16): the forward-only table with the pooler and classifier ("head") and no decode section; the
    encoder cost model reads its head from that table."""
    from types import SimpleNamespace
    from support.tiny_models import make_tiny_bert
    from galaxy.config import load_config
    from galaxy.planner.device_profile import latency_entry
    from galaxy.planner.harness import SubBlockBench
    path = make_tiny_bert(str(tmp_path / "bert"))
    (tmp_path / "c.json").write_text(json.dumps({"model_path": path, "pad_size": 16, "class_list": ["a", "b"]}))
    cfg = load_config(str(tmp_path / "c.json"))
    bench = SubBlockBench(path, seq=16, num_labels=2, tie_head=True)
    env = SimpleNamespace(rank=0, device=torch.device("cpu"))
    entry = latency_entry(cfg, bench, env, host="h", threads=1, memory=1000.0, baseline=0.0, statistic="median",
                          quick=True, repeats=1, warmup=0)
    table = entry["compute"]
    assert "decode" not in entry and table["forward_only"] and table["kinds"]["head"]["units"] == [16]
    assert set(table["kinds"]) == {"att_tp", "att_sp", "mlp_tp", "mlp_sp", "con", "embed", "head"}
    assert all(t[0] > 0 for k in table["kinds"].values() for t in k["fwd_s"])
    model = encoder_profile()
    model["hf_config"] = {**model["hf_config"], **{k: table["model"][k] for k in ("hidden_size", "num_attention_heads",
                                                                                     "intermediate_size", "vocab_size")}}
    model["pad_size"] = 16
    cost = EncoderLatencyCostModel(model, [entry], None)
    assert cost.compute[0]("head", 16, 1)[0] == table["kinds"]["head"]["fwd_s"][0][0]


@pytest.mark.parametrize("extra, words", [
    (["--new_tokens", "8"], "--new_tokens sizes a generation request, but this model is a classifier"),
    (["--prompt_tokens", "12"], "--prompt_tokens 12: a classifier pads every input to the config's pad_size 24"),
    (["--memory_mib", "0.001"], "no plan fits the memory budgets for one 24-token classification; under"),
])
def test_bad_encoder_requests_are_one_line_exit_2(tmp_path, capsys, extra, words):
    model = tmp_path / "model.json"
    model.write_text(json.dumps(encoder_profile()))
    devices = tmp_path / "devices.json"
    devices.write_text(json.dumps({"format": "galaxy-devices", "version": 1, "devices": [device(1e9), device(1e9)],
                                   "link": {"latency_s": 1e-5, "bytes_per_s": 1e9}}))
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"model_path": MINILM, "pad_size": SEQ, "batch_size": 1, "class_list": ["a", "b"]}))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["search", "--objective", "latency", "--config_file", str(base), "--devices", str(devices),
                  "--model", str(model), "--out", str(tmp_path / "x.json"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and words in err[0], err
