"""One layer of a model, run one sub-block at a time at a given share: what a rank computes.

The planner needs each sub-block's forward and backward time (galaxy.planner.device_profile) and
saved activation bytes and parameters (galaxy.planner.model_profile) at any share of heads,
MLP columns or tokens, without a process group. A one-layer model of the family is built from
the model folder's config.json (random weights: values do not change the work), and each kind
runs the family's own sub-block module, as a rank of a Galaxy group would:

  att_tp  u query heads     the module sharded by its own shard_tp((u,), 0); full-sequence input
  att_sp  u tokens          the whole module on u tokens; K/V padded to the full sequence where
                            the real run gathers them (same shapes, no collective)
  mlp_tp  u columns         shard_tp((u,), 0); full-sequence input
  mlp_sp  u tokens          the whole module on u tokens
  con     u tokens          one connective (CON1; CON2 has the same shape)
  embed   the sequence      the model's embed(): replicated on every rank under every plan
  head    u tokens          the model's head() on a carry of u tokens (and the loss)
  side    u tokens          side-tuning's block of a layer (galaxy.peft.side) on u CON tokens,
                            its K/V padded to the full sequence as the att_sp kind's are

With a PEFT method (peft=), the one-layer model is the one galaxy.peft makes of it (apply_peft
after a one-rank plan, as training applies it after the plan): frozen weights, LoRA inside the
projections (a TP shard's LoRA sliced like its weight, galaxy.peft.lora), adapters in the CONs, the
side network beside the layer. What the method runs without autograd (side-tuning's backbone)
runs under no_grad here too, and a backward with nothing to differentiate takes no time.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F

from galaxy.distributed.group import GalaxyGroup
from galaxy.models.build import load_hf_config, model_class
from galaxy.models.registry import family_of
from galaxy.parallel.plan import ParamRule, apply_plan
from galaxy.peft import apply_peft
from galaxy.peft.lora import LoraLinear
from galaxy.plan import Plan
from galaxy.profiler.activations import SavedActivations

KINDS = ("att_tp", "att_sp", "mlp_tp", "mlp_sp", "con", "embed", "head")
LAYER_KINDS = ("att_tp", "att_sp", "mlp_tp", "mlp_sp", "con")


def unit_totals(hf, pad_size: int) -> dict:
    """kind -> (total units, the smallest step of a share) of the model."""
    heads = hf.num_attention_heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    return {"att_tp": (heads, heads // kv), "att_sp": (pad_size, 1), "mlp_tp": (hf.intermediate_size, 1),
            "mlp_sp": (pad_size, 1), "con": (pad_size, 1), "embed": (pad_size, pad_size),
            "head": (pad_size, 1), "side": (pad_size, 1)}


class SubBlockBench:
    def __init__(self, model_path: str, *, seq: int, num_labels: int | None, dropout: float | None = None,
                 device="cpu", seed: int = 0, peft=None, tie_head: bool = False):
        """peft: galaxy.peft.PeftOptions of the method to run the sub-blocks under (None: full).
        tie_head: the LM head shares the embeddings' table (profile-devices --objective latency:
        the same products and lookups, one [vocab, h] table less to hold, 125 MiB for the bench
        Llama, on a device of 900 MiB)."""
        hf = load_hf_config(model_path, dropout)
        hf.num_hidden_layers = 1
        if tie_head:
            hf.tie_word_embeddings = True
        self.hf, self.seq, self.num_labels = hf, seq, num_labels
        self.family = family_of(hf.model_type)
        self.device = torch.device(device)
        cls = model_class(self.family, None)
        self.task = cls.task
        with torch.device("meta"):
            model = cls(hf, num_labels=num_labels)
        model.to_empty(device="cpu")
        model.materialize()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
                else:
                    p.fill_(1.0)
        self.method = peft.method if peft is not None else "full"
        if self.method != "full":
            apply_plan(model, Plan(), GalaxyGroup.serial(hf.num_attention_heads, hf.intermediate_size, seq))
            apply_peft(model, peft, seed=seed)
        self.model = model.to(self.device).train()
        self.layer = self.model.layers[0]
        self.units = unit_totals(hf, seq)
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        self._leaves: list[torch.Tensor] = []      # inputs that take gradients, of the runner being built
        self._inputs: dict[tuple, torch.Tensor] = {}
        self._contexts: dict[int, dict] = {}

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds this bench's model runs: side-tuning adds its block; side-only runs no
        backbone layer at all."""
        if self.method == "side_only":
            return ("side", "embed", "head")
        return KINDS + (("side",) if self.method == "side" else ())

    @property
    def backbone_grad(self) -> bool:
        """Whether the backbone's layers run with autograd (side-tuning runs them without)."""
        return self.method not in ("side", "side_only")

    # --- what one kind runs ---------------------------------------------------------------

    def _context(self, rows: int) -> dict:
        if rows not in self._contexts:
            mask = torch.ones(rows, self.seq, dtype=torch.long, device=self.device)
            self._contexts[rows] = self.model.layer_context(mask)
        return self._contexts[rows]

    def _rand(self, *shape, grad=True):
        """A random input of `shape`, one per shape: the points of a profile share their inputs
        (each of 120 points holding its own kept 240 MiB at batch 12, pad 128)."""
        t = self._inputs.get((shape, grad))
        if t is None:
            t = self._inputs[shape, grad] = torch.randn(*shape, generator=self._gen, device=self.device)
            t.requires_grad_(grad)
        if grad:
            self._leaves.append(t)
        return t

    def module(self, kind: str, units: int):
        """The module `kind` runs at `units` (a sharded copy for TP)."""
        total, _ = self.units[kind]
        if kind in ("att_tp", "mlp_tp"):
            mod = copy.deepcopy(self.layer.att if kind == "att_tp" else self.layer.mlp)
            if units != total:
                shard_updates(mod, mod.shard_tp((units,), 0))
            return mod
        if kind == "side":
            mod = copy.deepcopy(self.layer.side)     # its own K/V padding: a small module
            if units != total:
                mod.block.attn.kv_gather = _PaddedKV(self.seq)
                mod.block.attn.local_rows = slice(0, units)
            return mod
        if kind == "att_sp":
            mod = copy.copy(self.layer.att)          # shares the weights; own kv_gather / local_rows
            seq = self.seq
            mod.kv_gather = _PaddedKV(seq)
            mod.local_rows = slice(0, units)
            return mod
        if kind == "mlp_sp":
            return self.layer.mlp
        if kind == "con":
            return self.layer.con1
        return self.model

    def prepare(self, kind: str, units: int, rows: int):
        """(module, forward thunk returning the outputs, gradients for them)."""
        mod, h = self.module(kind, units), self.hf.hidden_size
        if kind in ("att_tp", "att_sp"):
            tokens = self.seq if kind == "att_tp" else units
            x, ctx = self._rand(rows, tokens, h), self._context(rows)
            fwd = lambda: mod(x, **ctx)[0]     # noqa: E731  (the deferred bias is CON's)
        elif kind in ("mlp_tp", "mlp_sp"):
            x = self._rand(rows, self.seq if kind == "mlp_tp" else units, h)
            fwd = lambda: mod(x)[0]            # noqa: E731
        elif kind == "con":
            x, res = self._rand(rows, units, h), self._rand(rows, units, h)
            bias = getattr(self.layer.att, self.layer.att.deferred_bias.split(".")[0]).bias
            fwd = lambda: mod(x, bias, res)    # noqa: E731
        elif kind == "embed":
            ids = torch.randint(1, self.hf.vocab_size, (rows, self.seq), generator=self._gen, device=self.device)
            extra = {"token_type_ids": torch.zeros_like(ids)} if self.task == "classification" else {}
            fwd = lambda: mod.embed(ids, **extra)   # noqa: E731
        elif kind == "side":
            s, stream = self._rand(rows, units, self.model.side_width), self._rand(rows, units, h, grad=False)
            ctx = self._context(rows)
            fwd = lambda: mod(s, stream, ctx)   # noqa: E731
        elif kind == "head":
            carry = tuple(self._rand(rows, units, h, grad=self.backbone_grad) for _ in range(mod.carry_size))
            if self.method in ("side", "side_only"):
                carry += (self._rand(rows, units, self.model.side_width),)
            if self.task == "classification":
                labels = torch.randint(0, self.num_labels, (rows,), generator=self._gen, device=self.device)
            else:
                labels = torch.randint(0, self.hf.vocab_size, (rows, units), generator=self._gen, device=self.device)
            fwd = lambda: (mod.head(carry, labels)[1],)   # noqa: E731
        else:
            raise ValueError(f"unknown kind {kind!r}; kinds are {', '.join(KINDS)}, side")
        if kind in LAYER_KINDS and not self.backbone_grad:
            return mod, _without_autograd(fwd)
        return mod, fwd

    # --- measurements ---------------------------------------------------------------------

    def runner(self, kind: str, units: int, rows: int):
        """A function running one forward and one backward of `kind` at `units` on `rows` rows,
        returning their seconds (prepared once: a point can be timed many times, interleaved)."""
        self._leaves = []
        mod, fwd = self.prepare(kind, units, rows)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        # What backward writes gradients into. They are dropped after every run: a profile keeps a
        # runner per point (120 for MiniLM) and interleaves them, so gradients kept between runs
        # held 0.5 GB at batch 12 and pad 128, more than a 900 MiB device has (a step's own
        # gradients are fresh each step too).
        params, leaves = list(mod.parameters()), self._leaves
        grads = []

        def run() -> tuple[float, float]:
            sync()
            t0 = time.perf_counter()
            out = fwd()
            out = out if isinstance(out, tuple) else (out,)
            sync()
            t1 = time.perf_counter()
            out = tuple(o for o in out if o.requires_grad)     # a frozen or no_grad part: nothing to do
            if not out:
                return t1 - t0, 0.0
            if not grads:
                grads.extend(torch.ones_like(o) if o.dim() == 0 else self._rand(*o.shape, grad=False).to(o.dtype) for o in out)
            torch.autograd.backward(out, grads)
            sync()
            t2 = time.perf_counter()
            for t in (*params, *leaves):
                t.grad = None
            return t1 - t0, t2 - t1
        return run

    def time(self, kind: str, units: int, rows: int, repeats: int = 3, warmup: int = 1) -> tuple[float, float]:
        """Median seconds of one forward and one backward of `kind` at `units` on `rows` rows."""
        run = self.runner(kind, units, rows)
        for _ in range(warmup):
            run()
        times = [run() for _ in range(repeats)]
        return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)

    def saved_bytes(self, kind: str, units: int, rows: int) -> int:
        """Bytes autograd keeps for the backward of `kind` at `units` (galaxy.profiler's count:
        each storage once, parameters excluded)."""
        mod, fwd = self.prepare(kind, units, rows)
        with SavedActivations(mod, lambda: "x") as saved:
            out = fwd()
        del out
        return int(saved.bytes.get("x", 0))

    def params(self, kind: str, units: int) -> int:
        """Parameters a rank holds for `kind` at `units` (att_tp / mlp_tp: its shard; SP: whole)."""
        if kind in ("embed", "head"):
            raise ValueError("embed / head parameters are counted on the whole model")
        return sum(p.numel() for p in self.module(kind, units).parameters())

    def trainable(self, kind: str, units: int) -> int:
        """The parameters of params(kind, units) that train under the bench's method."""
        return sum(p.numel() for p in self.module(kind, units).parameters() if p.requires_grad)


def shard_updates(mod, dims: dict) -> None:
    """Slice the LoRA updates inside a TP shard like their projections' weights (dims: what
    shard_tp returned, {param: (dim, sizes[, parts])}), as galaxy.peft.lora shards them on rank 0."""
    for pname, (dim, sizes, *parts) in dims.items():
        owner = mod.get_submodule(pname.rpartition(".")[0])
        if isinstance(owner, LoraLinear) and pname.endswith(".weight"):
            owner.shard_like(ParamRule("sharded", dim, tuple(sizes), *parts), 0)


def _without_autograd(fwd):
    def run():
        with torch.no_grad():
            return fwd()
    return run


class _PaddedKV:
    """Stands in for KVGather on one process: pads this rank's K/V to the whole sequence, as the
    gather would, so the timed attention does the full-sequence work (galaxy.distributed.transitions)."""

    def __init__(self, seq: int):
        self.seq = seq

    def __call__(self, kv):
        return F.pad(kv, (0, 0, 0, self.seq - kv.shape[1]))

    def start(self, kv):
        out = self(kv)
        return lambda: out

    def own(self, tokens: int) -> slice:
        return slice(0, tokens)
