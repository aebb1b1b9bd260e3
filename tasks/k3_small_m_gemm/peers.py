"""Library peers of ``small_m_gemm`` for ``workbench bench`` (see ``workbench/peers.py``).

- ``cublas_linear``: ``torch.nn.functional.linear(x, W)``, vLLM's generic unquantized linear on CUDA
  (``dispatch_unquantized_gemm``): one cuBLAS GEMM (the library picks its own small-M / split-K kernel)
  into a new output tensor. The whole op.

Source: issue 14 item 3 (peer: cuBLAS through torch, in the same run); kernel_targets.md §6.1 (vLLM's
generic path is F.linear on CUDA; K3's own CuTe DSL skinny GEMM and dsv3_fused_a tables are for bf16
weights, and these projections are float32 here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workbench.peers import Peer


def _linear_build(inputs: Mapping[str, Any], kwargs: Mapping[str, Any]):
    import torch.nn.functional as F

    x, w = inputs["x"], inputs["weight"]
    return lambda: F.linear(x, w)


PEERS = [
    Peer(name="cublas_linear", distribution="torch", module="torch.nn.functional",
         covers="the whole op: one cuBLAS GEMM through F.linear (vLLM's unquantized linear), a new output tensor",
         build=_linear_build),
]
