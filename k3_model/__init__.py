"""K3 model directory: config, the standard-path ops, the ``decode_backend`` switch and dispatcher.

Latency-specialized kernels live under ``k3_model/kernels/<op>/``; they are chosen only through
:mod:`k3_model.dispatch`, which records every decision.
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
