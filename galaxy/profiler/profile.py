"""profile_model: count, measure and attribute one training step of a model.

Two kinds of passes over the same step (forward, loss.backward(), optional gradient sync):

1. One counting pass under torch's FlopCounterMode (with galaxy's formulas), which also records
   the tensors saved for the backward and the collectives issued. Counting slows every op, so:
2. `warmup` untimed steps, then `repeats` timed steps with only the timing hooks; the median
   of each module's time is reported.

Attribution (galaxy.profiler.tracer): forward work to the modules on the call stack, backward work
to the module that created each autograd node; inclusive figures roll exclusive ones up the tree.
"""
from __future__ import annotations

import re
import statistics
import time
from collections import Counter, defaultdict
from typing import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from galaxy.models.family import GalaxyModel
from galaxy.profiler.activations import SavedActivations
from galaxy.profiler.comm import CommRecorder
from galaxy.profiler.formulas import FUSED_SOFTMAX, Formulas, elementwise_ops
from galaxy.profiler.report import ModuleStats, ProfileReport, SubBlockStats, Totals
from galaxy.profiler.tracer import ModuleTracer

# A layer's sub-blocks in the order they run (an encoder-decoder's decoder layer adds XATT, the
# cross-attention, and CONX, the connective after it) -> kind
SUB_BLOCKS = {"att": "ATT", "con1": "CON", "xatt": "XATT", "conx": "CON", "mlp": "MLP", "con2": "CON"}
_SUB_BLOCK_NAME = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(att|con1|xatt|conx|mlp|con2)$")


def loss_of(output) -> torch.Tensor:
    """The scalar to call backward on: galaxy's (logits, loss), an HF ModelOutput, or a tensor."""
    if isinstance(output, (tuple, list)):
        if len(output) > 1 and isinstance(output[1], torch.Tensor):
            return output[1]
        output = output[0]
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    if hasattr(output, "logits"):
        output = output.logits
    return output.float().sum()


def parent_of(name: str) -> str | None:
    return None if name == "" else name.rpartition(".")[0]


def _sync_device(model: nn.Module) -> Callable[[], None]:
    p = next(model.parameters(), None)
    if p is not None and p.device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _step(model, batch, grad_sync, recorder=None, after_forward=None):
    if recorder:
        recorder.phase = "forward"
    loss = loss_of(model(**batch))
    if after_forward:
        after_forward()
    if recorder:
        recorder.phase = "backward"
    loss.backward()
    if recorder:
        recorder.phase = "grad_sync"
    if grad_sync is not None:
        grad_sync()


class _Counting:
    """The counting pass: FLOPs per op and module, forward and backward, and saved bytes."""

    def __init__(self, model, batch, grad_sync):
        self.formulas = Formulas()
        self.fwd = defaultdict(Counter)       # module -> op -> FLOPs, inclusive
        self.bwd = defaultdict(Counter)       # module -> op -> FLOPs, exclusive
        self.fwd_total = self.bwd_total = Counter()
        self._marks: list = []
        tracer = ModuleTracer(model, self._on_forward, self._on_backward)
        self.recorder = CommRecorder()
        with FlopCounterMode(display=False, custom_mapping=self.formulas.mapping) as self.counter, \
                tracer, SavedActivations(model, lambda: tracer.current) as self.saved, self.recorder:
            start = self._counts()
            _step(model, batch, grad_sync, self.recorder, after_forward=lambda: self._forward_done(tracer, start))
            tracer.release_graph()
        self.bwd_total = self._counts() - self.fwd_end
        self.called = tracer.called

    def _forward_done(self, tracer, start):
        self.fwd_end = self._counts()
        self.fwd_total = self.fwd_end - start
        tracer.tag_graph()

    def _counts(self) -> Counter:
        c = Counter(self.counter.flop_counts["Global"])
        c.update(self.formulas.fused)
        return c

    def _on_forward(self, name, phase):
        if phase == "enter":
            self._marks.append(self._counts())
        else:
            self.fwd[name] += self._counts() - self._marks.pop()

    def _on_backward(self, name, phase):
        if phase == "enter":
            self._marks.append(self._counts())
        else:
            self.bwd[name] += self._counts() - self._marks.pop()


