"""What one rank of a plan holds and runs, read off the model profile: its sub-blocks' kinds and
shares, its parameters, the activations a layer saves per row. The memory and time models build on it."""
from __future__ import annotations

from galaxy.plan import Plan
from galaxy.planner.comm_forms import CommForms
from galaxy.planner.device_compute import DeviceCompute, model_signature, tables_match

MIB = 2 ** 20
FP32 = 4


class ModelTerms:
    def __init__(self, model: dict, devices: list[dict], link: dict | None, *, batch_size: int,
                 optimizer: str = "adamw"):
        self.model, self.devices, self.link = model, devices, link
        self.batch = batch_size
        self.optimizer = optimizer
        self.world = len(devices)
        self.seq = model["pad_size"]
        self.hidden = model["hf_config"]["hidden_size"]
        self.layers = model["hf_config"]["num_hidden_layers"]
        signature = model_signature(model)
        self.compute = [DeviceCompute(d, model, tables_match(d, signature)) for d in devices]
        self.comm = CommForms(model)
        p = model["params"]
        self.embed_params, self.head_params, self.tied = p["embed"], p["head"], p["tied"]
        self.other_params = p.get("other", 0)
        self.layer_params = p["layer"]
        self.acts = model["act_bytes_per_row"]
        self.carry = model["carry_tensors"]

    def _kinds(self, plan: Plan, j: int):
        """(att kind, units), (mlp kind, units), con tokens of Galaxy rank j."""
        att = ("att_tp", plan.heads[j]) if plan.att == "TP" or plan.group == 1 else ("att_sp", plan.tokens[j])
        mlp = ("mlp_tp", plan.columns[j]) if plan.mlp == "TP" or plan.group == 1 else ("mlp_sp", plan.tokens[j])
        con = plan.tokens[j] if plan.con == "SP" and plan.group > 1 else self.seq
        return att, mlp, con

    def _kind_params(self, kind: str, units: int) -> float:
        """Parameters of one sub-block kind at a share (the model profile: [c0, c1] or a constant)."""
        v = self.layer_params[kind]
        return v[0] + v[1] * units if isinstance(v, list) else v

    def layer_params_of(self, plan: Plan, j: int) -> float:
        (ak, au), (mk, mu), _ = self._kinds(plan, j)
        return self._kind_params(ak, au) + self._kind_params(mk, mu) + self.layer_params["con"]

    def summed_layer_params_of(self, plan: Plan, j: int) -> float:
        """Parameters of one layer at rank j whose gradients the Galaxy group sums (galaxy.parallel.
        grad_sync: the sequence-parallel sub-blocks' weights, which saw only this rank's tokens)."""
        if plan.group == 1:
            return 0.0
        (ak, au), (mk, mu), _ = self._kinds(plan, j)
        return ((self._kind_params(ak, au) if ak == "att_sp" else 0.0)
                + (self._kind_params(mk, mu) if mk == "mlp_sp" else 0.0)
                + (self.layer_params["con"] if plan.con == "SP" else 0.0))

    def params_of(self, plan: Plan, p: int, j: int) -> float:
        n = plan.stages[p] * self.layer_params_of(plan, j) + self.other_params
        if p == 0:
            n += self.embed_params
        if p == plan.pp - 1:
            n += self.head_params
        if plan.pp == 1:
            n -= self.tied
        return n

    def _act(self, kind: str, units: float) -> float:
        c0, c1 = self.acts[kind]
        return c0 + c1 * units

    def layer_act_per_row(self, plan: Plan, j: int) -> tuple[float, float]:
        """(bytes a layer saves per row, the largest sub-block's) at rank j's shares."""
        (ak, au), (mk, mu), con = self._kinds(plan, j)
        parts = (self._act(ak, au), self._act(mk, mu), self._act("con", con), self._act("con", con))
        return sum(parts), max(parts)

    def stage_ranks(self, plan: Plan, p: int) -> list[int]:
        g, dp = plan.group, plan.dp
        return [(p * dp + d) * g + j for d in range(dp) for j in range(g)]

    @staticmethod
    def in_flight(plan: Plan, p: int) -> int:
        """Micro-batches whose activations stage p holds at once (1f1b: min(m, pp - p); gpipe: m)."""
        if plan.pp == 1:
            return 1
        return plan.microbatches if plan.schedule == "gpipe" else min(plan.microbatches, plan.pp - p)
