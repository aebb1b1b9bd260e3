"""K3 model directory: config, the standard-path ops, the ``decode_backend`` switch and dispatcher.

Latency-specialized kernels live under ``k3_model/kernels/<op>/``; they are chosen only through
:mod:`k3_model.dispatch`, which records every decision.

The model itself (imported on demand; these modules import torch):
:mod:`k3_model.hf_config` (the ``kimi_k3`` config.json, K3-mini), :mod:`k3_model.layers` (pure layer
functions over explicit state), :mod:`k3_model.model` (weights, caches, one forward step),
:mod:`k3_model.decode` (the standalone decode loop), :mod:`k3_model.generate` (checkpoint writer and
loader), :mod:`k3_model.tokenizer` (the locally trained byte-level BPE).
"""

from k3_model.config import DECODE_BACKENDS, K3_MINI, K3_REAL, K3Config
from k3_model.dispatch import (
    BatchInfo,
    Decision,
    DispatchTrace,
    OpScope,
    forward_context,
    record_trace,
)

__all__ = [
    "DECODE_BACKENDS",
    "K3_MINI",
    "K3_REAL",
    "K3Config",
    "BatchInfo",
    "Decision",
    "DispatchTrace",
    "OpScope",
    "forward_context",
    "record_trace",
]
