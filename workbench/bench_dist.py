"""``workbench bench`` for distributed tasks: one process per TP rank, NCCL, decode batch sweep.

For each world size W and each token count T (the task's batch axis) at the template workload's
sizes (hidden 7168 for ``k3_allreduce_rmsnorm``), every rank times, interleaved A B after warm-up,
with the one harness in :mod:`kernels.timing` (CUDA events, L2 flushed, a barrier before every timed
call so no rank's sample includes waiting for a late peer):

- ``standard_eager`` / ``kernel_eager``: the standard path and the latency-specialized path, eager;
- ``standard_graph`` / ``kernel_graph``: each captured once into a CUDA graph (NCCL collectives
  included) and replayed. A graph is proved fresh before it is timed: new inputs are copied into its
  static buffers, it is replayed, and the task's checker compares the result with the reference.

``torch.compile`` of a collective is not measured (the standard path's all-reduce is a c10d call).
Per call the slowest rank's sample counts (a collective ends when its last rank does). Floor per
configuration: ``max(one graph launch, S / algbw)`` where S is one rank's partial in bytes and algbw
the algorithm bandwidth of a large (256 MiB) bf16 NCCL all-reduce measured in the same run: an
all-reduce of S bytes cannot finish faster than the best large all-reduce moves S bytes.

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0`` and friends, set before NCCL starts).

Source: issue 8 (decode batch 1-64 at hidden 7168, bf16, world sizes 2/4/8 where lent); issue 3
(benchmark conventions); kernel_targets.md §1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from guards.sandbox import NO_MULTICAST_ENV, free_tcp_port
from workbench import envs

VARIANTS = ("standard_eager", "standard_graph", "kernel_eager", "kernel_graph")
LARGE_ALLREDUCE_BYTES = 256 * 2**20


def run_bench_distributed(root: Path, task, worktree: Path, *, candidate: str | None, world_sizes: Sequence[int],
                          batches: Sequence[int], workload: str | None, repetitions: int, out_dir: Path,
                          timeout_s: float) -> list[Path]:
    """Run the sweep for each world size; write ``<task>_tp<W>.json`` and ``.png``; return the JSON paths.

    Raises:
        ValueError: a world size needs more GPUs than the machine has.
        RuntimeError: a rank's process failed (its stderr tail in the message).
    """
    import torch

    gpus = torch.cuda.device_count()
    paths = []
    for world in world_sizes:
        if world > gpus:
            raise ValueError(f"workbench bench: world size {world} needs {world} GPUs; this machine has {gpus}. "
                             "Pass --world-sizes with sizes that fit.")
        out = out_dir / f"{task.task_id}_tp{world}.json"
        init = f"tcp://127.0.0.1:{free_tcp_port()}"
        env = dict(os.environ, **NO_MULTICAST_ENV, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        procs, logs = [], []
        for rank in range(world):
            args = {"worktree": str(worktree), "task_root": str(task.root), "task_id": task.task_id,
                    "batches": list(batches), "workload": workload or task.perf.workloads[0],
                    "repetitions": repetitions, "out": str(out), "candidate": candidate,
                    "rank": rank, "world": world, "init": init}
            log_dir = envs.BENCH_LOG_DIR.read()  # kept when set (a killed run leaves its logs)
            log = (open(log_dir / f"{task.task_id}_tp{world}_rank{rank}.log", "w+") if log_dir
                   else tempfile.TemporaryFile("w+"))  # not in out_dir: result folders hold results only
            logs.append(log)
            # started from the workbench checkout (its harness); the rank puts the worktree first on
            # sys.path before importing k3_model, so the candidate's kernel is the one measured
            procs.append(subprocess.Popen([sys.executable, "-m", "workbench.bench_dist", json.dumps(args)],
                                          cwd=str(Path(__file__).resolve().parents[1]), env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
        try:
            codes = [p.wait(timeout=timeout_s) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            codes = [p.wait() for p in procs]
        tails = []
        for rank, log in enumerate(logs):
            log.seek(0)
            text = log.read()
            log.close()
            print(text[-4000:] if rank == 0 else "", end="")
            tails.append(text[-2000:])
        if any(codes) or not out.is_file():
            bad = next((r for r, c in enumerate(codes) if c), 0)
            raise RuntimeError(f"workbench bench: rank {bad} of {world} failed (status {codes[bad]}): {tails[bad]}")
        plot(out, out.with_suffix(".png"))
        paths.append(out)
    return paths


# --------------------------------------------------------------------------------- rank side


def _measure(args: dict[str, Any]) -> dict[str, Any] | None:
    import datetime
    import importlib

    import torch
    import torch.distributed as dist

    from guards.cases import build_case, load_task_module, rank_inputs
    from k3_model.dispatch import forward_context
    from kernels import stats, timing
    from workbench import env as envmod
    from workbench.taskspec import load_task

    rank, world = int(args["rank"]), int(args["world"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=args["init"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
    task = load_task(Path(args["task_root"]).parents[1], args["task_id"])
    template = task.workload(args["workload"])
    ref = load_task_module(task, "reference")
    mod_name, fn_name = task.target.split(":")
    op = getattr(importlib.import_module(mod_name), fn_name)
    lim = timing.device_limits()

    def barrier() -> None:
        torch.cuda.synchronize()
        dist.barrier()

    big = torch.ones(LARGE_ALLREDUCE_BYTES // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        dist.all_reduce(big)
    barrier()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(5):
        dist.all_reduce(big)
    t1.record()
    t1.synchronize()
    algbw_gbps = LARGE_ALLREDUCE_BYTES / (t0.elapsed_time(t1) / 5 * 1e-3) / 1e9
    del big
    inplace = {k for k, o in task.outputs.items() if o.inplace}
    reps = int(args["repetitions"])
    rows = []
    for T in args["batches"]:
        axes = dict(template.axes)
        axes[task.scope.batch_axis] = int(T)
        axes[task.distributed.world_size_axis] = world
        w = template.model_copy(update={"axes": axes, "name": f"bench-{world}-{T}"})
        case = build_case(task, w, seed=1234 + int(T))
        mine_a = rank_inputs(case.inputs_a, case.per_rank, rank)
        mine_b = rank_inputs(case.inputs_b, case.per_rank, rank)
        sides = {s: {k: v.cuda() for k, v in mine_a.items()} for s in ("standard", "kernel")}
        bufs = {s: {k: torch.empty(sp["shape"], dtype=getattr(torch, sp["dtype"]), device="cuda")
                    for k, sp in case.output_specs.items() if not sp.get("inplace")} for s in sides}

        def call(side: str):
            backend = "standard" if side == "standard" else "latency_specialized"

            def f() -> None:
                with forward_context(decode_backend=backend, phase=case.phase, tp_size=world, requests=case.requests,
                                     query_len=case.query_len):
                    op(**sides[side], **case.kwargs, **bufs[side])
            return f

        std, ker = call("standard"), call("kernel")
        barrier()
        eager = timing.time_pair(std, ker, device="cuda", warmup=20, repetitions=reps, before_call=barrier)
        print(f"rank {rank} W={world} T={T}: eager timed", flush=True)
        graphs, fresh = {}, {}
        for side, fn in (("standard", std), ("kernel", ker)):
            barrier()
            g = timing.capture_graph(fn, warmup=3)
            for k, v in mine_b.items():  # new data into the static buffers; a stale graph fails the check
                sides[side][k].copy_(v.cuda())
            barrier()
            g.replay()
            torch.cuda.synchronize()
            got = {k: (sides[side][k] if k in inplace else bufs[side][k]).cpu() for k in case.output_specs}
            fresh[side] = ref.check(case.inputs_b, case.kwargs, got, ref.reference(case.inputs_b, case.kwargs),
                                    task.correctness.tolerance)
            graphs[side] = g
        print(f"rank {rank} W={world} T={T}: graphs captured and checked fresh", flush=True)
        if any(fresh.values()):
            raise RuntimeError(f"T={T}: a graph replay on new inputs is wrong: {fresh}")
        graph = timing.time_pair(graphs["standard"].replay, graphs["kernel"].replay, device="cuda", warmup=10,
                                 repetitions=reps, before_call=barrier)
        samples = {"standard_eager": eager.baseline.samples_us, "kernel_eager": eager.candidate.samples_us,
                   "standard_graph": graph.baseline.samples_us, "kernel_graph": graph.candidate.samples_us}
        everyone = [None] * world
        dist.all_gather_object(everyone, samples)
        slowest = {v: [max(xs) for xs in zip(*(e[v] for e in everyone))] for v in VARIANTS}
        if rank == 0:
            med = stats.median
            main_in = sides["kernel"][task.scope.dtype_input]
            nbytes = int(main_in.numel() * main_in.element_size())
            row = {"batch": int(T), "world_size": world, "axes": axes, "samples_us": slowest,
                   **{f"{v}_us": med(slowest[v]) for v in VARIANTS}}
            row["speedup_vs_graph"] = row["standard_graph_us"] / row["kernel_graph_us"]
            row["speedup_vs_graph_ci99"] = stats.bootstrap_ratio_ci(slowest["standard_graph"], slowest["kernel_graph"],
                                                                    confidence=0.99, resamples=1000)
            row["speedup_vs_eager"] = row["standard_eager_us"] / row["kernel_eager_us"]
            row["speedup_vs_eager_ci99"] = stats.bootstrap_ratio_ci(slowest["standard_eager"], slowest["kernel_eager"],
                                                                    confidence=0.99, resamples=1000)
            row["message_bytes"] = nbytes
            row["floor_graph_us"] = max(lim.graph_launch_us, nbytes / (algbw_gbps * 1e9) * 1e6)
            row["kernel_graph_pct_of_floor"] = 100.0 * row["floor_graph_us"] / row["kernel_graph_us"]
            rows.append(row)
            print(f"W={world} T={T:3d} std eager {row['standard_eager_us']:7.1f} graph {row['standard_graph_us']:6.1f}"
                  f" | kernel eager {row['kernel_eager_us']:6.1f} graph {row['kernel_graph_us']:6.1f} | "
                  f"x{row['speedup_vs_graph']:.2f} vs graph, x{row['speedup_vs_eager']:.2f} vs eager, "
                  f"{row['kernel_graph_pct_of_floor']:.0f}% of floor", flush=True)
        del graphs
    dist.barrier()
    # no destroy_process_group(): with collectives captured in CUDA graphs it hung on the H200 pair
    # (bench/results/h200x2/log_x2_call1.txt); the process exits right after its result is written
    if rank != 0:
        return None
    return {"schema": "workbench-bench-dist/1", "task_id": task.task_id, "workload": template.name,
            "candidate": args.get("candidate"), "world_size": world, "variants": list(VARIANTS),
            "device_limits": lim.to_dict(), "large_allreduce_algbw_gbps": algbw_gbps,
            "timing": {"repetitions": reps, "flush_l2": True, "interleaved": True, "timer": "cuda_event",
                       "statistic": "median of the per-call slowest rank", "barrier_before_each_call": True},
            "nccl_env": {k: os.environ.get(k) for k in NO_MULTICAST_ENV},
            "environment": {**envmod.collect("cuda"), "gpu_count": torch.cuda.device_count()},
            "k3_model_from": str(Path(sys.modules["k3_model"].__file__).parent), "rows": rows}


def plot(json_path: Path, png_path: Path) -> None:
    """Microseconds per call against tokens for every variant (log-log), with the floor
    (:func:`workbench.bench.plot` with this bench's labels)."""
    from workbench.bench import plot as plot_rows

    plot_rows(json_path, png_path, floor_label="floor (graph launch / large all-reduce algbw)",
              xlabel="decode tokens T", ylabel="us per call (median of the slowest rank)")


def main(argv: list[str]) -> int:
    """Rank entry: ``python -m workbench.bench_dist '<json args>'`` (see :func:`run_bench_distributed`)."""
    for k, v in NO_MULTICAST_ENV.items():
        os.environ[k] = v
    args = json.loads(argv[0])
    import faulthandler

    faulthandler.dump_traceback_later(envs.BENCH_HANG_DUMP_S.read(), exit=True)
    sys.path.insert(0, str(Path(args["worktree"]).resolve()))  # before k3_model is imported: the candidate's
    result = _measure(args)
    if result is not None:
        Path(args["out"]).write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown of the NCCL communicator (see _measure)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
