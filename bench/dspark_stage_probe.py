"""Where the CuTe DSL dspark_verify kernel's time goes: its two launches timed apart, and one call for ncu.

    python3 bench/dspark_stage_probe.py OUT.json [--reps 30]
    ncu ... python3 bench/dspark_stage_probe.py --ncu-call B CASE

At K3 sizes (D 7, V 163840, no draft probabilities), ``sampled`` and ``greedy`` rows (the task's input
cases), B 1, 8, 64: CUDA graphs of the row launch alone, of the race launch alone (after the row launch
ran once, so its flags are real) and of both, interleaved with one tiny kernel (``add_``), L2 flushed
before each, CUDA events, medians (us); with the number of sweeps each verified row took and which
filters its request had. ``--ncu-call B CASE`` runs one warm-up call and one call to profile.

Source: tasks/k3_dspark_verify/fixtures/good/cutedsl-cuda (the kernel); bench/cutedsl_dspark_check.py
(the method).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from cutedsl_dspark_check import FIX, TASK, _load, _median_graph_us, _outs  # noqa: E402

V, D = 163840, 7


def _launches(cv, x, outs):
    """(row launch, race launch) closures of ``cv`` (``_cute_verify``) for the inputs ``x`` (CUDA)."""
    B = x["target_logits"].shape[0]
    R = B * (D + 1)
    logits = x["target_logits"].view(torch.int16).reshape(R, V).view(torch.int64)
    ws = cv._workspace(logits.device)
    chw, nc = cv.race_split(B, logits.shape[1])
    q = x["uniform_draws"]
    rows = cv.ROWS.get((False, 4))
    race = cv.RACES.get((False, 4))

    def row_launch():
        rows(logits, x["draft_token_ids"], x["num_draft_tokens"], q, x["temperature"], x["top_k"], x["top_p"],
             x["uniform_draws"], ws["rowf"], ws["rowi"], D, V)

    def race_launch():
        race(logits, x["draft_token_ids"], x["num_draft_tokens"], q, x["temperature"], x["exponential_noise"],
             ws["rowf"], ws["rowi"], ws["pf"], ws["pi"], ws["cnt"], outs["output_token_ids"],
             outs["num_accepted_tokens"], D, chw, nc)

    return row_launch, race_launch, ws


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ncu-call", nargs=2, metavar=("B", "CASE"))
    a = ap.parse_args()
    inp = _load("dspark_inputs", TASK / "inputs.py")
    cv = _load("dspark_cute", FIX / "cutedsl-cuda" / "k3_model" / "kernels" / "dspark_verify" / "_cute_verify.py")
    if a.ncu_call:
        B, case = int(a.ncu_call[0]), a.ncu_call[1]
        x = {k: v.cuda() for k, v in inp.make_inputs({"B": B, "D": D, "V": V, "Q": 1}, 40 + B, case).items()}
        outs = _outs(B, D)
        row_launch, race_launch, _ = _launches(cv, x, outs)
        for _ in range(2):
            row_launch()
            race_launch()
        torch.cuda.synchronize()
        return 0
    tiny = torch.cuda.CUDAGraph()
    z = torch.zeros(1, device="cuda")
    z.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(tiny):
        z.add_(1)
    rows_out = []
    for case in ("sampled", "greedy"):
        for B in (1, 8, 64):
            x = {k: v.cuda() for k, v in inp.make_inputs({"B": B, "D": D, "V": V, "Q": 1}, 40 + B, case).items()}
            outs = _outs(B, D)
            row_launch, race_launch, ws = _launches(cv, x, outs)
            row_launch()
            race_launch()
            torch.cuda.synchronize()
            rowi = ws["rowi"].view(-1, 4)[: B * (D + 1)].cpu()
            n = x["num_draft_tokens"].cpu()
            k = x["top_k"].cpu()
            p = x["top_p"].cpu()
            t = x["temperature"].cpu()
            per_row = []
            for b in range(B):
                kind = "greedy" if float(t[b]) == 0 else ("k" if 0 < int(k[b]) < V else "") + ("p" if float(p[b]) < 1 else "")
                per_row += [(kind or "plain", int(rowi[b * (D + 1) + i, 3])) for i in range(int(n[b]) + 1)]
            kinds = {}
            for kind, sw in per_row:
                kinds.setdefault(kind, {}).setdefault(str(sw), 0)
                kinds[kind][str(sw)] += 1
            graphs = {"tiny_kernel": tiny}
            for name, fns in (("rows", (row_launch,)), ("race", (race_launch,)), ("both", (row_launch, race_launch))):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for f in fns:
                        f()
                graphs[name] = g
            med = _median_graph_us(graphs, a.reps)
            rows_out.append({"case": case, "B": B, "graph_us": med, "rows_by_filters_and_sweeps": kinds})
            print(f"{case} B {B}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()) + f"; {kinds}", flush=True)
    from workbench import env

    Path(a.out).write_text(json.dumps({"environment": env.collect("cuda"), "rows": rows_out}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
