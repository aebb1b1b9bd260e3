"""Check and time the CuTe DSL ``k3_moe_dispatch`` kernel against the task's checker and the Triton kernel.

    python3 bench/cutedsl_moe_check.py OUT.json [--seeds 3] [--draws 32] [--reps 200] [--also NAME=PATH ...]

``--also NAME=PATH`` times one more CuTe DSL kernel module (a ``launch`` function with the same
arguments, e.g. an earlier version from git history) beside the two fixtures, after its own
correctness check (the comparison in a result file names every version it timed).

On one CUDA device, in this order (the JSON holds every number; the last lines printed are a table):

1. correctness: every fixed workload of ``tasks/k3_moe_dispatch/task.toml`` at ``--seeds`` seeds and
   ``--draws`` random domain draws (``guards.cases.domain_draws``), each checked by the task's own
   ``reference.check``, outputs poisoned before each call (every element must be written); each
   configuration called twice (the second call reuses the workspace its first call reset);
2. graph capture: the call captured in ``torch.cuda.graph`` and replayed on new inputs must equal an
   eager call (a launch that escaped capture would leave the poisoned outputs);
3. timing at K3 sizes (E 896, top-16, B 16), T 1-64: graph replays of the CuTe DSL and Triton kernels
   interleaved, L2 flushed before each (``kernels.timing.flush_l2``), CUDA events, medians (us); and
   the host cost of one eager call (us, host clock, device idle);
4. compile times per key (``kernels.cutedsl.compile_report``).

Raises (exit 1): a correctness or capture failure (all are listed in the JSON first).

Source: issue 13 item 3; METHOD.md (poisoned outputs, fresh inputs, events, medians, graphs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TASK = ROOT / "tasks" / "k3_moe_dispatch"
FIX = TASK / "fixtures" / "good"
OUTS = ("topk_weights", "topk_ids", "sorted_token_ids", "expert_ids", "num_tokens_post_padded")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _outs(T: int, E: int, K: int, B: int) -> dict[str, torch.Tensor]:
    from k3_model.ops.moe_dispatch import align_capacity

    cap, nb = align_capacity(T, K, E, B)
    d = "cuda"
    return {"topk_weights": torch.full((T, K), float("nan"), device=d),
            "topk_ids": torch.full((T, K), -7777, dtype=torch.int32, device=d),
            "sorted_token_ids": torch.full((cap,), -7777, dtype=torch.int32, device=d),
            "expert_ids": torch.full((nb,), -7777, dtype=torch.int32, device=d),
            "num_tokens_post_padded": torch.full((1,), -7777, dtype=torch.int32, device=d)}


def _call(launch, x, axes, params, outs) -> None:
    launch(x["router_logits"], x["e_score_correction_bias"], x["token_valid"], top_k=axes["K"], n_group=axes["G"],
           topk_group=axes["TG"], renormalize=params["renormalize"],
           routed_scaling_factor=params["routed_scaling_factor"], block_size=axes["B"], **outs)


def _params(axes, params) -> dict:
    return {"top_k": axes["K"], "n_group": axes["G"], "topk_group": axes["TG"], "block_size": axes["B"],
            "renormalize": params["renormalize"], "routed_scaling_factor": params["routed_scaling_factor"]}


def correctness(cute_mod, inp, ref, task, seeds: int, draws: int) -> list[dict]:
    from guards.cases import domain_draws

    configs = [(w.name, dict(w.axes), dict(w.params), w.case, s) for w in task.correctness.workloads for s in range(seeds)]
    configs += [(f"draw{i}", a, p, c, 1000 + i) for i, (a, p, c) in enumerate(domain_draws(task, 7, draws))]
    rows = []
    for name, axes, params, case, seed in configs:
        x = inp.make_inputs(axes, seed, case)
        g = {k: v.cuda() for k, v in x.items()}
        want = ref.reference(x, _params(axes, params))
        msgs = []
        for call in range(2):
            outs = _outs(axes["T"], axes["E"], axes["K"], axes["B"])
            _call(cute_mod.launch, g, axes, params, outs)
            torch.cuda.synchronize()
            got = {k: v.cpu() for k, v in outs.items()}
            msgs += [f"call {call}: {m}" for m in ref.check(x, _params(axes, params), got, want, task.correctness.tolerance)]
        rows.append({"name": name, "axes": axes, "params": params, "case": case, "seed": seed, "msgs": msgs[:5]})
    return rows


def capture(cute_mod, inp, ref, task) -> dict:
    axes = {"T": 8, "E": 896, "K": 16, "G": 1, "TG": 1, "B": 16}
    params = {"renormalize": True, "routed_scaling_factor": 1.0}
    x = {k: v.cuda() for k, v in inp.make_inputs(axes, 5, "realistic").items()}
    outs = _outs(8, 896, 16, 16)
    _call(cute_mod.launch, x, axes, params, outs)  # compiled and warm before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _call(cute_mod.launch, x, axes, params, outs)
    x2 = inp.make_inputs(axes, 6, "realistic")
    for k in x:
        x[k].copy_(x2[k])
    for v in outs.values():
        v.fill_(float("nan") if v.dtype.is_floating_point else -7777)
    g.replay()
    torch.cuda.synchronize()
    got = {k: v.cpu() for k, v in outs.items()}
    msgs = ref.check(x2, _params(axes, params), got, ref.reference(x2, _params(axes, params)), task.correctness.tolerance)
    return {"replay_msgs": msgs[:5], "unwritten": int((got["topk_ids"] == -7777).sum())}


def _median_graph_us(graphs: dict, reps: int) -> dict[str, float]:
    from kernels.timing import flush_l2

    samples = {k: [] for k in graphs}
    for _ in range(reps):
        for k, gr in graphs.items():
            flush_l2()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            gr.replay()
            b.record()
            b.synchronize()
            samples[k].append(a.elapsed_time(b) * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def timing(kernels: dict, inp, reps: int) -> list[dict]:
    rows = []
    params = {"renormalize": True, "routed_scaling_factor": 1.0}
    empty = torch.cuda.CUDAGraph()  # the launch floor of this method: one tiny kernel
    z = torch.zeros(1, device="cuda")
    z.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(empty):
        z.add_(1)
    for T in (1, 2, 4, 8, 16, 32, 64):
        axes = {"T": T, "E": 896, "K": 16, "G": 1, "TG": 1, "B": 16}
        x = {k: v.cuda() for k, v in inp.make_inputs(axes, 40 + T, "realistic").items()}
        graphs, host = {"tiny_kernel": empty}, {}
        for name, launch in kernels.items():
            outs = _outs(T, 896, 16, 16)
            for _ in range(3):
                _call(launch, x, axes, params, outs)
            torch.cuda.synchronize()
            hs = []
            for _ in range(50):
                t0 = time.perf_counter()
                _call(launch, x, axes, params, outs)
                hs.append((time.perf_counter() - t0) * 1e6)
                torch.cuda.synchronize()
            host[name] = statistics.median(hs)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                _call(launch, x, axes, params, outs)
            graphs[name] = g
        med = _median_graph_us(graphs, reps)
        rows.append({"T": T, "graph_us": med, "host_call_us": host})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--draws", type=int, default=32)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--also", action="append", default=[], metavar="NAME=PATH")
    a = ap.parse_args()
    from kernels import cutedsl
    from workbench import env
    from workbench.taskspec import load_task

    inp = _load("moe_inputs", TASK / "inputs.py")
    ref = _load("moe_reference", TASK / "reference.py")
    cute_mod = _load("moe_cute", FIX / "cutedsl-cuda" / "k3_model" / "kernels" / "moe_dispatch" / "_cute_route.py")
    triton_mod = _load("moe_triton", FIX / "triton-cuda" / "k3_model" / "kernels" / "moe_dispatch" / "_triton_route.py")
    task = load_task(ROOT, "k3_moe_dispatch")
    result: dict = {"environment": env.collect("cuda")}
    t0 = time.perf_counter()
    result["correctness"] = correctness(cute_mod, inp, ref, task, a.seeds, a.draws)
    result["correctness_s"] = time.perf_counter() - t0
    bad = [r for r in result["correctness"] if r["msgs"]]
    result["capture"] = capture(cute_mod, inp, ref, task)
    result["compile"] = cutedsl.compile_report()
    kernels = {"cutedsl": cute_mod.launch, "triton": triton_mod.launch}
    for spec in a.also:
        name, _, path = spec.partition("=")
        try:
            mod = _load(f"moe_also_{name}", Path(path))
            rows = correctness(mod, inp, ref, task, 1, 8)
        except Exception as exc:  # a variant that does not build or launch is reported and left out
            result[f"correctness_{name}"] = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"{name}: left out ({type(exc).__name__}: {str(exc)[:300]})")
            continue
        result[f"correctness_{name}"] = rows
        print(f"{name}: {sum(not r['msgs'] for r in rows)} of {len(rows)} configurations clean")
        kernels[name] = mod.launch
    result["timing"] = timing(kernels, inp, a.reps)
    Path(a.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"correctness: {len(result['correctness']) - len(bad)} of {len(result['correctness'])} configurations clean")
    for r in bad[:10]:
        print("  FAIL", r["name"], r["axes"], r["case"], r["msgs"][:2])
    print("capture:", result["capture"])
    c = result["compile"]
    print(f"compiles: {len(c['compiles'])} keys, {c['compile_s']:.1f} s in all")
    names = list(kernels)
    print("T | tiny graph | " + " | ".join(f"{n} graph" for n in names) + " | " + " | ".join(f"{n} host" for n in names) + " (us)")
    for r in result["timing"]:
        g, h = r["graph_us"], r["host_call_us"]
        print(f"{r['T']} | {g['tiny_kernel']:.1f} | " + " | ".join(f"{g[n]:.1f}" for n in names) + " | "
              + " | ".join(f"{h[n]:.1f}" for n in names))
    return 1 if bad or result["capture"]["replay_msgs"] or result["capture"]["unwritten"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
