"""CON, the one connective sub-block every family builds: deferred bias, dropout, adapter,
residual add and norm, returning (residual stream, input of the next sub-block).

  post-norm (BERT):          y = norm(dropout(x + bias) + stream)         -> (y, y)
  pre-norm (Llama, GPT-2):   stream = stream + dropout(x + bias)          -> (stream, norm(stream))

Pre-norm families give CON1 the norm before the MLP and CON2 the NEXT layer's input norm (the
final norm after the last layer; docs/design.md section 1). The dropout draws inside rng_scope
(ShardedDropout): under CON SP a plan routes them to the rank's own stream.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from galaxy.layers.rng import ShardedDropout


class Connector(ShardedDropout, nn.Module):
    def __init__(self, norm: nn.Module, dropout_p: float = 0.0, *, post_norm: bool = False):
        super().__init__()
        self.norm = norm               # LayerNorm, RMSNorm, ...: the family's
        self.dropout_p = dropout_p     # 0: no dropout in the residual path (Llama)
        self.post_norm = post_norm
        self.adapter = None            # a bottleneck adapter (galaxy.peft.adapter), when one is applied

    def forward(self, x, bias, residual):
        # x: the sub-block's output, bias: its deferred bias (or None), residual: the stream;
        # all [b, s_con, h] in the CON layout
        if bias is not None:
            x = x + bias
        if self.training and self.dropout_p > 0:
            with self.rng_scope():
                x = F.dropout(x, self.dropout_p, True)
        if self.adapter is not None:
            x = self.adapter(x)        # x + up(act(down(x))): the adapter's own skip connection
        if self.post_norm:
            y = self.norm(x + residual)
            return y, y
        stream = residual + x
        return stream, self.norm(stream)
