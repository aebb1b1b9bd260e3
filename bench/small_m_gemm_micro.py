"""Microbenchmark of the k3_small_m_gemm Triton fixture's split-K kernels on a CUDA device.

For K3's and K3-mini's projection shapes and a few odd ones, at decode rows M (1-16), it times
``torch.mm`` (cuBLAS, the standard path) against the fixture's kernels under a grid of launch
parameters (outputs per program BN, K per step BK, programs per SM, pipeline stages), in two forms:
the fixture's two launches (partials, then a fixed-order reduce) and one launch in which the last
program of each output block to finish (an arrival counter) sums the partials in the same fixed order.
Each is timed as the perf guard times a call (guards/_child_main.py): L2 flushed, a CUDA event before
and after one eager call, so host launch cost counts where the GPU waits for it; median of ``reps``
calls, the sides interleaved. The best parameters per shape are then timed as CUDA-graph replays
(the bench's method). Every variant's output is checked against a float64 reference first
(max |err| / (2^-22 sqrt(K) sum|x w|), the task's atol bound: <= 1 passes).

Usage (repository root, CUDA): ``python3 bench/small_m_gemm_micro.py OUT.json [reps] [quick]``; ``quick``:
four shapes, M 1, 8 and 16, BK 128 only (a call with little device time left).
Source: issue 14 item 3; tasks/k3_small_m_gemm/task.toml (shapes, tolerance); kernels/timing.py (flush).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
KERNEL = (ROOT / "tasks/k3_small_m_gemm/fixtures/bad/perf-fp32-tl-dot-slower-than-cublas/k3_model/kernels/small_m_gemm"
          / "_triton_gemm.py")

SHAPES = {"k3_qkv_a": (2112, 7168), "k3_g_proj": (1536, 7168), "k3_q_b": (2304, 1536),
          "k3_kda_in_proj": (6288, 7168), "mid_4000x4096": (4000, 4096), "odd_2111x4099": (2111, 4099),
          "mid_1024x2048": (1024, 2048), "mini_kv_a": (576, 256)}
ROWS = (1, 2, 4, 8, 16)
GRID = [dict(BN=bn, BK=bk, PPS=pps, stages=st) for bn, bk, pps, st in
        itertools.product((32, 64), (64, 128), (2, 4, 8), (3, 4))]


def _load():
    spec = importlib.util.spec_from_file_location("small_m_gemm_triton", KERNEL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@triton.jit
def _one_launch_kernel(x_ptr, w_ptr, ws_ptr, cnt_ptr, out_ptr, M, N, K, sxm, k_per_split, S,
                       M_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pn = tl.program_id(0)
    ps = tl.program_id(1)
    n = pn * BN + tl.arange(0, BN)
    m = tl.arange(0, M_PAD)
    nm = n < N
    mm = m < M
    k_lo = ps * k_per_split
    acc = tl.zeros((M_PAD, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        xt = tl.load(x_ptr + m[:, None] * sxm + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        wt = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        acc += tl.dot(xt, tl.trans(wt), input_precision="ieee")
    tl.store(ws_ptr + (ps * M_PAD + m[:, None]) * N + n[None, :], acc, mask=mm[:, None] & nm[None, :])
    arrived = tl.atomic_add(cnt_ptr + pn, 1, sem="acq_rel", scope="gpu")
    if arrived == S - 1:  # the last split of this output block: sum every split in order 0..S-1
        tot = tl.zeros((M_PAD, BN), dtype=tl.float32)
        for s in range(0, S):
            tot += tl.load(ws_ptr + (s * M_PAD + m[:, None]) * N + n[None, :], mask=mm[:, None] & nm[None, :],
                           other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + m[:, None] * N + n[None, :], tot, mask=mm[:, None] & nm[None, :])
        tl.atomic_xchg(cnt_ptr + pn, 0)


def _splits(N, K, BN, BK, pps, sms):
    blocks = triton.cdiv(N, BN)
    steps = triton.cdiv(K, BK)
    s = max(1, min(steps, triton.cdiv(pps * sms, blocks)))
    per = triton.cdiv(steps, s) * BK
    return triton.cdiv(K, per), per


def make_launchers(tg, N, K, p, sms):
    S, per = _splits(N, K, p["BN"], p["BK"], p["PPS"], sms)
    ws = torch.empty(S * 16 * N, dtype=torch.float32, device="cuda")
    cnt = torch.zeros(triton.cdiv(N, p["BN"]), dtype=torch.int32, device="cuda")

    def two(x, w, out):
        tg._partial_kernel[(triton.cdiv(N, p["BN"]), S)](x, w, ws, x.shape[0], N, K, x.stride(0), per, M_PAD=16,
                                                         BN=p["BN"], BK=p["BK"], num_warps=4, num_stages=p["stages"])
        tg._reduce_kernel[(triton.cdiv(N, 128), x.shape[0])](ws, out, x.shape[0], N, S, M_PAD=16, BN=128, num_warps=4)

    def one(x, w, out):
        _one_launch_kernel[(triton.cdiv(N, p["BN"]), S)](x, w, ws, cnt, out, x.shape[0], N, K, x.stride(0), per, S,
                                                         M_PAD=16, BN=p["BN"], BK=p["BK"], num_warps=4,
                                                         num_stages=p["stages"])
    return {"two": two, "one": one}, S


def _err_ratio(x, w, out):
    xd, wd = x.double(), w.double()
    ref = xd @ wd.T
    bound = 2.0 ** -22 * math.sqrt(x.shape[1]) * (xd.abs() @ wd.abs().T) + 2.0 ** -22 * ref.abs()
    return float(((out.double() - ref).abs() / bound.clamp_min(1e-300)).max())


def _eager_us(fns: dict, reps: int, flush: torch.Tensor) -> dict:
    """Median microseconds per eager call (event before / after, L2 flushed first), sides interleaved."""
    samples = {k: [] for k in fns}
    for _ in range(3):
        for f in fns.values():
            f()
    torch.cuda.synchronize()
    for _ in range(reps):
        for k, f in fns.items():
            flush.zero_()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            f()
            b.record()
            torch.cuda.synchronize()
            samples[k].append(a.elapsed_time(b) * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def _graph_us(fns: dict, reps: int, flush: torch.Tensor) -> dict:
    graphs = {}
    for k, f in fns.items():
        f()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            f()
        graphs[k] = g
    samples = {k: [] for k in graphs}
    for _ in range(reps):
        for k, g in graphs.items():
            flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            samples[k].append(a.elapsed_time(b) * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def main(out_path: str, reps: int = 40, quick: bool = False) -> None:
    global GRID, SHAPES, ROWS
    if quick:
        GRID = [p for p in GRID if p["BK"] == 128]
        SHAPES = {k: SHAPES[k] for k in ("k3_qkv_a", "k3_kda_in_proj", "k3_q_b", "mini_kv_a")}
        ROWS = (1, 8, 16)
    tg = _load()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flush = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, t0 = [], time.time()
    env = {"device": torch.cuda.get_device_name(0), "sms": sms, "torch": torch.__version__,
           "cuda": torch.version.cuda, "triton": triton.__version__, "reps": reps,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", generator=gen) * 0.02
        for M in ROWS:
            x = torch.randn(M, K, device="cuda", generator=gen)
            outs = {"mm": torch.empty(M, N, device="cuda")}
            fns = {"mm": lambda x=x, w=w, o=outs["mm"]: torch.mm(x, w.t(), out=o)}
            errs = {}
            for i, p in enumerate(GRID):
                launchers, S = make_launchers(tg, N, K, p, sms)
                for form, fn in launchers.items():
                    key = f"{form}:{i}"
                    o = torch.full((M, N), float("nan"), device="cuda")
                    fn(x, w, o)
                    fn(x, w, o)  # twice: the counters must be back at 0 after the first call
                    torch.cuda.synchronize()
                    errs[key] = _err_ratio(x, w, o)
                    outs[key] = o
                    fns[key] = (lambda fn=fn, x=x, w=w, o=o: fn(x, w, o))
            eager = _eager_us(fns, reps, flush)
            best = {form: min((k for k in eager if k.startswith(form + ":")), key=eager.get) for form in ("two", "one")}
            graph = _graph_us({"mm": fns["mm"], **{k: fns[k] for k in best.values()}}, reps, flush)
            rows.append({"shape": name, "N": N, "K": K, "M": M, "mm_eager_us": eager["mm"], "mm_graph_us": graph["mm"],
                         **{f"{form}_best": {"params": GRID[int(k.split(':')[1])], "eager_us": eager[k],
                                             "graph_us": graph[k], "err_ratio": errs[k]} for form, k in best.items()},
                         "max_err_ratio": max(errs.values()),
                         "eager_us_by_params": {k: round(v, 2) for k, v in eager.items()}})
            r = rows[-1]
            print(f"{name} M={M}: mm {r['mm_eager_us']:.1f}/{r['mm_graph_us']:.1f} us, two {r['two_best']['eager_us']:.1f}/"
                  f"{r['two_best']['graph_us']:.1f} {r['two_best']['params']}, one {r['one_best']['eager_us']:.1f}/"
                  f"{r['one_best']['graph_us']:.1f} {r['one_best']['params']}, max err {r['max_err_ratio']:.3f} "
                  f"[{time.time() - t0:.0f} s]", flush=True)
            # written after every row: a call cut short by its time limit still leaves what it measured
            Path(out_path).write_text(json.dumps({"environment": env, "grid": GRID, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40, "quick" in sys.argv[3:])
