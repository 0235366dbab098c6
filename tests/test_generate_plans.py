"""KV-cached generation (galaxy.inference.engine) gives Hugging Face generate's greedy tokens
(do_sample=False, with its own cache) under every plan: Llama under all 8 ATT x MLP x CON
combinations at world 2 with uneven shares, world 3, a 2-stage pipeline (alone and of Galaxy
groups; Llama's prompt whole and in token chunks), 2 data-parallel replicas splitting the prompts (evenly, and 2 / 1 under seeded sampling:
dp_batch_list); Qwen2 and GPT-2 under several. Prompts of
different lengths go in one left-padded batch, and alone. Seeded sampling under a plan draws the
serial run's tokens; LoRA from a peft folder (and folded into the weights) gives peft's tokens;
each rank's cache holds its share (heads under TP, tokens under SP). Every decode step splits the
LM head by vocabulary rows over the group; a TP sub-block's one-token sum goes over the group's
token link (the default on CPU), and the all-to-all, the paired exchange and the all-reduce give
the same tokens."""

import pytest
import torch
import torch.nn.functional as F

from support.generation_runners import (galaxy_generate, galaxy_generate_runs, galaxy_generate_token_sums, hf_generate,
                                        requests_for)

from galaxy.distributed.group import GalaxyGroup
from galaxy.inference.replicas import replica_requests
from galaxy.inference.sampling import Sampling
from galaxy.inference.split_head import vocab_shares
from galaxy.layers.kv_cache import KVCache
from galaxy.parallel.decode_layout import decode_layouts
from galaxy.plan import Plan
from galaxy.runtime.assemble import build_model

PAD, NEW = 24, 10
PROMPTS = ("The for statement is used to", "Lists", "A class definition defines a class object and then the")
SHARES = {   # family -> world -> (query heads, MLP columns, tokens)
    "llama": {1: ((4,), (344,), (PAD,)), 2: ((2, 2), (200, 144), (14, 10)), 3: ((4, 4, 4), (120, 120, 104), (9, 8, 7))},
    "gpt2": {1: ((4,), (512,), (PAD,)), 2: ((3, 1), (300, 212), (14, 10)), 3: ((2, 1, 1), (200, 200, 112), (9, 8, 7))},
}
SHARES["qwen2"] = SHARES["llama"]
# family -> world -> the MLP columns an SP MLP computes per decoded token (decode_columns): uneven,
# and not in proportion to the tokens (their default)
DECODE_COLUMNS = {"llama": {2: (120, 224), 3: (100, 144, 100)}, "gpt2": {2: (312, 200), 3: (112, 200, 200)}}
DECODE_COLUMNS["qwen2"] = DECODE_COLUMNS["llama"]


@pytest.fixture(scope="module")
def lm(sharp_lm):
    """lm(family) -> (model folder, HF's tokens for PROMPTS as one batch)."""
    made = {}

    def get(family):
        if family not in made:
            made[family] = sharp_lm(family), hf_generate(family, sharp_lm(family), PROMPTS, NEW)
        return made[family]
    return get


def plan_of(family, world, att="TP", mlp="TP", con="SP", **mesh):
    group = world // (mesh.get("pp", 1) * mesh.get("dp", 1))
    heads, columns, tokens = SHARES[family][group]
    decode = DECODE_COLUMNS[family].get(group) if mlp == "SP" else None
    return Plan(att, mlp, con, heads=heads, columns=columns, tokens=tokens, stages=mesh.pop("stages", (4,)),
                decode_columns=decode, **mesh)


def check(pool, family, lm, plan, prompts=PROMPTS):
    model_dir, want = lm(family)
    if prompts != PROMPTS:
        want = hf_generate(family, model_dir, prompts, NEW)
    results = pool.run(galaxy_generate, model_dir, plan, requests_for(model_dir, prompts, NEW))
    for rank, (got, _) in enumerate(results):
        assert [tokens for tokens, _ in got] == want, f"rank {rank}: {got} != HF {want}"
    return results


COMBOS = [(a, m, c) for a in ("TP", "SP") for m in ("TP", "SP") for c in ("SP", "None")]


