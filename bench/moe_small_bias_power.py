"""How often the MoE correctness cases catch a kernel that drops a small correction bias, per run-time seed.

Replays, in this process, what the correctness guard checks of the bad fixture ``correctness-drops-small-bias``
(it routes with a zero bias whenever max |bias| <= 0.1): for each of N fresh seeds, the task's correctness cases
(fixed workloads and random draws) inside the fixture's declared scope (decode steps), the fixture's routing on
each call's inputs, and ``tasks/k3_moe_dispatch/reference.py`` ``check`` against the reference. A seed whose cases
never disagree is one where correctness would pass the fixture (perf's per-call check may still catch it).

    python bench/moe_small_bias_power.py N > LOG      # run from the checkout whose tasks/ are measured

Prints one line per seed (the seed and the first workload that caught the fixture, or None), then
``missed M of N``. Session 27: 15 of 300 seeds missed with the bias spread fixed at 0.05 (commit 79dd745), 0 of
150 with the spread drawn per draw (39803c4): ``bench/results/cpu/moe_small_bias_power_session27/`` (those logs
came from the session's replay script, of which this file is the tidied copy with the same steps).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

FIXTURE = Path("tasks/k3_moe_dispatch/fixtures/bad/correctness-drops-small-bias/k3_model/kernels/moe_dispatch")
sys.path.insert(0, str(FIXTURE))

from _lean import lean  # noqa: E402  (the fixture's own routing)

from guards.cases import correctness_cases, load_task_module  # noqa: E402
from workbench.taskspec import load_task  # noqa: E402


def main() -> None:
    n = int(sys.argv[1])
    task = load_task(Path("."), "k3_moe_dispatch")
    ref = load_task_module(task, "reference")
    missed = 0
    for _ in range(n):
        seed = random.getrandbits(31)
        caught = None
        for c in correctness_cases(task, seed):
            if c.phase != "decode":  # outside the fixture's SCOPE: the standard path runs there
                continue
            for inp in (c.inputs_a, c.inputs_b):
                if float(inp["e_score_correction_bias"].abs().max()) > 0.1:
                    continue  # the fixture keeps the bias: right
                outs = {k: torch.empty(s["shape"], dtype=getattr(torch, s["dtype"])) for k, s in c.output_specs.items()}
                lean(inp["router_logits"].clone(), torch.zeros_like(inp["e_score_correction_bias"]), inp["token_valid"].clone(),
                     **c.kwargs, **outs)
                want = ref.reference({k: v.clone() for k, v in inp.items()}, dict(c.kwargs))
                if ref.check(inp, dict(c.kwargs), outs, want, task.correctness.tolerance):
                    caught = c.name
                    break
            if caught:
                break
        print(seed, caught, flush=True)
        missed += caught is None
    print("missed", missed, "of", n)


if __name__ == "__main__":
    main()
