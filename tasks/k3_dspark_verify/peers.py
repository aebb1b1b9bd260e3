"""Library peers of ``dspark_verify`` for ``workbench bench`` (see ``workbench/peers.py``).

- ``flashinfer_chain_speculative``: FlashInfer's speculative sampling (``flashinfer.sampling``
  ``chain_speculative_sampling``, with its top-k / top-p renormalisation) is the library kernel for
  this op; declared, no adapter yet: FlashInfer has never imported on the project's H200 (no package
  registry there; a 101 MB wheel whose kernels JIT-compile with nvcc on first use), so it is listed as
  not run with that reason. vLLM's rejection sampler (Triton) was measured apart:
  shared/reference/h200_peers.md.

Source: issue 13 item 4; shared/reference/h200_peers.md (vLLM's sampler on the H200).
"""

from __future__ import annotations

from workbench.peers import Peer

PEERS = [
    Peer(name="flashinfer_chain_speculative", distribution="flashinfer-python", module="flashinfer.sampling",
         covers="FlashInfer's chain speculative sampling over the target and draft probabilities (accept test, "
                "bonus / recovered token); the top-k / top-p filtering as its own calls",
         build=None, note="FlashInfer never imported on the project's H200 (no package registry there; a 101 MB "
                          "wheel that JIT-compiles its kernels with nvcc on first use)"),
]
