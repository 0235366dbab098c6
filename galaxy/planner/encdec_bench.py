"""An encoder-decoder's two layers, run one sub-block at a time at a given share: what a rank of
a BART or T5 plan computes (the encoder-decoder counterpart of galaxy.planner.harness).

One encoder layer and one decoder layer of the family (random weights: values do not change the
work or the counts), over S = pad_size source tokens and T = target_pad_size target tokens. Each
kind runs the family's own module, as a rank of a Galaxy group would:

  encoder  att_tp   u heads        the encoder ATT sharded by shard_tp((u,), 0), [b, S, h] input
           att_sp   u tokens       the whole ATT on u source queries, K/V padded to S (the gather)
           mlp_tp / mlp_sp / con   as any family's, at S tokens / u source tokens
  decoder  att_tp / att_sp         the causal ATT over T target tokens (u heads / u queries)
           xatt_tp  u heads        the cross-attention sharded: T queries, K/V from the memory [b, S, h]
           xatt_sp  u tokens       the whole cross-attention on u target queries (no gather: the
                                   memory is whole on every rank)
           mlp_tp / mlp_sp / con   at T tokens / u target tokens (con: one of CON1, CONX, CON2)
           head     u tokens       the LM head (and loss) on u target tokens
  embed    both stacks' embeddings, replicated on every rank

With a PEFT method (peft=), the two layers are those galaxy.peft makes (apply_peft after a
one-rank plan, as training applies it): frozen weights, LoRA inside the targeted projections of
ATT, XATT and their TP shards, adapters in the CONs, a side layer beside each layer (kind "side",
u CON tokens: the encoder's side block, or the decoder's with its cross-attention to a whole side
memory). A backbone that side-tuning runs without autograd runs under no_grad here too.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from galaxy.distributed.group import GalaxyGroup
from galaxy.models.build import load_hf_config, model_class
from galaxy.models.registry import family_of
from galaxy.parallel.plan import apply_plan
from galaxy.peft import apply_peft
from galaxy.plan import Plan
from galaxy.planner.harness import _PaddedKV, _without_autograd, shard_updates
from galaxy.profiler.activations import SavedActivations

STACKS = ("encoder", "decoder")
STACK_KINDS = {"encoder": ("att_tp", "att_sp", "mlp_tp", "mlp_sp", "con"),
               "decoder": ("att_tp", "att_sp", "xatt_tp", "xatt_sp", "mlp_tp", "mlp_sp", "con")}
SEQUENCE = {"encoder": "source", "decoder": "target"}


def stack_units(hf, tokens: int) -> dict:
    """kind -> (total units, step) of one stack's layer over `tokens` tokens."""
    heads, columns = hf.num_attention_heads, _intermediate(hf)
    return {"att_tp": (heads, 1), "att_sp": (tokens, 1), "xatt_tp": (heads, 1), "xatt_sp": (tokens, 1),
            "mlp_tp": (columns, 1), "mlp_sp": (tokens, 1), "con": (tokens, 1)}


def _stack_units(hf, tokens: int, stack: str) -> dict:
    units = stack_units(hf, tokens)
    return {k: units[k] for k in STACK_KINDS[stack]}


def _intermediate(hf) -> int:
    # BartConfig: encoder_ffn_dim; T5Config: d_ff (galaxy splits one width over both stacks)
    for key in ("intermediate_size", "encoder_ffn_dim", "d_ff"):
        if getattr(hf, key, None):
            return getattr(hf, key)
    raise ValueError("the model's config names no MLP width")


