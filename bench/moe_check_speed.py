"""What the k3_moe_dispatch checker costs a correctness judgment, with and without its vectorized fast paths.

Builds the correctness guard's configurations at one seed (``guards.cases.correctness_cases``), and for each
checks outputs as a correct candidate returns them (the reference's own, each row's experts reversed and the
dispatch laid out anew, as a kernel with another order within the row returns them) three times, as the
guard checks three calls a configuration: once with ``check`` as it is and once with its fast paths
(``_rows_equal_to_want``, ``_alignment_equal``) turned off, which leaves the per-row and per-expert walks.

    python bench/moe_check_speed.py OUT.json [--seed 7]

Writes ``OUT`` (JSON, with the environment): the configurations, the seconds of each form and their ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from guards.cases import correctness_cases  # noqa: E402
from workbench import env as envmod  # noqa: E402
from workbench.taskspec import load_task  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # as the judge's checks run beside the children
    task = load_task(ROOT, "k3_moe_dispatch")
    spec = importlib.util.spec_from_file_location("_moe_reference", ROOT / "tasks/k3_moe_dispatch/reference.py")
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    tol = task.correctness.tolerance
    calls = []
    for case in correctness_cases(task, args.seed):
        params = dict(case.kwargs)
        want = ref.reference({k: v.clone() for k, v in case.inputs_a.items()}, params)
        got = {k: v.clone() for k, v in want.items()}
        got["topk_ids"], got["topk_weights"] = want["topk_ids"].flip(1), want["topk_weights"].flip(1)
        got.update(ref.align(got["topk_ids"], case.inputs_a["router_logits"].shape[1], int(params["block_size"])))
        calls += [(case.inputs_a, params, got, want)] * 3

    def run() -> tuple[float, int]:
        t0, lines = time.perf_counter(), 0
        for inputs, params, got, want in calls:
            lines += len(ref.check(inputs, params, got, want, tol))
        return time.perf_counter() - t0, lines

    fast_s, fast_lines = run()
    real = ref._rows_equal_to_want, ref._alignment_equal
    ref._rows_equal_to_want = lambda got, want, valid, *a: torch.zeros_like(valid, dtype=torch.bool)
    ref._alignment_equal = lambda *a: False
    walk_s, walk_lines = run()
    ref._rows_equal_to_want, ref._alignment_equal = real
    out = {"bench": "moe_check_speed", "seed": args.seed, "configurations": len(calls) // 3, "calls": len(calls),
           "mismatch_lines": {"fast": fast_lines, "walk": walk_lines},
           "seconds": {"fast": round(fast_s, 3), "walk": round(walk_s, 3)}, "speedup": round(walk_s / fast_s, 2),
           "environment": envmod.collect("cpu")}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("configurations", "mismatch_lines", "seconds", "speedup")}))


if __name__ == "__main__":
    main()