@pytest.mark.parametrize("att,mlp,con", COMBOS, ids=[f"att{a}-mlp{m}-con{c}" for a, m, c in COMBOS])
def test_llama_every_plan_at_world_2(dist_pool, lm, att, mlp, con):
    check(dist_pool(2), "llama", lm, plan_of("llama", 2, att, mlp, con))


@pytest.mark.parametrize("family,world,att,mlp,con", [
    ("llama", 1, "TP", "TP", "SP"), ("llama", 3, "SP", "TP", "SP"), ("llama", 3, "SP", "SP", "None"),
    ("qwen2", 2, "TP", "TP", "SP"), ("qwen2", 2, "SP", "TP", "None"),
    ("gpt2", 1, "TP", "TP", "SP"), ("gpt2", 2, "TP", "SP", "SP"), ("gpt2", 2, "SP", "TP", "None"),
    ("gpt2", 3, "TP", "TP", "SP"),
], ids=lambda v: str(v))
def test_families_and_worlds(dist_pool, lm, family, world, att, mlp, con):
    check(dist_pool(world), family, lm, plan_of(family, world, att, mlp, con))


@pytest.mark.parametrize("family,world,mesh,chunked", [
    ("llama", 2, dict(pp=2, stages=(3, 1)), dict(prefill_chunks=5)), ("gpt2", 2, dict(pp=2, stages=(2, 2)), None),
    ("llama", 2, dict(dp=2), None), ("llama", 4, dict(pp=2, stages=(2, 2)), dict(con="None", prefill_chunks=4)),
], ids=["llama-pp2", "gpt2-pp2", "llama-dp2", "llama-pp2-x-galaxy2"])
def test_pipelines_and_replicas(dist_pool, lm, family, world, mesh, chunked):
    """chunked: the same pipeline, in the same pool call, with its prompt in token chunks
    (prefill_chunks; tokens whole on every rank: CON None in a group): the batch (its short rows'
    first chunks all padding) and, at world 2, a single prompt; 5 and 4 chunks."""
    if chunked is None:
        check(dist_pool(world), family, lm, plan_of(family, world, **mesh))
        return
    model_dir, want = lm(family)
    batch, single = requests_for(model_dir, PROMPTS, NEW), requests_for(model_dir, PROMPTS[2:], NEW)
    runs = [(plan_of(family, world, **mesh), [batch]),
            (plan_of(family, world, **{**mesh, **chunked}), [batch] + ([single] if world == 2 else []))]
    wants = [[want], [want, hf_generate(family, model_dir, PROMPTS[2:], NEW)][:len(runs[1][1])]]
    for rank, per_plan in enumerate(dist_pool(world).run(galaxy_generate_runs, model_dir, runs)):
        for (plan, _), got, expected in zip(runs, per_plan, wants):
            assert [[t for t, _ in case] for case in got] == expected, f"rank {rank}, {plan.prefill_chunks} chunks"


def test_a_pipeline_placed_by_mesh_rank_order(dist_pool, lm):
    """mesh_rank_order [1, 0]: launch rank 1 runs stage 0, launch rank 0 the last stage (the sampler)."""
    check(dist_pool(2, (1, 0)), "llama", lm, plan_of("llama", 2, pp=2, stages=(3, 1)))


@pytest.mark.parametrize("world,methods", [(1, ()), (2, ()), (2, ("TP", "SP", "SP"))])
def test_a_single_prompt(dist_pool, lm, world, methods):
    check(dist_pool(world), "llama", lm, plan_of("llama", world, *methods), prompts=PROMPTS[2:])


