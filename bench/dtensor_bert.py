"""Hugging Face BERT under torch's own tensor parallelism: Megatron TP and TP+SP as
parallelize_module plans (torch.distributed.tensor.parallel), HF's modules neither copied nor
edited; and the check that such a model trains like the serial one.

On a 1-D mesh of n ranks, per layer:

  tp    query / key / value and intermediate.dense ColwiseParallel, attention.output.dense and
        output.dense RowwiseParallel: an all-reduce after each row-parallel GEMM, and one on
        each column-parallel input's gradient. LayerNorms, residuals, embeddings and head
        replicated (every rank runs them on the whole sequence).
  tpsp  Megatron sequence parallelism on top: the residual stream between sub-blocks is sharded
        on the sequence, (b, s, h) -> (b, s/n, h) per rank. PrepareModuleInput on
        BertSelfAttention and BertIntermediate all-gathers it (Shard(1) -> Replicate; the
        attention mask stays a keyword, untouched); the row-parallel GEMMs reduce-scatter into
        sequence shards (output_layouts Shard(1)); the dropout + residual of BertSelfOutput /
        BertOutput then add two (b, s/n, h) shards, and SequenceParallel runs their LayerNorms
        on the shard with replicated weights (whose gradients DTensor sums over the shards).
        The encoder's input is sliced to the rank's shard (Replicate -> Shard(1), no
        communication) rather than the embeddings' output, because BertModel builds the
        attention mask from the embeddings' output: a sharded one would give it s/n query rows.
        The pooler reads token 0, so its input is gathered back (Shard(1) -> Replicate).

Local heads: HF's attention reshapes with head size and -1 heads, so halving its head count is
all the column split needs (even shards only: heads and columns divisible by n).
"""
from __future__ import annotations

import torch

NUM_LABELS = 4


def load_bert(model_path: str, dtype: torch.dtype = torch.float32):
    """BertForSequenceClassification with a new NUM_LABELS head (seed 0) and dropout off."""
    from transformers import BertForSequenceClassification
    torch.manual_seed(0)
    return BertForSequenceClassification.from_pretrained(
        model_path, num_labels=NUM_LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa").to(dtype)


def layer_plan(prefix: str, sequence_parallel: bool) -> dict:
    """The parallel style of each module of one BertLayer (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    plan = {f"{prefix}.attention.self.{name}": ColwiseParallel() for name in ("query", "key", "value")}
    plan[f"{prefix}.intermediate.dense"] = ColwiseParallel()
    if not sequence_parallel:
        plan[f"{prefix}.attention.output.dense"] = RowwiseParallel()
        plan[f"{prefix}.output.dense"] = RowwiseParallel()
        return plan
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                use_local_output=True)
    plan.update({
        f"{prefix}.attention.self": gather,                       # (b, s/n, h) -> (b, s, h)
        f"{prefix}.intermediate": gather,
        f"{prefix}.attention.output.dense": RowwiseParallel(output_layouts=Shard(1)),   # reduce-scatter
        f"{prefix}.output.dense": RowwiseParallel(output_layouts=Shard(1)),
        # local outputs: the residual adds plain (b, s/n, h) tensors, as HF writes it
        f"{prefix}.attention.output.LayerNorm": SequenceParallel(use_local_output=True),
        f"{prefix}.output.LayerNorm": SequenceParallel(use_local_output=True),
    })
    return plan


def parallelize_bert(model, mesh, sequence_parallel: bool):
    """Applies the tp or tpsp plan (module docstring) to `model` in place on the 1-D `mesh`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module
    n = mesh.size()
    plan = {}
    for i, layer in enumerate(model.bert.encoder.layer):
        plan.update(layer_plan(f"bert.encoder.layer.{i}", sequence_parallel))
        layer.attention.self.num_attention_heads //= n
        layer.attention.self.all_head_size //= n
    if sequence_parallel:
        # the residual stream stays plain local tensors; DTensors live inside the styles only
        plan["bert.encoder"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                  use_local_output=True)
        plan["bert.pooler"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                 use_local_output=True)
    parallelize_module(model, mesh, plan)
    return model


def build_dtensor_bert(model_path: str, sequence_parallel: bool, dtype: torch.dtype = torch.float32):
    """The HF model under the tp or tpsp plan on a 1-D CPU mesh over the default group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return parallelize_bert(load_bert(model_path, dtype), mesh, sequence_parallel)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient as the serial model's whole tensor."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def worst_error(pairs: dict) -> tuple[float, str]:
    """The worst relative error over {name: (tensor, reference)}: max |a - b| over max(max |b|,
    1e-3 x the largest reference value), as tests/support/parity.py takes it (the key bias's
    gradient is zero in exact arithmetic, so its reference is rounding noise), and where."""
    floor = 1e-3 * max(ref.abs().max().item() for _, ref in pairs.values())
    errs = {name: ((a - b).abs().max() / max(b.abs().max().item(), floor)).item() for name, (a, b) in pairs.items()}
    worst = max(errs, key=errs.get)
    return errs[worst], worst


def check_against_serial(parallel, serial, batch: dict, optimizer=torch.optim.SGD, lr: float = 0.1) -> dict:
    """One training step of both models on the same batch (forward, backward, `optimizer`):
    the worst relative error (worst_error) of the loss, the logits, every gradient, the
    LayerNorm weights' gradients alone (summed over the sequence shards under SP) and every
    weight after the step. The weights' gradients are compared whole (full_tensor)."""
    out_p, out_s = parallel(**batch), serial(**batch)
    out_p.loss.backward()
    out_s.loss.backward()
    ref = dict(serial.named_parameters())
    grads = {n: (full_tensor(p.grad), ref[n].grad) for n, p in parallel.named_parameters()}
    norms = {n: pair for n, pair in grads.items() if "LayerNorm" in n}
    for model in (parallel, serial):
        optimizer(model.parameters(), lr=lr).step()
    weights = {n: (full_tensor(p.detach()), ref[n].detach()) for n, p in parallel.named_parameters()}
    return {"loss": worst_error({"loss": (out_p.loss.detach(), out_s.loss.detach())}),
            "logits": worst_error({"logits": (full_tensor(out_p.logits.detach()), out_s.logits.detach())}),
            "grad": worst_error(grads), "layernorm_grad": worst_error(norms), "weight": worst_error(weights),
            "tensors": len(grads)}
