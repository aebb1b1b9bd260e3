"""The graph-launch floor of a CuTe DSL kernel against torch's: one tiny kernel each, graph-replayed.

    PYTHONPATH=... python3 bench/cutedsl_launch_probe.py   (writes $OUT/cutedsl_launch_probe.json)

Both graphs hold one single-thread kernel launch (CuTe DSL compiled with TVM-FFI on torch's stream;
torch's ``add_``); medians of 60 interleaved replays, L2 flushed before each (us). Equal floors mean a
CuTe DSL kernel's time above the floor is its body, not its launch.

Source: issue 13 (the moe_dispatch CuTe DSL kernel's gap to the Triton kernel, graph-replayed).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import cutlass
import cutlass.cute as cute
import torch

from kernels.cutedsl import compile_options, env_stream, fake_tensor, sym_dim

_spec = importlib.util.spec_from_file_location("chk", Path(__file__).with_name("cutedsl_moe_check.py"))
chk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chk)


@cute.kernel
def _tiny(mX: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        mX[0] = mX[0] + 1.0


@cute.jit
def _host(mX: cute.Tensor, stream):
    _tiny(mX).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)


def main() -> None:
    f = cute.compile(_host, fake_tensor(cutlass.Float32, (sym_dim(),)), env_stream(), options=compile_options())
    x = torch.zeros(4, device="cuda")
    f(x)
    torch.cuda.synchronize()
    g1 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1):
        f(x)
    z = torch.zeros(1, device="cuda")
    z.add_(1)
    torch.cuda.synchronize()
    g0 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g0):
        z.add_(1)
    r = chk._median_graph_us({"torch_tiny": g0, "cute_tiny": g1}, 60)
    print(r, "x", float(x[0]))
    Path(os.environ.get("OUT", "."), "cutedsl_launch_probe.json").write_text(json.dumps(r))


if __name__ == "__main__":
    main()