def test_an_sp_mlp_decodes_its_columns_and_the_ranks_sum_to_the_whole(lm):
    """Under the decode layouts an SP MLP computes its rank's decode columns (120 and 224 of 344)
    from views of the whole weights it holds (no copy), and its output goes to the token sum
    (P -> R) as a TP MLP's; the two ranks' partial outputs add up to the serial MLP's. After
    decoding, the whole MLP again. (Each rank's model built alone: no process group.)"""
    model_dir, _ = lm("llama")
    p = plan_of("llama", 2, "TP", "SP", "SP")
    serial = build_model(model_dir, plan_of("llama", 1), GalaxyGroup.serial(4, 344, PAD), task="causal_lm")
    ranks = [build_model(model_dir, p, GalaxyGroup(j, 2, None, p.heads, p.columns, p.tokens), task="causal_lm")
             for j in range(2)]
    x = torch.randn(3, 1, 128, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), decode_layouts(ranks[0]), decode_layouts(ranks[1]):
        for i, layer in enumerate(serial.layers):
            mlps = [m.layers[i].mlp for m in ranks]
            assert [m.column_views[1].shape for m in mlps] == [(128, 120), (128, 224)]
            assert all(m.column_views[1].data_ptr() == m.down_proj.weight[:, start].data_ptr()
                       for m, start in zip(mlps, (0, 120)))
            assert ranks[1].layers[i].from_mlp.label == "P->R by all_to_all"
            want = layer.mlp(x)[0]
            got = mlps[0](x)[0] + mlps[1](x)[0]
            assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    assert all(m.layers[0].mlp.column_views is None for m in ranks)


def test_every_decode_token_sum_gives_hf_tokens(dist_pool, lm):
    """A TP sub-block's one-token output summed by gloo's all-to-all, a paired exchange or gloo's
    all-reduce instead of the default on CPU, the group's own sockets (galaxy.parallel.
    decode_layout), under uneven heads and columns."""
    model_dir, want = lm("llama")
    names = ("all_to_all", "exchange", "all_reduce")
    results = dist_pool(2).run(galaxy_generate_token_sums, model_dir, plan_of("llama", 2, "TP", "TP", "None"),
                               requests_for(model_dir, PROMPTS, NEW), names)
    for rank, per_sum in enumerate(results):
        for name, (got, _) in zip(names, per_sum):
            assert [tokens for tokens, _ in got] == want, f"{name} rank {rank}: {got} != HF {want}"


def test_the_decode_head_splits_the_vocabulary_by_column_shares():
    """Each rank's rows of the LM head in a decode step (galaxy.inference.split_head)."""
    group = GalaxyGroup(0, 3, None, (1, 1, 1), (300, 200, 100), (1, 1, 1))
    assert vocab_shares(1000, group.columns) == (500, 333, 167)
    assert vocab_shares(7, (1, 1, 1)) == (2, 3, 2)


