"""How a correctness request reaches its child: through a file in the temporary directory (sessions 1-24) or
through a memfd (``guards.sandbox.child_session`` since session 25), which the child reads (what it does) or
could map (the first form of session 25's change, dropped: a mapping stays visible in ``/proc/self/maps``).

For each single-process task, builds the correctness guard's real request at one seed (every case's inputs,
as ``guards.correctness`` sends them) and times, per channel, the parent's write and a fresh process's load
of every tensor (a child loads it once; its pages are then touched by the calls).

    python bench/request_channel.py OUT.json [--seed 7] [--tasks k3_small_m_gemm,...]

Writes ``OUT`` (JSON, with the environment): per task, the request's size (bytes) and each channel's write
and load times (seconds): ``file_*``, ``memfd_write_s``, ``memfd_map_load_s``, ``memfd_read_load_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from guards.cases import correctness_cases  # noqa: E402
from workbench import env as envmod  # noqa: E402
from workbench.taskspec import list_task_ids, load_task  # noqa: E402

_LOAD = """
import sys, time, torch
t = time.perf_counter()
src, how = sys.argv[1], sys.argv[2]
if how == "fd":  # as guards/_child_main.py _load_request: read from the inherited fd
    import os
    with os.fdopen(int(src), "rb", closefd=False) as f:
        f.seek(0)
        req = torch.load(f, weights_only=True)
else:
    req = torch.load(src, mmap=how == "mmap", weights_only=True)
n = 0
for c in req["cases"]:  # touch every input, as the calls do
    for side in ("inputs_a", "inputs_b"):
        for v in (c.get(side) or {}).values():
            if isinstance(v, torch.Tensor):
                n += int(v.reshape(-1)[::1024].sum().item() != 0)
print(time.perf_counter() - t)
"""


def _load_s(src: str, how: str, pass_fds=()) -> float:
    out = subprocess.run([sys.executable, "-c", _LOAD, src, how], capture_output=True, text=True,
                         check=True, pass_fds=pass_fds)
    return float(out.stdout.strip().splitlines()[-1])


def measure(task_id: str, seed: int) -> dict:
    import torch

    task = load_task(ROOT, task_id)
    cases = correctness_cases(task, seed)
    req = {"mode": "correctness", "cases": [c.request_entry() for c in cases]}
    row: dict = {"cases": len(cases)}
    with tempfile.TemporaryDirectory(prefix="wb-bench-channel-") as tmp:
        path = Path(tmp) / "request.pt"
        t = time.perf_counter()
        torch.save(req, path)
        row["file_write_s"] = round(time.perf_counter() - t, 3)
        row["request_bytes"] = path.stat().st_size
        row["file_load_s"] = round(_load_s(str(path), "read"), 3)
    fd = os.memfd_create("wb-bench-request", 0)
    try:
        t = time.perf_counter()
        with open(fd, "wb", closefd=False) as f:
            torch.save(req, f)
        row["memfd_write_s"] = round(time.perf_counter() - t, 3)
        row["memfd_map_load_s"] = round(_load_s(f"/proc/self/fd/{fd}", "mmap", pass_fds=(fd,)), 3)
        row["memfd_read_load_s"] = round(_load_s(str(fd), "fd", pass_fds=(fd,)), 3)
    finally:
        os.close(fd)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--tasks", default="")
    args = ap.parse_args()
    ids = [t for t in (args.tasks.split(",") if args.tasks else list_task_ids(ROOT))
           if load_task(ROOT, t).distributed is None]
    rows = {}
    for t in ids:
        rows[t] = measure(t, args.seed)
        print(t, rows[t], flush=True)
    args.out.write_text(json.dumps({"bench": "request_channel", "seed": args.seed, "tempdir": tempfile.gettempdir(),
                                    "tasks": rows, "environment": envmod.collect("cpu")}, indent=1) + "\n")


if __name__ == "__main__":
    main()
