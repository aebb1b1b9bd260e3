"""Microbenchmark of the split-vocabulary k3_dspark_verify Triton kernel on a CUDA device.

For each decode batch of the bench template (workload ``k3_b1``: V 163840, D 7, one-hot drafts,
its realistic greedy/sampled mix; ``build_case`` with seed 1234 + B under the workload name
``bench_b<B>``, so these are other draws than ``workbench bench``'s, which are named ``bench-<B>``),
and for a few extra draws (draft probabilities, all requests sampled, the parameter sweep), it checks the
kernel's outputs with the task's checker, counts rows by how their thresholds were resolved
(0: no top-k / top-p or greedy, 1: exact in the refine launch, 2: serial fallback) and times the
first 1, 2 and all 3 launches as CUDA-graph replays, the L2 flushed (256 MiB written) before each
replay, interleaved, median of ``reps`` (microseconds, CUDA events).

Usage (repository root): ``python3 bench/dspark_micro.py OUT.json [reps]``. Writes one JSON file.
Source: issue 3 (targets); kernels/timing.py (the workbench's own timing rules, followed here).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from guards.cases import build_case, load_task_module  # noqa: E402
from workbench.taskspec import load_task  # noqa: E402

KERNEL = ROOT / "tasks/k3_dspark_verify/fixtures/good/triton-cuda/k3_model/kernels/dspark_verify/_triton_verify.py"


def _load_kernel():
    spec = importlib.util.spec_from_file_location("dspark_triton_verify", KERNEL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _time_graphs(fns: dict, reps: int) -> dict:
    """Median microseconds of each callable captured as a CUDA graph, replays interleaved."""
    flush = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device="cuda")
    graphs = {}
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs[name] = g
    samples = {k: [] for k in graphs}
    for _ in range(3):
        for g in graphs.values():
            g.replay()
    torch.cuda.synchronize()
    for _ in range(reps):
        for name, g in graphs.items():
            flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            samples[name].append(a.elapsed_time(b) * 1000.0)
    return {k: {"median_us": statistics.median(v), "min_us": min(v)} for k, v in samples.items()}


def main(out_path: str, reps: int = 30) -> None:
    tv = _load_kernel()
    task = load_task(ROOT, "k3_dspark_verify")
    ref = load_task_module(task, "reference")
    tpl = task.workload("k3_b1")
    configs = [(f"bench_b{b}", {"B": b}, tpl.case, 1234 + b) for b in (1, 2, 4, 8, 16, 32, 64)]
    configs += [("dp_b8", {"B": 8, "Q": 2}, "realistic", 7), ("sampled_b8", {"B": 8}, "sampled", 8),
                ("sampled_b64", {"B": 64}, "sampled", 9), ("params_sweep_b9", {"B": 9}, "params_sweep", 10)]
    rows = []
    for name, upd, case_name, seed in configs:
        axes = dict(tpl.axes, **upd)
        w = tpl.model_copy(update={"axes": axes, "name": name, "case": case_name})
        x = build_case(task, w, seed=seed).inputs_a
        g = {k: v.cuda() for k, v in x.items()}
        B, D1, V = x["target_logits"].shape
        D = D1 - 1
        out = torch.full((B, D1), -7, dtype=torch.int32, device="cuda")
        acc = torch.full((B,), -7, dtype=torch.int32, device="cuda")
        dp = g["draft_probs"] if g["draft_probs"].numel() else None

        def call(stages=3):
            tv.launch(g["target_logits"], g["draft_token_ids"], g["num_draft_tokens"], dp, g["temperature"],
                      g["top_k"], g["top_p"], g["uniform_draws"], g["exponential_noise"], max_draft_tokens=D,
                      output_token_ids=out, num_accepted_tokens=acc, stages=stages)

        t0 = time.time()
        call()
        torch.cuda.synchronize()
        first_s = time.time() - t0
        got = {"output_token_ids": out.cpu(), "num_accepted_tokens": acc.cpu()}
        want = ref.reference(x, {"max_draft_tokens": D})
        msgs = ref.check(x, {"max_draft_tokens": D}, got, want, task.correctness.tolerance)
        ws = next(iter(tv._WORKSPACES.values()))
        rowi = ws["rowi"][: B * D1 * 24].view(B * D1, 24).cpu()
        n = x["num_draft_tokens"]
        active = torch.tensor([r % D1 <= int(n[r // D1]) for r in range(B * D1)])
        states = {str(s): int(((rowi[:, 2] == s) & active).sum()) for s in (0, 1, 2)}
        times = _time_graphs({"stats": lambda: call(1), "stats+refine": lambda: call(2), "all": lambda: call(3)}, reps)
        row = {"config": name, "axes": axes, "case": case_name, "seed": seed, "check_messages": msgs[:5],
               "exact_rows": int((got["output_token_ids"] == want["output_token_ids"]).all(1).sum()), "rows": B,
               "row_states": states, "first_call_s": first_s, "graph_us": times}
        rows.append(row)
        print(f"{name:16s} check {'OK ' if not msgs else 'BAD'} states {states} "
              + " ".join(f"{k} {v['median_us']:.1f}" for k, v in times.items()), flush=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "triton": __import__("triton").__version__, "reps": reps}
    Path(out_path).write_text(json.dumps({"schema": "dspark-micro/1", "environment": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)