def test_each_rank_caches_its_share(dist_pool, lm):
    """TP: the rank's K/V heads of every slot; SP: all K/V heads of its prompt tokens and of every
    other decoded token (round-robin)."""
    model_dir, _ = lm("llama")
    requests = requests_for(model_dir, PROMPTS, NEW)

    def mib(kv_heads, slots):      # 4 layers of K and V [3 rows, kv_heads, slots, 32] fp32 + keep [3, slots]
        return 4 * (2 * 3 * kv_heads * slots * 32 * 4 + 3 * slots) / 2 ** 20
    serial = dist_pool(1).run(galaxy_generate, model_dir, plan_of("llama", 1), requests)[0][1]
    tp = dist_pool(2).run(galaxy_generate, model_dir, plan_of("llama", 2, "TP", "TP", "SP"), requests)[0][1]
    sp = dist_pool(2).run(galaxy_generate, model_dir, plan_of("llama", 2, "SP", "TP", "SP"), requests)[0][1]
    longest = max(len(r.ids) for r in requests)      # serial: no token shares, prompts padded to the longest
    assert serial == [mib(2, longest + NEW)]
    assert tp == [mib(1, PAD + NEW)] * 2
    assert sp == [mib(2, 14 + NEW // 2), mib(2, 10 + NEW // 2)]


def test_seeded_sampling_under_plans_equals_serial(dist_pool, lm):
    model_dir, _ = lm("llama")
    requests = [requests_for(model_dir, [p], NEW, Sampling(temperature=1.3, top_k=40, top_p=0.9, seed=7 + i))[0]
                for i, p in enumerate(PROMPTS)]
    serial = dist_pool(1).run(galaxy_generate, model_dir, plan_of("llama", 1), requests)[0][0]
    assert len({tuple(t) for t, _ in serial}) == 3
    # dp 2 with uneven rows (dp_batch_list [2, 1]): replica 0 samples prompts 0 and 1, replica 1 prompt 2
    for plan, rows in ((plan_of("llama", 2, "SP", "SP", "SP"), 8), (plan_of("llama", 2, dp=2), [2, 1])):
        for rank, (got, _) in enumerate(dist_pool(2).run(galaxy_generate, model_dir, plan, requests, rows)):
            assert got == serial, f"{plan.att}/{plan.mlp}/{plan.con} dp {plan.dp} rank {rank}"


def test_uneven_replicas_take_their_rows_of_every_block_of_prompts():
    assert replica_requests(7, 0, 2, [2, 1]) == ([0, 1, 3, 4, 6], 2)
    assert replica_requests(7, 1, 2, [2, 1]) == ([2, 5], 1)
    assert replica_requests(5, 1, 2, 3) == ([1, 3], 3)         # even: round-robin


def test_lora_from_peft_folder_and_folded(dist_pool, lm, tmp_path):
    from peft import PeftModel

    from support.generation_runners import tokenizer_of
    from support.peft_runners import write_peft_adapter
    from support.parity import HF_LOADERS
    from galaxy.peft import PeftOptions
    model_dir, _ = lm("llama")
    adapter = write_peft_adapter("llama", model_dir, str(tmp_path / "adapter"), ["q_proj", "v_proj", "down_proj"])
    tok = tokenizer_of(model_dir)
    tok.padding_side = "left"
    enc = tok(list(PROMPTS), return_tensors="pt", padding=True)
    ref = PeftModel.from_pretrained(HF_LOADERS["llama"](model_dir), adapter).eval()
    out = ref.generate(**enc, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id)
    want = [[t for t in row] for row in out[:, enc["input_ids"].shape[1]:].tolist()]
    want = [row[:row.index(2) + 1] if 2 in row else row for row in want]
    lora = (PeftOptions("lora", lora_path=adapter), 0)
    requests = requests_for(model_dir, PROMPTS, NEW)
    for fold in (False, True):
        for rank, (got, _) in enumerate(dist_pool(2).run(galaxy_generate, model_dir, plan_of("llama", 2), requests,
                                                          8, lora, fold)):
            assert [t for t, _ in got] == want, f"fold {fold} rank {rank}"


def test_decode_steps_skip_the_slots_no_row_fills():
    """KVCache.skip_padding after a left-padded prefill: attention reads from the first slot some
    row keeps (rows padded by 3 and 2 slots: from slot 2), the decoded slots after it; the
    attention over the kept slots equals SDPA over every slot under the keep mask."""
    torch.manual_seed(0)
    cache = KVCache(rows=2, kv_heads=2, slots=8, head_dim=4, dtype=torch.float32, device="cpu")
    keep = torch.tensor([[False] * 3 + [True] * 3, [False] * 2 + [True] * 4])
    cache.write(torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4), keep)
    cache.skip_padding()
    cache.write(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4), torch.ones(2, 1, dtype=torch.bool))
    k, v, kept = cache.filled()
    decoded = torch.ones(2, 1, dtype=torch.bool)
    assert cache.start == 2 and k.shape[2] == 5 and torch.equal(kept, torch.cat((keep, decoded), 1)[:, 2:])
    q = torch.randn(2, 2, 1, 4)
    every = F.scaled_dot_product_attention(q, cache.k[:, :, :7], cache.v[:, :, :7], attn_mask=cache.keep[:, None, None, :7])
    skipped = F.scaled_dot_product_attention(q, k, v, attn_mask=kept[:, None, None, :])
    assert torch.allclose(skipped, every, rtol=1e-6, atol=1e-7)
    empty = KVCache(rows=1, kv_heads=1, slots=4, head_dim=2, dtype=torch.float32, device="cpu")
    empty.write(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), torch.zeros(1, 2, dtype=torch.bool))
    empty.skip_padding()
    assert empty.start == 2 and empty.filled()[0].shape[2] == 0