class EncDecBench:
    def __init__(self, model_path: str, *, source: int, target: int, task: str | None = None,
                 num_labels: int | None = None, dropout: float | None = None, seed: int = 0, peft=None):
        """task: "seq2seq" (the LM head, None too) or "classification" (num_labels outputs);
        peft: galaxy.peft.PeftOptions of the method to run the sub-blocks under (None: full)."""
        hf = load_hf_config(model_path, dropout)
        self.hf, self.source, self.target, self.num_labels = hf, source, target, num_labels
        self.family = family_of(hf.model_type)
        cls = model_class(self.family, task)
        self.task = cls.task
        with torch.device("meta"):
            model = cls(hf, num_labels=num_labels)
        # keep one layer of each stack (the list is the encoder's layers, then the decoder's)
        model.layers = nn.ModuleList([model.layers[0], model.layers[model.encoder_layers]])
        model.encoder_layers = 1
        model.to_empty(device="cpu")
        model.materialize()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02 if p.dim() > 1 else torch.ones(p.shape))
        self.method = peft.method if peft is not None else "full"
        if self.method != "full":
            model.config = with_layers(hf, 1, 1)       # galaxy.peft names the two layers by it
            apply_plan(model, Plan(), GalaxyGroup.serial(hf.num_attention_heads, _intermediate(hf), source))
            apply_peft(model, peft, seed=seed)
        self.model = model.train()
        self.layers = {"encoder": model.layers[0], "decoder": model.layers[1]}
        self.seq, self.columns = source, _intermediate(hf)      # the GEMM rate's shape (device_profile)
        self.units = {"encoder": _stack_units(hf, source, "encoder"), "decoder": _stack_units(hf, target, "decoder")}
        if not self.backbone_grad:
            for stack in STACKS:
                self.units[stack]["side"] = (self.tokens(stack), 1)
        self._gen = torch.Generator().manual_seed(seed)

    @property
    def backbone_grad(self) -> bool:
        """Whether the backbone's layers run with autograd (side-tuning runs them without)."""
        return self.method not in ("side", "side_only")

    def tokens(self, stack: str) -> int:
        return self.source if stack == "encoder" else self.target

    def _rand(self, *shape):
        return torch.randn(*shape, generator=self._gen).requires_grad_(True)

    def _context(self, rows: int, stack: str, heads: int | None) -> dict:
        """The layer context of `stack`'s ATT (or "cross": XATT's) for `rows` rows; a mask with a
        head dimension (T5's position bias) keeps the first `heads` heads, as a TP rank's does."""
        source = torch.ones(rows, self.source, dtype=torch.long)
        target = torch.ones(rows, self.target, dtype=torch.long)
        context = self.model.layer_context(source, target)[stack]
        mask = context["mask"]
        if heads is not None and mask.dim() == 4 and mask.shape[1] > 1:
            context = {**context, "mask": mask[:, :heads]}
        return context

    def module(self, stack: str, kind: str, units: int):
        """The module `kind` of `stack`'s layer runs at `units` (a sharded copy for TP)."""
        layer, total = self.layers[stack], self.units[stack][kind][0]
        name = kind.split("_")[0]
        if kind.endswith("_tp"):
            mod = copy.deepcopy(getattr(layer, name))
            if units != total:
                shard_updates(mod, mod.shard_tp((units,), 0))
            return mod
        if kind == "side":
            mod = copy.deepcopy(layer.side)          # its own K/V padding: a small module
            if units != total:
                mod.block.attn.kv_gather = _PaddedKV(total)
                mod.block.attn.local_rows = slice(0, units)
            return mod
        if kind in ("att_sp", "xatt_sp"):
            mod = copy.copy(getattr(layer, name))      # shares the weights; its own SP attributes
            if kind == "att_sp":
                mod.kv_gather = _PaddedKV(self.tokens(stack))
            mod.local_rows = slice(0, units)
            return mod
        return layer.mlp if kind == "mlp_sp" else layer.con1

    def prepare(self, stack: str, kind: str, units: int, rows: int):
        """(module, forward thunk returning the outputs) of `kind` on `rows` rows."""
        mod, fwd = self._prepare(stack, kind, units, rows)
        return mod, fwd if self.backbone_grad or kind == "side" else _without_autograd(fwd)

    def _prepare(self, stack: str, kind: str, units: int, rows: int):
        h, seq = self.hf.hidden_size, self.tokens(stack)
        mod = self.module(stack, kind, units)
        if kind == "side":
            s = self._rand(rows, units, self.model.side_width)
            stream = self._rand(rows, units, h).detach()          # the backbone's output: no autograd
            ctx = self._context(rows, "side_" + SEQUENCE[stack], None)
            if stack == "encoder":
                return mod, lambda: mod(s, stream, ctx)
            memory = self._rand(rows, self.source, self.model.side_width)
            return mod, lambda: mod(s, stream, ctx, memory)
        if kind in ("att_tp", "att_sp"):
            x = self._rand(rows, seq if kind == "att_tp" else units, h)
            ctx = self._context(rows, SEQUENCE[stack], units if kind == "att_tp" else None)
            return mod, lambda: mod(x, **ctx)[0]
        if kind in ("xatt_tp", "xatt_sp"):
            x = self._rand(rows, seq if kind == "xatt_tp" else units, h)
            memory, ctx = self._rand(rows, self.source, h), self._context(rows, "cross", None)
            return mod, lambda: mod(x, memory, **ctx)[0]
        if kind in ("mlp_tp", "mlp_sp"):
            x = self._rand(rows, seq if kind == "mlp_tp" else units, h)
            return mod, lambda: mod(x)[0]
        x, res = self._rand(rows, units, h), self._rand(rows, units, h)
        att = self.layers[stack].att
        bias = getattr(att, att.deferred_bias.split(".")[0]).bias
        return mod, lambda: mod(x, bias, res)

    def prepare_end(self, kind: str, units: int, rows: int):
        """(model, forward thunk) of "embed" (both stacks) or "head" on `units` target tokens."""
        vocab, h, n = self.hf.vocab_size, self.hf.hidden_size, self.model.carry_size
        if kind == "embed":
            ids = torch.randint(1, vocab, (rows, self.source), generator=self._gen)
            target_ids = torch.randint(1, vocab, (rows, self.target), generator=self._gen)
            return self.model, lambda: self.model.embed(ids, decoder_input_ids=target_ids)
        carry = tuple(self._rand(rows, self.source, h) for _ in range(n))
        carry += tuple(self._rand(rows, units, h) for _ in range(n))
        if self.task == "classification":
            labels = torch.randint(0, self.num_labels, (rows,), generator=self._gen)
            self.model.pooled_at = torch.full((rows,), units - 1)    # each row's last EOS: among its tokens
        else:
            labels = torch.randint(0, vocab, (rows, units), generator=self._gen)
        return self.model, lambda: (self.model.head(carry, labels)[1],)

    def saved_bytes(self, stack: str, kind: str, units: int, rows: int) -> int:
        """Bytes autograd keeps for backward (galaxy.profiler's count: each storage once,
        parameters excluded). stack "ends": kind "embed" or "head"."""
        mod, fwd = self.prepare_end(kind, units, rows) if stack == "ends" else self.prepare(stack, kind, units, rows)
        with SavedActivations(mod, lambda: "x") as saved:
            out = fwd()
        del out
        return int(saved.bytes.get("x", 0))

    def params(self, stack: str, kind: str, units: int) -> int:
        """Parameters a rank holds for `kind` of `stack` at `units` (TP: its shard; SP: whole)."""
        return sum(p.numel() for p in self.module(stack, kind, units).parameters())

    def trainable(self, stack: str, kind: str, units: int) -> int:
        """The parameters of params(stack, kind, units) that train under the bench's method."""
        return sum(p.numel() for p in self.module(stack, kind, units).parameters() if p.requires_grad)

    def con_params(self, stack: str, trained: bool = False) -> int:
        """Parameters of every CON of one layer of `stack` (encoder two, decoder three; trained:
        those that train, a method's adapters)."""
        layer = self.layers[stack]
        return sum(p.numel() for name in layer.cons for p in getattr(layer, name).parameters()
                   if p.requires_grad or not trained)


def with_layers(hf, encoder: int, decoder: int):
    """A copy of hf with `encoder` and `decoder` layers (num_hidden_layers: the encoder's, in both
    families' configs; the decoder's key is BART's or T5's)."""
    hf = copy.deepcopy(hf)
    hf.num_hidden_layers = encoder
    for key in ("decoder_layers", "num_decoder_layers"):
        if hasattr(hf, key):
            setattr(hf, key, decoder)
    return hf
