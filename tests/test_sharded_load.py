"""build_model reads only what a rank keeps, and ends with exactly the old full-read parameters.

Against tests/support/full_read_reference.py (full model, whole checkpoint, then plan slicing and stage
pruning): every parameter and buffer torch.equal, same gradient rules, the default random stream
untouched, for BERT, Llama (grouped-query attention, untied and tied) and GPT-2 (fused Q/K/V
stored as Conv1D [in, out]: a rank's c_attn share is three column ranges of the checkpoint's
tensor, read transposed) under the tp, sp, galaxy and galaxy2 presets at world 2 with uneven
shares, whole and as either stage of a 2-stage split ([2, 1] of 3 layers); from a bare base-model
checkpoint (new head), from sharded safetensors and pytorch_model.bin checkpoints (*.index.json)
and a legacy .bin. Error messages are the old
ones, on every pipeline stage. A recording safe_open shows each rank asks for its share plus
the replicated tensors, a stage for its own layers, a tied weight once, in row chunks.
"""
from __future__ import annotations

import json
import os
import shutil
from collections import Counter

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from support.full_read_reference import full_read_build
from support.parity import world_group
from support.tiny_models import TINY_BERT, TINY_SEQ, make_tiny_bert, make_tiny_gpt2, make_tiny_llama

import galaxy.models.weights as weights
from galaxy.distributed.group import GalaxyGroup
from galaxy.models.build import CheckpointError
from galaxy.runtime.assemble import build_model
from galaxy.plan import Plan

SEED = 5
PRESETS = ("tp", "sp", "galaxy", "galaxy2")
BERT_SHARES = ((4, 2), (64, 32), (7, 5))        # 6 heads of 8, 96 MLP columns, 12 tokens
LLAMA_SHARES = ((2, 6), (64, 32), (7, 5))       # 8 query heads in K/V groups of 2: kv (1, 3)
WHOLE, FIRST, LAST = None, (range(0, 2), True, False), (range(2, 3), False, True)


# --- rank side ---------------------------------------------------------------------------------

def compare_builds(model_dir, presets, shares, num_labels, stages):
    """On every rank of the pool: old and new build of each (preset, stage); a summary of each."""
    group = world_group(*shares)
    return [_compare(model_dir, Plan.preset(p), group, num_labels, stage)
            for p in presets for stage in stages]


def _compare(model_dir, plan, group, num_labels, stage):
    kwargs = dict(num_labels=num_labels, seed=SEED, stage=stage)
    try:
        ref = full_read_build(model_dir, plan, group, **kwargs)
    except ValueError as e:      # a stage the pipeline refuses: the new build must refuse it alike
        with pytest.raises(ValueError) as new_error:
            build_model(model_dir, plan, group, **kwargs)
        return {"refused": str(e), "new_refused": str(new_error.value)}
    rng = torch.get_rng_state()
    new = build_model(model_dir, plan, group, **kwargs)
    ref_params, new_params = dict(ref.named_parameters()), dict(new.named_parameters())
    unequal = [n for n, p in new_params.items()
               if n not in ref_params or not (torch.equal(p, ref_params[n]) and p.dtype == ref_params[n].dtype
                                               and p.requires_grad == ref_params[n].requires_grad)]
    ref_buffers = dict(ref.named_buffers())
    return {"names": sorted(new_params), "ref_names": sorted(ref_params), "unequal": unequal,
            "shapes": {n: tuple(p.shape) for n, p in new_params.items()},
            "buffers_equal": all(torch.equal(b, ref_buffers[n]) for n, b in new.named_buffers()),
            "buffer_names_equal": sorted(ref_buffers) == sorted(dict(new.named_buffers())),
            "rules_equal": new.attached.rules == ref.attached.rules,
            "rng_untouched": torch.equal(rng, torch.get_rng_state()),
            "tied": hasattr(new, "lm_head") and any(new.lm_head.weight is m.weight for m in new.modules()
                                                    if isinstance(m, torch.nn.Embedding))}


def check(reports, expect_shapes=None):
    """expect_shapes: {rank: {name: shape}} for the whole model (first summary of each preset)."""
    for rank, summaries in enumerate(reports):
        for s in summaries:
            if "refused" in s:
                assert s["new_refused"] == s["refused"]
                continue
            assert s["names"] and s["names"] == s["ref_names"], (rank, s["names"], s["ref_names"])
            assert s["unequal"] == [], (rank, s["unequal"])
            assert s["buffers_equal"] and s["buffer_names_equal"] and s["rules_equal"] and s["rng_untouched"]
        for name, shape in (expect_shapes or {}).get(rank, {}).items():
            assert summaries[0]["shapes"][name] == shape, (rank, name)