class _Timing:
    """One timed step: seconds per module, forward inclusive, backward exclusive."""

    def __init__(self, model, batch, grad_sync, sync_device):
        self.fwd, self.bwd = Counter(), Counter()
        self._sync = sync_device
        self._starts: list = []
        tracer = ModuleTracer(model, lambda n, p: self._mark(self.fwd, n, p),
                              lambda n, p: self._mark(self.bwd, n, p))
        with tracer:
            loss = loss_of(model(**batch))
            sync_device()
            tracer.tag_graph()
            t0 = time.perf_counter()
            loss.backward()
            sync_device()
            self.bwd_wall = time.perf_counter() - t0
            tracer.release_graph()
        if grad_sync is not None:
            grad_sync()

    def _mark(self, seconds: Counter, name: str, phase: str) -> None:
        self._sync()
        if phase == "enter":
            self._starts.append(time.perf_counter())
        else:
            seconds[name] += time.perf_counter() - self._starts.pop()


def memory_of(model: nn.Module, act_bytes: int, optimizer_states: int = 2, dp_shards: int = 1) -> dict:
    """Bytes one rank holds for training: its weights, the gradients of the trainable ones, the
    optimizer's per-element state (optimizer_states tensors per trainable parameter: AdamW 2, SGD
    without momentum 0) and the activations saved for backward (act_bytes; under activation
    checkpointing a recomputed layer's inputs only). dp_shards: replicas the first three are
    sharded over (dp_sharding; FSDP splits dim 0 with padding, the figure is the largest rank's)."""
    def share(p) -> int:
        rows = p.shape[0] if p.dim() else 1
        return -(-rows // dp_shards) * (p.numel() // max(rows, 1)) * p.element_size()
    params = list(model.parameters())
    trainable = sum(share(p) for p in params if p.requires_grad)
    return {"weights": sum(share(p) for p in params), "grads": trainable,
            "optimizer": optimizer_states * trainable, "activations": act_bytes, "dp_shards": dp_shards}


def profile_model(model: nn.Module, batch: dict, *, grad_sync: Callable[[], None] | None = None,
                  repeats: int = 3, warmup: int = 1, plan: dict | None = None, optimizer_states: int = 2,
                  dp_shards: int = 1) -> ProfileReport:
    """Profile one training step: model(**batch), backward of its loss, then grad_sync().

    repeats=0 skips the timed steps (latencies are then 0): counts only, one step.
    optimizer_states, dp_shards: for the memory figures (memory_of).
    Leaves the model in train mode with gradients zeroed. Under a plan, pass the model built
    for this rank and the GradientSync; the report then holds this rank's local figures.
    """
    model.train()
    model.zero_grad(set_to_none=True)
    counting = _Counting(model, batch, grad_sync)
    model.zero_grad(set_to_none=True)
    sync_device = _sync_device(model)
    for _ in range(warmup if repeats else 0):
        _step(model, batch, grad_sync)
        model.zero_grad(set_to_none=True)
    timings = []
    for _ in range(repeats):
        timings.append(_Timing(model, batch, grad_sync, sync_device))
        model.zero_grad(set_to_none=True)
    report = _assemble(model, batch, counting, timings, plan)
    report.memory = memory_of(model, report.totals.act_bytes, optimizer_states, dp_shards)
    return report


def _median(values) -> float:
    return statistics.median(values) if values else 0.0


def _assemble(model, batch, counting: _Counting, timings: list[_Timing], plan) -> ProfileReport:
    elementwise = elementwise_ops() | {FUSED_SOFTMAX}
    split = lambda ops: (sum(v for k, v in ops.items() if k not in elementwise),  # noqa: E731
                         sum(v for k, v in ops.items() if k in elementwise))
    mods = dict(model.named_modules())
    children = defaultdict(list)
    for name in mods:
        if name:
            children[parent_of(name)].append(name)

    # Exclusive backward figures; work outside any node (gradient accumulation) goes to the model.
    bwd_ops = {n: Counter(c) for n, c in counting.bwd.items()}
    bwd_ops.setdefault("", Counter()).update(counting.bwd_total - sum(counting.bwd.values(), Counter()))
    fwd_s = {n: _median([t.fwd[n] for t in timings]) for n in mods}
    bwd_s = {n: _median([t.bwd[n] for t in timings]) for n in mods}
    bwd_s[""] = max(0.0, _median([t.bwd_wall for t in timings]) - sum(bwd_s[n] for n in mods if n))

    stats: dict[str, ModuleStats] = {}

    def build(name: str) -> ModuleStats:
        for child in children[name]:
            build(child)
        kids = [stats[c] for c in children[name]]
        called = name in counting.called
        fwd = counting.fwd_total if name == "" else counting.fwd.get(name, Counter())
        fwd_mm, fwd_ew = split(fwd)
        if not called and name:          # a container, or weights its parent applies
            fwd_mm = sum(k.fwd_flops for k in kids)
            fwd_ew = sum(k.fwd_elementwise_flops for k in kids)
        bwd_mm, bwd_ew = split(bwd_ops.get(name, Counter()))
        module = mods[name]
        s = ModuleStats(
            name=name, type=type(module).__name__, depth=0 if name == "" else name.count(".") + 1,
            params=sum(p.numel() for p in module.parameters()),
            fwd_flops=fwd_mm, macs=fwd_mm // 2, fwd_elementwise_flops=fwd_ew,
            bwd_flops=bwd_mm + sum(k.bwd_flops for k in kids),
            bwd_elementwise_flops=bwd_ew + sum(k.bwd_elementwise_flops for k in kids),
            act_bytes=counting.saved.bytes.get(name, 0) + sum(k.act_bytes for k in kids),
            fwd_latency_s=fwd_s[name] if called or name == "" else sum(k.fwd_latency_s for k in kids),
            bwd_latency_s=bwd_s[name] + sum(k.bwd_latency_s for k in kids),
            called=called or name == "")
        stats[name] = s
        return s

    root = build("")
    order = list(mods)                   # definition order, parents before children
    totals = Totals(params=root.params, fwd_flops=root.fwd_flops, bwd_flops=root.bwd_flops, macs=root.macs,
                    elementwise_flops=root.fwd_elementwise_flops, bwd_elementwise_flops=root.bwd_elementwise_flops,
                    act_bytes=root.act_bytes, fwd_latency_s=root.fwd_latency_s, bwd_latency_s=root.bwd_latency_s)
    group = model.attached.group if isinstance(model, GalaxyModel) else None   # or any nn.Module
    ids = next(v for v in batch.values() if isinstance(v, torch.Tensor))
    return ProfileReport(
        model=type(model).__name__, batch_size=ids.shape[0], seq_len=ids.shape[1],
        rank=group.rank if group else 0, world=group.size if group else 1, plan=plan,
        totals=totals, modules=[stats[n] for n in order], sub_blocks=_sub_blocks(order, stats),
        comm=counting.recorder.stats.to_dict(), notes=_notes(model, counting),
        fwd_ops={str(k): v for k, v in sorted(counting.fwd_total.items(), key=lambda kv: -kv[1])},
        bwd_ops={str(k): v for k, v in sorted(counting.bwd_total.items(), key=lambda kv: -kv[1])})


def _sub_blocks(order: list[str], stats: dict) -> list[SubBlockStats]:
    """The figures of every layer's sub-blocks, in layer order, each layer's in running order."""
    out = []
    for name in order:
        match = _SUB_BLOCK_NAME.match(name)
        if match:
            m = stats[name]
            out.append(SubBlockStats(
                layer=int(match.group(1)), name=match.group(2), kind=SUB_BLOCKS[match.group(2)],
                params=m.params, fwd_flops=m.fwd_flops, bwd_flops=m.bwd_flops, macs=m.macs,
                fwd_elementwise_flops=m.fwd_elementwise_flops, bwd_elementwise_flops=m.bwd_elementwise_flops,
                act_bytes=m.act_bytes, fwd_latency_s=m.fwd_latency_s, bwd_latency_s=m.bwd_latency_s))
    running = list(SUB_BLOCKS)
    return sorted(out, key=lambda s: (s.layer, running.index(s.name)))


def _notes(model, counting: _Counting) -> list[str]:
    notes = ["2 FLOPs per multiply-add; fwd/bwd FLOPs and MACs count matrix products only "
             "(linear layers, attention scores and attention-weighted values)",
             "attention backward = 2x its forward (dQ, dK, dV, dP); a flash kernel's recomputation is not counted"]
    causal = counting.formulas.saw_causal or (model.task == "causal_lm" if isinstance(model, GalaxyModel)
                                              else type(model).__name__.endswith("ForCausalLM"))
    if causal:
        notes.append("causal attention is counted dense (all s x s scores, the masked half included): "
                     "about twice the useful attention score/value work")
    return notes
