"""Check and time the CuTe DSL ``k3_dspark_verify`` kernel against the task's checker and the Triton kernel.

    python3 bench/cutedsl_dspark_check.py OUT.json [--seeds 2] [--draws 16] [--reps 50] [--batches 1,2,...]

On one CUDA device, in this order (the JSON holds every number; the last lines printed are a table):

1. correctness: every fixed workload of ``tasks/k3_dspark_verify/task.toml`` at ``--seeds`` seeds and
   ``--draws`` random domain draws (``guards.cases.domain_draws``), each checked by the task's own
   ``reference.check``, outputs poisoned before each call (every element must be written); each
   configuration called twice (the second call reuses the workspace and counters its first call reset);
   and, per configuration, the batch-permutation relation (``inputs.permute_requests``: same rows, exactly);
2. graph capture: the call captured in ``torch.cuda.graph`` and replayed on new inputs must pass the checker
   (a launch that escaped capture would leave the poisoned outputs);
3. timing at K3 sizes (D 7, V 163840, no draft probabilities), B 1-64, ``sampled`` and ``greedy`` rows (the
   task's input cases): graph replays of the CuTe DSL and Triton kernels, of the op's standard path
   (``--standard``), of earlier versions (``--also``) and of one tiny kernel (``add_``),
   interleaved, L2 flushed before each (``kernels.timing.flush_l2``), CUDA events, medians (us); the bytes
   floor = the target logits (B x 8 x V x 2 bytes) and the noise (B x V x 4) read once at the bandwidth of a
   1 GiB device copy measured in the same run;
4. compile times per key (``kernels.cutedsl.compile_report``).

Raises (exit 1): a correctness or capture failure (all are listed in the JSON first).

Source: issue 13 item 3; METHOD.md (poisoned outputs, fresh inputs, events, medians, graphs);
bench/cutedsl_moe_check.py (the same method for the moe kernel).
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
TASK = ROOT / "tasks" / "k3_dspark_verify"
FIX = TASK / "fixtures" / "good"
OUTS = ("output_token_ids", "num_accepted_tokens")
POISON = -7777


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _outs(B: int, D: int) -> dict[str, torch.Tensor]:
    return {"output_token_ids": torch.full((B, D + 1), POISON, dtype=torch.int32, device="cuda"),
            "num_accepted_tokens": torch.full((B,), POISON, dtype=torch.int32, device="cuda")}


def _call(launch, x, D, outs) -> None:
    dp = x["draft_probs"]
    launch(x["target_logits"], x["draft_token_ids"], x["num_draft_tokens"], dp if dp.numel() > 0 else None,
           x["temperature"], x["top_k"], x["top_p"], x["uniform_draws"], x["exponential_noise"],
           max_draft_tokens=D, **outs)


def _run(launch, x_cpu, D) -> dict[str, torch.Tensor]:
    g = {k: v.cuda() for k, v in x_cpu.items()}
    outs = _outs(x_cpu["target_logits"].shape[0], D)
    _call(launch, g, D, outs)
    torch.cuda.synchronize()
    return {k: v.cpu() for k, v in outs.items()}


def correctness(launch, inp, ref, task, seeds: int, draws: int) -> list[dict]:
    from guards.cases import domain_draws

    configs = [(w.name, dict(w.axes), dict(w.params), w.case, s) for w in task.correctness.workloads for s in range(seeds)]
    configs += [(f"draw{i}", a, p, c, 1000 + i) for i, (a, p, c) in enumerate(domain_draws(task, 7, draws))]
    rows = []
    for name, axes, _params, case, seed in configs:
        D = axes["D"]
        prm = {"max_draft_tokens": D}
        x = inp.make_inputs(axes, seed, case)
        want = ref.reference(x, prm)
        msgs: list[str] = []
        got = None
        for call in range(2):
            got = _run(launch, x, D)
            msgs += [f"call {call}: {m}" for m in ref.check(x, prm, got, want, task.correctness.tolerance)]
        if hasattr(inp, "permute_requests") and axes["B"] > 1:
            try:
                tx, info = inp.permute_requests(x, axes, prm, seed)
            except TypeError:
                tx, info = None, None
            if tx is not None:
                tgot = _run(launch, tx, D)
                msgs += [f"permuted: {m}" for m in ref.request_permutation_relation(x, got, tx, tgot, info, prm, {})]
        rows.append({"name": name, "axes": axes, "case": case, "seed": seed, "msgs": msgs[:5]})
        print(f"  {name} seed {seed}: {'ok' if not msgs else msgs[:2]}", flush=True)
    return rows


def capture(launch, inp, ref, task) -> dict:
    axes = {"B": 8, "D": 7, "V": 163840, "Q": 1}
    prm = {"max_draft_tokens": 7}
    x = {k: v.cuda() for k, v in inp.make_inputs(axes, 5, "sampled").items()}
    outs = _outs(8, 7)
    _call(launch, x, 7, outs)  # compiled and warm before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _call(launch, x, 7, outs)
    x2 = inp.make_inputs(axes, 6, "sampled")
    for k in x:
        x[k].copy_(x2[k])
    for v in outs.values():
        v.fill_(POISON)
    g.replay()
    torch.cuda.synchronize()
    got = {k: v.cpu() for k, v in outs.items()}
    msgs = ref.check(x2, prm, got, ref.reference(x2, prm), task.correctness.tolerance)
    return {"replay_msgs": msgs[:5], "unwritten": int((got["output_token_ids"] == POISON).sum())}


def _copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted), median of 20."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ts = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e-3)
    del a, b
    return 2 * (1 << 30) / statistics.median(ts)


def _median_graph_us(graphs: dict, reps: int) -> dict[str, float]:
    from kernels.timing import flush_l2

    samples: dict[str, list[float]] = {k: [] for k in graphs}
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


def _sweeps(cute_mod, x, B: int, D: int) -> dict[str, int]:
    """How many sweeps over its row each verified position of the last CuTe DSL call took (value -> rows)."""
    rowi = cute_mod._WORKSPACES[str(x["target_logits"].device)]["rowi"].view(-1, 4)[: B * (D + 1), 3].cpu()
    n = x["num_draft_tokens"].cpu()
    vals = [int(rowi[b * (D + 1) + i]) for b in range(B) for i in range(int(n[b]) + 1)]
    return {str(v): vals.count(v) for v in sorted(set(vals))}


def timing(kernels: dict, inp, reps: int, batches: list[int], cases: list[str], bw: float,
           cute_mod=None) -> list[dict]:
    rows = []
    tiny = torch.cuda.CUDAGraph()
    z = torch.zeros(1, device="cuda")
    z.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(tiny):
        z.add_(1)
    V, D = 163840, 7
    for case in cases:
        for B in batches:
            axes = {"B": B, "D": D, "V": V, "Q": 1}
            x = {k: v.cuda() for k, v in inp.make_inputs(axes, 40 + B, case).items()}
            graphs = {"tiny_kernel": tiny}
            for name, launch in kernels.items():
                outs = _outs(B, D)
                for _ in range(3):
                    _call(launch, x, D, outs)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    _call(launch, x, D, outs)
                graphs[name] = g
            sweeps = _sweeps(cute_mod, x, B, D) if cute_mod is not None else None
            med = _median_graph_us(graphs, reps)
            logit_bytes = B * (D + 1) * V * 2
            noise_bytes = B * V * 4
            row = {"case": case, "B": B, "graph_us": med, "logits_bytes": logit_bytes,
                   "floor_logits_us": logit_bytes / bw * 1e6, "floor_logits_noise_us": (logit_bytes + noise_bytes) / bw * 1e6,
                   "cutedsl_row_sweeps": sweeps}
            rows.append(row)
            print(f"  {case} B {B}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
                  + f", floor {row['floor_logits_us']:.1f} / {row['floor_logits_noise_us']:.1f}; sweeps {sweeps}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--draws", type=int, default=16)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--cases", default="sampled,greedy")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--standard", action="store_true", help="also time the op's standard path (torch), graph-replayed")
    ap.add_argument("--also", action="append", default=[], metavar="NAME=PATH",
                    help="also time another version of _cute_verify.py (its own correctness: 8 domain draws)")
    a = ap.parse_args()
    from kernels import cutedsl
    from workbench import env
    from workbench.taskspec import load_task

    inp = _load("dspark_inputs", TASK / "inputs.py")
    ref = _load("dspark_reference", TASK / "reference.py")
    init = _load("dspark_cute_init", FIX / "cutedsl-cuda" / "k3_model" / "kernels" / "dspark_verify" / "__init__.py")
    cute_mod = _load("dspark_cute", FIX / "cutedsl-cuda" / "k3_model" / "kernels" / "dspark_verify" / "_cute_verify.py")
    triton_mod = _load("dspark_triton", FIX / "triton-cuda" / "k3_model" / "kernels" / "dspark_verify" / "_triton_verify.py")

    def cute_launch(tl, dr, n, dp, t, k, p, u, e, *, max_draft_tokens, output_token_ids, num_accepted_tokens):
        init.check_args(tl, dr, dp, max_draft_tokens)
        cute_mod.launch(tl, dr, n, dp, t, k, p, u, e, max_draft_tokens=max_draft_tokens,
                        output_token_ids=output_token_ids, num_accepted_tokens=num_accepted_tokens)

    task = load_task(ROOT, "k3_dspark_verify")
    result: dict = {"environment": env.collect("cuda")}
    bad: list = []
    if not a.skip_correctness:
        t0 = time.perf_counter()
        result["correctness"] = correctness(cute_launch, inp, ref, task, a.seeds, a.draws)
        result["correctness_s"] = time.perf_counter() - t0
        bad = [r for r in result["correctness"] if r["msgs"]]
        print(f"correctness: {len(result['correctness']) - len(bad)} of {len(result['correctness'])} configurations clean",
              flush=True)
        for r in bad[:10]:
            print("  FAIL", r["name"], r["axes"], r["case"], r["seed"], r["msgs"][:2], flush=True)
    result["capture"] = capture(cute_launch, inp, ref, task)
    print("capture:", result["capture"], flush=True)
    result["compile"] = cutedsl.compile_report()
    bw = _copy_bandwidth()
    result["copy_bandwidth_GBps"] = bw / 1e9
    from k3_model.ops.dspark_verify import dspark_verify_standard

    kernels = {"cutedsl": cute_launch, "triton": triton_mod.launch}
    if a.standard:
        kernels["standard"] = dspark_verify_standard
    for spec in a.also:
        name, _, path = spec.partition("=")
        try:
            mod = _load(f"dspark_also_{name}", Path(path))
            rows = correctness(mod.launch, inp, ref, task, 0, 8)
        except Exception as exc:  # a variant that does not build or launch is reported and left out
            result[f"correctness_{name}"] = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"{name}: left out ({type(exc).__name__}: {str(exc)[:300]})")
            continue
        result[f"correctness_{name}"] = rows
        print(f"{name}: {sum(not r['msgs'] for r in rows)} of {len(rows)} configurations clean", flush=True)
        kernels[name] = mod.launch
    result["timing"] = timing(kernels, inp, a.reps, [int(b) for b in a.batches.split(",")], a.cases.split(","), bw,
                              cute_mod)
    Path(a.out).write_text(json.dumps(result, indent=1, default=str))
    c = result["compile"]
    print(f"compiles: {len(c['compiles'])} keys, {c['compile_s']:.1f} s in all; copy bandwidth {bw / 1e9:.0f} GB/s")
    print("case | B | tiny | cutedsl | triton | standard | floor (logits) | cutedsl / floor | triton / cutedsl (us)")
    for r in result["timing"]:
        g = r["graph_us"]
        std = f"{g['standard']:.1f}" if "standard" in g else "-"
        print(f"{r['case']} | {r['B']} | {g['tiny_kernel']:.1f} | {g['cutedsl']:.1f} | {g['triton']:.1f} | {std} | "
              f"{r['floor_logits_us']:.1f} | {g['cutedsl'] / r['floor_logits_us']:.2f}x | {g['triton'] / g['cutedsl']:.2f}x")
    return 1 if bad or result["capture"]["replay_msgs"] or result["capture"]["unwritten"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
