"""Median per-call time (us, one thread, CPU) of the standard moe path, the lean good fixture and the
honest tie-break candidate (as committed, and optionally another version of its file) at three perf
shapes. Usage: python bench/tie_break_timing.py OUT.json [OLD_KERNEL.py]. Session 7: why the honest
candidate's margin at grouped_t64 was thin (stop 23's CI measured 1.036x there)."""

import importlib.util
import json
import platform
import statistics
import sys
import time

import torch

sys.path[:0] = [".", "tasks/k3_moe_dispatch"]
from inputs import make_inputs  # noqa: E402

from k3_model.ops import moe_dispatch as std  # noqa: E402

TIE = "tests/exploits/honest/honest-tie-break-highest-index/k3_model/kernels/moe_dispatch/__init__.py"
LEAN = "tasks/k3_moe_dispatch/fixtures/good/lean-torch-cpu/k3_model/kernels/moe_dispatch/__init__.py"
SHAPES = {"grouped_t64": dict(T=64, E=256, K=8, G=8, TG=4, B=32), "ungrouped_t64": dict(T=64, E=384, K=8, G=1, TG=1, B=16),
          "ungrouped_t1": dict(T=1, E=384, K=8, G=1, TG=1, B=16),
          # the perf workloads whose margin was thinnest in session 9's CI (1.043x at mini_t1)
          "mini_t1": dict(T=1, E=32, K=4, G=1, TG=1, B=16), "k3_t1": dict(T=1, E=896, K=16, G=1, TG=1, B=16)}


def load(path):
    spec = importlib.util.spec_from_file_location(f"m{abs(hash(path))}", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m.moe_route_dispatch


def main(out, old=None):
    torch.set_num_threads(1)
    fns = {"standard": std.moe_route_dispatch_standard, "lean": load(LEAN), "tie_break": load(TIE)}
    if old:
        fns["tie_break_old"] = load(old)
    rows = {}
    for name, w in SHAPES.items():
        inp = make_inputs(w, 0)
        cap, nb = std.align_capacity(w["T"], w["K"], w["E"], w["B"])
        kw = dict(top_k=w["K"], n_group=w["G"], topk_group=w["TG"], renormalize=True, routed_scaling_factor=2.5,
                  block_size=w["B"])
        med = {}
        for label, f in fns.items():
            o = dict(topk_weights=torch.empty(w["T"], w["K"]), topk_ids=torch.empty(w["T"], w["K"], dtype=torch.int32),
                     sorted_token_ids=torch.empty(cap, dtype=torch.int32), expert_ids=torch.empty(nb, dtype=torch.int32),
                     num_tokens_post_padded=torch.empty(1, dtype=torch.int32))
            ts = []
            for _ in range(1000):
                t = time.perf_counter_ns()
                f(inp["router_logits"], inp["e_score_correction_bias"], inp["token_valid"], **kw, **o)
                ts.append(time.perf_counter_ns() - t)
            med[label] = statistics.median(ts[200:]) / 1e3
        rows[name] = {"axes": w, "median_us": {k: round(v, 1) for k, v in med.items()},
                      "speedup_vs_standard": {k: round(med["standard"] / v, 3) for k, v in med.items() if k != "standard"}}
    env = {"machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread, os.cpu_count {__import__('os').cpu_count()}",
           "torch": torch.__version__, "python": platform.python_version(), "calls": "1000 per side, first 200 dropped, median"}
    json.dump({"what": __doc__.splitlines()[0], "environment": env, "rows": rows}, open(out, "w"), indent=2)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
