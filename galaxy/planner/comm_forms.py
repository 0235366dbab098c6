"""The bytes and calls a plan's collectives move, per kind, from the family's closed forms, split
into what every micro-batch moves and what a step moves once; and the pipeline's sends."""
from __future__ import annotations

from types import SimpleNamespace

from galaxy.models.registry import family_of


class CommForms:
    """The family's closed-form bytes and calls per collective kind, split into the part that
    scales with rows and layers (moved by every micro-batch) and the once-per-step part.

    bytes(b rows, L layers) = b L a_layer + b a_fixed + L s_layer + s_fixed, read off the closed
    form at b, L in {1, 2}; calls come from the same evaluations (per micro-batch)."""

    def __init__(self, model: dict):
        self.spec = family_of(model["model_type"])
        self.hf = dict(model["hf_config"])
        self._cache: dict = {}

    def __call__(self, att: str, mlp: str, con: str, tokens: tuple[int, ...]) -> dict:
        key = (att, mlp, con, tokens)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._forms(SimpleNamespace(att=att, mlp=mlp, con=con), tokens)
        return hit

    def _forms(self, plan, tokens) -> dict:
        f = {}
        for b in (1, 2):
            for layers in (1, 2):
                cfg = SimpleNamespace(**{**self.hf, "num_hidden_layers": layers})
                f[b, layers] = self.spec.plan_comm_bytes(plan, cfg, b, list(tokens))
        out = {}
        # sorted: the order of the float sums downstream must not depend on the hash seed
        for kind in sorted(set().union(*(d.keys() for d in f.values()))):
            v = {k: f[k].get(kind, {"sent": 0, "calls": 0}) for k in f}
            s = {k: v[k]["sent"] for k in v}
            a_layer = s[2, 2] - s[1, 2] - s[2, 1] + s[1, 1]
            a_fixed = s[2, 1] - s[1, 1] - a_layer
            s_layer = s[1, 2] - s[1, 1] - a_layer
            s_fixed = s[1, 1] - a_layer - a_fixed - s_layer
            c_layer = v[1, 2]["calls"] - v[1, 1]["calls"]
            out[kind] = dict(a_layer=a_layer, a_fixed=a_fixed, s_layer=s_layer, s_fixed=s_fixed,
                             c_layer=c_layer, c_fixed=v[1, 1]["calls"] - c_layer)
        return out


def p2p_bytes(pp: int, first: bool, last: bool, carry_bytes: float, grad_bytes: float | None = None) -> float:
    """A stage's sends per micro-batch: its carry to the next stage, the carry's gradient to the
    previous one (grad_bytes; default: as many as the carry)."""
    if pp == 1:
        return 0.0
    return (0 if last else carry_bytes) + (0 if first else (carry_bytes if grad_bytes is None else grad_bytes))
