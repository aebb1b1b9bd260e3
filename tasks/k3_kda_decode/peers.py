"""Library peers of ``kda_decode`` for ``workbench bench`` (see ``workbench/peers.py``).

- ``fla_fused_recurrent``: FLA's fused recurrent KDA forward (``fla-core``,
  ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd``, Triton), one token per sequence, with the
  state pool indexed by ``ssm_state_indices`` (V-first, updated in place) and the q/k L2 norm, the gate
  ``lower_bound * sigmoid(exp(A_log) * (raw_g + dt_bias))`` and the beta sigmoid inside its kernel: the
  whole op. It has no padding rows: its state indices are the op's clamped to >= 0, so a padding row
  updates the null slot 0 (same work per row) instead of being skipped, and its output there is not 0.
  It runs on its own copy of the pool and its own output tensor.

Source: issue 14 item 1 (peer: FLA's fused recurrent KDA kernel where it installs); fla-core 0.6.0
``fla/ops/kda/fused_recurrent.py`` (argument names and the gate formula with ``lower_bound``, read
there); kernel_targets.md §5.1 (the step's math), §5.2 (vLLM runs FLA's kernel for K3's KDA decode).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workbench.peers import Peer


def fla_step(inputs: Mapping[str, Any], *, lower_bound: float, state, slots, out) -> None:
    """One decode step by FLA's kernel: ``inputs`` as the op's (CUDA, float32), ``state`` the (S, H, V, K)
    pool it updates in place, ``slots`` (B,) int32 slot per row (>= 0), ``out`` (B, 1, H, V) float32.

    Raises:
        ImportError: fla-core is not installed.
    """
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    q, k, v = (inputs[n].unsqueeze(1) for n in ("q", "k", "v"))  # (B, T = 1, H, K|V)
    fused_recurrent_kda_fwd(q, k, v, inputs["raw_g"].unsqueeze(1), inputs["raw_beta"].unsqueeze(1),
                            A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], initial_state=state,
                            inplace_final_state=True, state_v_first=True, ssm_state_indices=slots,
                            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                            lower_bound=float(lower_bound), out=out)


def _fla_build(inputs: Mapping[str, Any], kwargs: Mapping[str, Any]):
    import torch

    state = inputs["state"].clone()  # the peer's own pool
    slots = inputs["state_indices"].clamp(min=0).to(torch.int32)
    out = torch.empty_like(inputs["v"].unsqueeze(1))
    lower_bound = float(kwargs["lower_bound"])
    return lambda: fla_step(inputs, lower_bound=lower_bound, state=state, slots=slots, out=out)


PEERS = [
    Peer(name="fla_fused_recurrent", distribution="fla-core", module="fla.ops.kda.fused_recurrent",
         covers="the whole step (L2 norm, gate, beta, state update in place, output) in one Triton launch; "
                "padding rows update the null slot 0 instead of being skipped",
         build=_fla_build),
]