def stage_names(summaries):
    """Top-level modules and layer indices of the (whole, first, last) summaries of one preset."""
    return [sorted({".".join(n.split(".")[:2]) if n.startswith("layers.") else n.split(".")[0]
                    for n in s["names"]}) for s in summaries]


# --- checkpoints -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bert3_dir(tmp_path_factory):
    return make_tiny_bert(str(tmp_path_factory.mktemp("bert3")), num_hidden_layers=3)


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("llama3")), num_hidden_layers=3)


@pytest.fixture(scope="module")
def bare_bert3_dir(tmp_path_factory):
    """A BertModel checkpoint: no "bert." prefix and no classifier (a new task head)."""
    from transformers import BertConfig, BertModel
    torch.manual_seed(1)
    path = str(tmp_path_factory.mktemp("bare_bert3"))
    BertModel(BertConfig(**{**TINY_BERT, "num_hidden_layers": 3}), add_pooling_layer=True).save_pretrained(path)
    return path


def resave(src: str, dst: str, fmt: str, parts: int) -> str:
    """src's weights as `parts` files in format fmt ("safetensors", "bin", "bin_legacy"), with an
    index when parts > 1 (tensors dealt out in order, so each file holds several layers' parts)."""
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), dst)
    state = load_file(os.path.join(src, "model.safetensors"))
    names = list(state)
    ext = "safetensors" if fmt == "safetensors" else "bin"
    stem = "model" if fmt == "safetensors" else "pytorch_model"
    weight_map = {}
    for i in range(parts):
        file = f"{stem}.{ext}" if parts == 1 else f"{stem}-{i + 1:05d}-of-{parts:05d}.{ext}"
        part = {n: state[n].contiguous() for n in names[i::parts]}
        weight_map.update(dict.fromkeys(part, file))
        if fmt == "safetensors":
            save_file(part, os.path.join(dst, file), metadata={"format": "pt"})
        else:
            torch.save(part, os.path.join(dst, file), _use_new_zipfile_serialization=fmt == "bin")
    if parts > 1:
        with open(os.path.join(dst, f"{stem}.{ext}.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return dst


# --- exactness at world 2 ----------------------------------------------------------------------

def test_bert_matches_full_read(dist_pool, bert3_dir):
    reports = dist_pool(2).run(compare_builds, bert3_dir, PRESETS, BERT_SHARES, 3, (WHOLE, FIRST, LAST))
    # tp (first preset), whole model: rank 0 keeps 4 of 6 heads (32 rows of 48) and 64 of 96 columns.
    check(reports, {0: {"layers.0.att.query.weight": (32, 48), "layers.0.att.out.weight": (48, 32),
                        "layers.2.mlp.up.weight": (64, 48), "layers.2.mlp.down.weight": (48, 64),
                        "layers.2.mlp.down.bias": (48,)},
                    1: {"layers.1.att.value.bias": (16,), "layers.1.mlp.down.weight": (48, 32)}})
    assert stage_names(reports[0][:3])[1:] == [
        ["embeddings", "layers.0", "layers.1"], ["classifier", "layers.2", "pooler"]]


def test_llama_gqa_matches_full_read(dist_pool, llama3_dir):
    reports = dist_pool(2).run(compare_builds, llama3_dir, PRESETS, LLAMA_SHARES, None, (WHOLE, FIRST, LAST))
    # 8 query heads of 8 (4 K/V heads): rank 0 keeps 2 query heads and their 1 K/V head, rank 1 6 and 3.
    check(reports, {0: {"layers.0.att.q_proj.weight": (16, 64), "layers.0.att.k_proj.weight": (8, 64),
                        "layers.0.att.v_proj.weight": (8, 64), "layers.0.att.o_proj.weight": (64, 16),
                        "layers.1.mlp.gate_proj.weight": (64, 64), "layers.1.mlp.down_proj.weight": (64, 64)},
                    1: {"layers.2.att.k_proj.weight": (24, 64), "layers.2.att.o_proj.weight": (64, 48),
                        "layers.2.mlp.up_proj.weight": (32, 64)}})
    assert stage_names(reports[1][:3])[1:] == [
        ["embed_tokens", "first_norm", "layers.0", "layers.1"], ["layers.2", "lm_head"]]


def test_tied_llama_matches_full_read(dist_pool, tmp_path):
    """The tie is re-made after materialising and the tied weight read once; a stage holding one
    end gets what the old path gave it (or both refuse the split alike)."""
    model_dir = make_tiny_llama(str(tmp_path / "tied"), num_hidden_layers=3, tie_word_embeddings=True)
    reports = dist_pool(2).run(compare_builds, model_dir, ("galaxy",), LLAMA_SHARES, None, (WHOLE, FIRST, LAST))
    check(reports)
    assert all(r[0]["tied"] for r in reports)


GPT2_SHARES = ((3, 1), (120, 72), (7, 5))       # 4 heads of 12, 192 MLP columns, 12 tokens


@pytest.fixture(scope="module")
def gpt2_3_dir(tmp_path_factory):
    return make_tiny_gpt2(str(tmp_path_factory.mktemp("gpt2_3")), n_layer=3)


def test_gpt2_fused_conv1d_matches_full_read(dist_pool, gpt2_3_dir):
    """The tied LM head on the last stage reads wte; c_attn rows are each rank's q, k and v rows."""
    reports = dist_pool(2).run(compare_builds, gpt2_3_dir, PRESETS, GPT2_SHARES, None, (WHOLE, FIRST, LAST))
    check(reports, {0: {"layers.0.att.c_attn.weight": (3 * 36, 48), "layers.0.att.c_attn.bias": (108,),
                        "layers.0.att.c_proj.weight": (48, 36), "layers.1.mlp.c_fc.weight": (120, 48),
                        "layers.1.mlp.c_proj.weight": (48, 120)},
                    1: {"layers.2.att.c_attn.weight": (3 * 12, 48), "layers.2.mlp.c_fc.bias": (72,)}})
    assert all(r[0]["tied"] for r in reports)
    assert stage_names(reports[0][:3])[1:] == [
        ["first_norm", "layers.0", "layers.1", "wpe", "wte"], ["layers.2", "lm_head"]]


def test_gpt2_rank_reads_its_heads_of_each_block(monkeypatch, gpt2_3_dir):
    """c_attn [48, 144] on disk: a rank reads its heads' columns of the q, k and v thirds (3 reads);
    the two ranks' reads partition every sharded tensor; galaxy's rows are HF's columns."""
    full = load_file(os.path.join(gpt2_3_dir, "model.safetensors"))
    plan = Plan.preset("galaxy")
    builds = [recorded_build(monkeypatch, gpt2_3_dir, plan, fake_group(r, GPT2_SHARES)) for r in (0, 1)]
    key = "transformer.h.1.attn.c_attn.weight"
    assert [rec.reads[key] for _, rec in builds] == [3, 3]
    assert [rec.elements[key] for _, rec in builds] == [48 * 3 * 36, 48 * 3 * 12]
    for model, rec in builds:
        assert sum(rec.elements.values()) == sum(p.numel() for p in model.parameters())
    (m0, _), (m1, _) = builds
    w = full[key].t()                                                # [q; k; v] rows, 48 each
    assert torch.equal(m0.layers[1].att.c_attn.weight, torch.cat([w[0:36], w[48:84], w[96:132]]))
    assert torch.equal(m1.layers[1].att.c_attn.weight, torch.cat([w[36:48], w[84:96], w[132:144]]))


def test_new_head_from_base_checkpoint_matches_full_read(dist_pool, bare_bert3_dir):
    """Unprefixed names (hf_base_prefix) and the classifier drawn from the shared seed."""
    reports = dist_pool(2).run(compare_builds, bare_bert3_dir, ("galaxy", "tp"), BERT_SHARES, 4, (WHOLE, LAST))
    check(reports, {0: {"classifier.weight": (4, 48)}, 1: {"layers.0.att.key.weight": (16, 48)}})


@pytest.mark.parametrize("fmt,parts", [("safetensors", 3), ("bin", 2), ("bin_legacy", 1)])
def test_other_checkpoint_layouts_match_full_read(dist_pool, llama3_dir, tmp_path, fmt, parts):
    model_dir = resave(llama3_dir, str(tmp_path / fmt), fmt, parts)
    assert (parts > 1) == any(f.endswith(".index.json") for f in os.listdir(model_dir))
    reports = dist_pool(2).run(compare_builds, model_dir, ("galaxy",), LLAMA_SHARES, None, (WHOLE, FIRST))
    check(reports, {1: {"layers.0.att.q_proj.weight": (48, 64)}})


# --- only the slice is read ----------------------------------------------------------------------

class ReadRecorder:
    """Wraps safe_open: counts the elements of every tensor or slice handed out, by tensor name."""

    def __init__(self):
        self.elements, self.reads = Counter(), Counter()

    def open(self, *args, **kwargs):
        return _RecordingFile(safe_open(*args, **kwargs), self)

    def add(self, name, tensor):
        self.elements[name] += tensor.numel()
        self.reads[name] += 1


class _RecordingFile:
    def __init__(self, f, recorder):
        self.f, self.recorder = f, recorder

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name):
        t = self.f.get_tensor(name)
        self.recorder.add(name, t)
        return t

    def get_slice(self, name):
        return _RecordingSlice(self.f.get_slice(name), name, self.recorder)


class _RecordingSlice:
    def __init__(self, s, name, recorder):
        self.s, self.name, self.recorder = s, name, recorder

    def get_shape(self):
        return self.s.get_shape()

    def __getitem__(self, index):
        t = self.s[index]
        self.recorder.add(self.name, t)
        return t


def fake_group(rank: int, shares) -> GalaxyGroup:
    """Rank `rank` of a world-2 group without a process group: building never communicates."""
    return GalaxyGroup(rank, 2, None, *shares)


def recorded_build(monkeypatch, model_dir, plan, group, **kwargs):
    recorder = ReadRecorder()
    monkeypatch.setattr(weights, "safe_open", recorder.open)
    model = build_model(model_dir, plan, group, **kwargs)
    return model, recorder


def test_each_rank_reads_its_share_only(monkeypatch, bert3_dir):
    full = {n: t.numel() for n, t in load_file(os.path.join(bert3_dir, "model.safetensors")).items()}
    plan = Plan.preset("galaxy")
    models, recorders = zip(*(recorded_build(monkeypatch, bert3_dir, plan, fake_group(r, BERT_SHARES), num_labels=3)
                              for r in (0, 1)))
    for model, rec in zip(models, recorders):
        assert set(rec.reads.values()) == {1}                               # each tensor once
        assert sum(rec.elements.values()) == sum(p.numel() for p in model.parameters())
    sharded = {n for n in full if n.endswith(("query.weight", "query.bias", "key.weight", "key.bias",
                                              "value.weight", "value.bias", "output.dense.weight",
                                              "intermediate.dense.weight", "intermediate.dense.bias"))}
    assert len(sharded) == 3 * 10     # per layer: q, k, v (weight, bias), out, up (weight, bias), down
    for name, numel in full.items():
        if name in sharded:          # the two shares partition the tensor
            assert recorders[0].elements[name] + recorders[1].elements[name] == numel, name
            assert 0 < recorders[0].elements[name] < numel, name
        else:                        # replicated (embeddings, norms, deferred biases, pooler, head)
            assert recorders[0].elements[name] == recorders[1].elements[name] == numel, name
    # Rank 0 (4 of 6 heads of 8, 64 of 96 columns) reads 49,731 of the checkpoint's 68,403
    # elements: embeddings 9,024; per layer 3 x (32 x 48 + 32) + 48 x 32 + 48 + 96 + (64 x 48 + 64)
    # + 48 x 64 + 48 + 96 = 12,736 of 18,960; pooler 2,352; classifier 147. Rank 1: 6,512 per layer.
    assert sum(full.values()) == 9_024 + 3 * 18_960 + 2_352 + 147 == 68_403
    assert sum(recorders[0].elements.values()) == 9_024 + 3 * 12_736 + 2_352 + 147 == 49_731
    assert sum(recorders[1].elements.values()) == 9_024 + 3 * 6_512 + 2_352 + 147 == 31_059


def test_a_stage_reads_its_layers_only(monkeypatch, bert3_dir):
    group = fake_group(1, BERT_SHARES)
    model, rec = recorded_build(monkeypatch, bert3_dir, Plan.preset("galaxy"), group, num_labels=3, stage=FIRST)
    assert not any(".layer.2." in n or n.startswith(("bert.pooler", "classifier")) for n in rec.elements)
    assert any(".layer.1." in n for n in rec.elements) and "bert.embeddings.word_embeddings.weight" in rec.elements
    assert sum(rec.elements.values()) == sum(p.numel() for p in model.parameters())


def test_tied_weight_read_once(monkeypatch, tmp_path):
    model_dir = make_tiny_llama(str(tmp_path / "tied"), tie_word_embeddings=True)
    model, rec = recorded_build(monkeypatch, model_dir, Plan.preset("galaxy"), fake_group(0, LLAMA_SHARES))
    assert model.lm_head.weight is model.embed_tokens.weight
    assert rec.reads["model.embed_tokens.weight"] == 1 and "lm_head.weight" not in rec.reads
    assert sum(rec.elements.values()) == sum(p.numel() for p in model.parameters())


# --- errors read as before -----------------------------------------------------------------------

def _errors(model_dir, plan, group, **kwargs):
    """(old message, new message) of the CheckpointError both builds raise."""
    with pytest.raises(CheckpointError) as old:
        full_read_build(model_dir, plan, group, **kwargs)
    with pytest.raises(CheckpointError) as new:
        build_model(model_dir, plan, group, **kwargs)
    return str(old.value), str(new.value)


def _without(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("stage", [WHOLE, LAST])
def test_missing_tensor_message(bert3_dir, tmp_path, stage):
    """Also on a stage without that layer: every stage checks the whole model's names."""
    key = "bert.encoder.layer.1.attention.self.key.weight"
    model_dir = _without(bert3_dir, str(tmp_path / "m"), lambda s: s.pop(key))
    old, new = _errors(model_dir, Plan.preset("galaxy"), fake_group(1, BERT_SHARES), num_labels=3,
                       stage=stage)
    assert new == old == ("checkpoint has no tensor 'bert.encoder.layer.1.attention.self.key.weight' "
                          "(for layers.1.att.key.weight)")


@pytest.mark.parametrize("stage", [WHOLE, FIRST, LAST])
def test_wrong_classifier_shape_message(bert3_dir, stage):
    old, new = _errors(bert3_dir, Plan.preset("tp"), fake_group(0, BERT_SHARES), num_labels=5, stage=stage)
    assert new == old == ("checkpoint tensor 'classifier.weight' has shape (3, 48), the model needs (5, 48) "
                          "(check num_labels / class_list)")


def test_wrong_sharded_shape_names_the_full_shape(bert3_dir, tmp_path):
    """A rank that reads only columns 0-63 still reports the whole tensor against the whole need."""
    key = "bert.encoder.layer.0.intermediate.dense.weight"
    model_dir = _without(bert3_dir, str(tmp_path / "s"), lambda s: s.update({key: s[key][:95].clone()}))
    old, new = _errors(model_dir, Plan.preset("galaxy"), fake_group(0, BERT_SHARES), num_labels=3)
    assert new == old == (f"checkpoint tensor {key!r} has shape (95, 48), the model needs (96, 48) "
                          "(check num_labels / class_list)")


def test_serial_build_equals_full_read(bert3_dir):
    """Group of one: nothing sharded, every tensor read whole."""
    group = GalaxyGroup.serial(6, 96, TINY_SEQ)
    new = dict(build_model(bert3_dir, Plan(), group, num_labels=3).named_parameters())
    ref = dict(full_read_build(bert3_dir, Plan(), group, num_labels=3).named_parameters())
    assert sorted(new) == sorted(ref) and all(torch.equal(p, ref[n]) for n, p in new.items())


def test_chunked_reads_are_exact(monkeypatch, llama3_dir):
    """Rows come in chunks (here at most 200 elements, 3 rows of 64): same values, same total."""
    monkeypatch.setattr(weights._SafetensorsFiles, "CHUNK_ELEMENTS", 200)
    group, plan = fake_group(1, LLAMA_SHARES), Plan.preset("galaxy")
    model, rec = recorded_build(monkeypatch, llama3_dir, plan, group, stage=LAST)
    ref = dict(full_read_build(llama3_dir, plan, group, stage=LAST).named_parameters())
    new = dict(model.named_parameters())
    assert sorted(new) == sorted(ref) and all(torch.equal(p, ref[n]) for n, p in new.items())
    # lm_head [128, 64]: 43 chunks of 3 rows (the last of 2); o_proj [64, 48 of 64]: 22 chunks.
    assert rec.reads["lm_head.weight"] == 43 and rec.reads["model.layers.2.self_attn.o_proj.weight"] == 22
    assert rec.elements["model.layers.2.self_attn.o_proj.weight"] == 64 * 48
    assert sum(rec.elements.values()) == sum(p.numel() for p in model.parameters())
