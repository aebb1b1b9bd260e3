"""``workbench bench TASK``: decode-batch sweep of the standard path against a kernel, on CUDA.

For each batch size (the task's batch axis) at the sizes of one template workload (default: the first
perf workload whose sizes fit every batch of the sweep, real K3 sizes for ``k3_moe_dispatch``), four
ways of running the op, all
timed with the one harness in :mod:`kernels.timing` (CUDA events, L2 flushed, interleaved A B):

- ``standard_eager``: the standard path, torch eager (``decode_backend=standard``);
- ``standard_graph``: the standard path captured once and replayed as a CUDA graph (the fair
  baseline: no host launch overhead);
- ``standard_compile``: ``torch.compile(dynamic=True)`` of the op on the standard path;
- ``kernel_eager`` / ``kernel_graph``: the latency-specialized path (``decode_backend=
  latency_specialized``), eager and replayed as a CUDA graph.

Each graph is checked to rewrite its outputs (poisoned before a replay) and, for the kernel, to
recompute them on new inputs (the task's checker against its reference). Library peers the task declares
(``tasks/<id>/peers.py``, :mod:`workbench.peers`) are timed the same way, graph-replayed and interleaved
with the kernel's graph (``peer_<name>_graph_us``, ``kernel_vs_<name>`` = peer / kernel); the result's
``peers`` lists each with its version and what it covers, or why it did not run. Per configuration:
medians (us), speedups, the physical floor ``max(min bytes / measured copy bandwidth, one launch)`` and
% of it reached (graph: one tiny kernel's graph replay timed interleaved with the kernel's graph in that
row, ``launch_graph_us``; eager: the launch measured at the start). The measurement runs in a child process rooted at the candidate's worktree (so its
``k3_model`` is imported, never into the workbench process); the parent writes ``<task>.json`` and
``<task>.png`` with the environment.

Source: issue 3 "Benchmarks" and "Targets".
"""

from __future__ import annotations

import collections
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
VARIANTS = ("standard_eager", "standard_graph", "standard_compile", "kernel_eager", "kernel_graph")


def batch_fits(task: Any, template: Any, batch: int) -> bool:
    """Whether ``template``'s axes and params with the batch axis set to ``batch`` meet the task's
    ``[domain] constraints`` (e.g. kda_decode's ``S >= B + 1``: a state slot per row); cost caps, which
    bound the CI machine's correctness draws, do not apply to a benchmark."""
    if task.domain is None:
        return True
    values = {**dict(template.axes), task.scope.batch_axis: int(batch), **dict(template.params)}
    return task.domain.satisfied(values, cost=False)


def template_workload(task: Any, batches: Sequence[int]) -> str:
    """The default template: the first perf workload whose sizes fit every batch of the sweep
    (:func:`batch_fits`), else the first perf workload (the batches it cannot take are skipped, and said)."""
    for name in task.perf.workloads:
        if all(batch_fits(task, task.workload(name), b) for b in batches):
            return name
    return task.perf.workloads[0]


def run_bench(root: Path, task_id: str, *, candidate: str | None, device: str = "cuda",
              batches: Sequence[int] = DEFAULT_BATCHES, workload: str | None = None, repetitions: int = 200,
              compile_standard: bool = True, out_dir: Path | None = None, timeout_s: float = 900,
              world_sizes: Sequence[int] | None = None) -> Path:
    """Benchmark a task's op over decode batches; write JSON and PNG; return the JSON path.

    Args:
        root: the workbench checkout.
        task_id: task id.
        candidate: overlay folder, patch or branch holding the kernel (committed into a worktree as
            ``workbench run`` does); ``None`` benchmarks the checkout as it is.
        device: must be ``cuda``.
        batches: batch sizes (requests).
        workload: template workload name (default: :func:`template_workload`).
        repetitions: timed calls per side and pair (count).
        compile_standard: also time ``torch.compile`` of the standard path.
        out_dir: where to write (default ``bench/results/local``).
        timeout_s: wall-clock limit of the measuring child (seconds).
        world_sizes: distributed tasks only: TP sizes to sweep (default: the task's scope sizes above
            1); one ``<task>_tp<W>.json`` each (see :mod:`workbench.bench_dist`); the last is returned.

    Raises:
        ValueError: device is not cuda, or a world size needs more GPUs than there are.
        RuntimeError: the measuring child failed (its stderr tail in the message).
    """
    from workbench.taskspec import load_task

    if device != "cuda":
        raise ValueError(f"workbench bench: --device {device!r}: the benchmark times CUDA kernels; use --device cuda.")
    task = load_task(root, task_id)
    wt = candidate_worktree(root, task_id, candidate)
    out_dir = Path(out_dir or root / "bench" / "results" / "local")
    out_dir.mkdir(parents=True, exist_ok=True)
    if task.distributed is not None:
        from workbench.bench_dist import run_bench_distributed

        if world_sizes:
            sizes = list(world_sizes)
        else:
            import torch

            sizes = [w for w in task.scope.tp_sizes if 1 < w <= torch.cuda.device_count()]
            if not sizes:
                raise ValueError(f"workbench bench: {task_id} is distributed and this machine has "
                                 f"{torch.cuda.device_count()} GPU(s); no TP size above 1 fits.")
        return run_bench_distributed(root, task, Path(wt), candidate=candidate, world_sizes=sizes, batches=batches,
                                     workload=workload, repetitions=repetitions, out_dir=out_dir,
                                     timeout_s=timeout_s)[-1]
    json_path = out_dir / f"{task_id}.json"
    args = {"worktree": str(wt), "task_root": str(task.root), "task_id": task_id, "batches": list(batches),
            "workload": workload or template_workload(task, batches), "repetitions": repetitions,
            "compile": compile_standard, "out": str(json_path), "candidate": candidate}
    run_measuring_child("workbench.bench", args, Path(wt), timeout_s=timeout_s, what="workbench bench")
    if not json_path.is_file():
        raise RuntimeError(f"workbench bench: the measuring child exited 0 but wrote no {json_path}.")
    plot(json_path, json_path.with_suffix(".png"))
    return json_path


def candidate_worktree(root: Path, task_id: str, candidate: str | None) -> Path:
    """The folder a measuring child runs in: the candidate committed into its own worktree under
    ``.workbench/worktrees/`` exactly as ``workbench run`` does (a ``.patch`` file, an overlay folder or
    a branch), or the checkout itself when there is no candidate.

    Raises:
        CandidateError: the candidate is missing, does not apply, or changes nothing.
        RepoError: git fails.
    """
    from workbench.worktree import create_candidate

    return Path(create_candidate(root, task_id, candidate).worktree) if candidate else Path(root)


TAIL_LINES = 400
"""Lines of a measuring child's output kept for the error message of a failure."""


def run_measuring_child(module: str, args: dict[str, Any], worktree: Path, *, timeout_s: float, what: str,
                        on_line: Callable[[str], None] | None = None) -> list[str]:
    """Run ``python -m <module> '<json args>'`` rooted at ``worktree`` and wait for it.

    The child imports the worktree's ``k3_model`` (the candidate's kernels), never this process's:
    ``cwd`` and the first ``PYTHONPATH`` entry are the worktree. Its stdout and stderr are merged and
    read line by line; ``on_line`` gets each line in this thread as it arrives (progress, logs). The
    child runs in its own process group, killed on timeout or when this call is left by an exception
    (Ctrl-C included).

    Args:
        module: the child's module (``workbench.bench``, ``workbench.bench_model``).
        args: JSON-ready arguments, passed as the one command-line argument.
        worktree: the folder the child runs in (:func:`candidate_worktree`).
        timeout_s: wall-clock limit (seconds).
        what: names the command in error messages.
        on_line: called with every output line (without the newline).

    Returns:
        The last :data:`TAIL_LINES` lines of output.

    Raises:
        RuntimeError: the child exited non-zero or ran past ``timeout_s`` (the output's tail in the message).
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(worktree), str(Path(__file__).resolve().parents[1])]))
    proc = subprocess.Popen([sys.executable, "-m", module, json.dumps(args)], cwd=str(worktree), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                            bufsize=1, start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.put(line.rstrip("\n"))
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                line = lines.get(timeout=0.25)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError from None
                continue
            if line is None:
                break
            tail.append(line)
            if on_line is not None:
                on_line(line)
        status = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except (TimeoutError, subprocess.TimeoutExpired):
        _kill_group(proc)
        raise RuntimeError(f"{what}: the measuring child ran past {timeout_s:.0f} s and was stopped; last output: "
                           + "\n".join(tail)[-3000:]) from None
    finally:
        if proc.poll() is None:  # an exception (Ctrl-C) left the loop: the child never outlives the call
            _kill_group(proc)
    if status != 0:
        raise RuntimeError(f"{what}: the measuring child failed (status {status}): " + "\n".join(tail)[-3000:])
    return list(tail)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the child's process group (it was started in a session of its own) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


# --------------------------------------------------------------------------------- child side


def _measure(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    from guards.cases import build_case, load_task_module
    from k3_model.dispatch import forward_context
    from kernels import stats, timing
    from workbench import env as envmod
    from workbench.taskspec import load_task

    task = load_task(Path(args["task_root"]).parents[1], args["task_id"])
    template = task.workload(args["workload"])
    ref = load_task_module(task, "reference")
    mod_name, fn_name = task.target.split(":")
    import importlib

    from workbench.peers import task_peers

    peers = task_peers(task)
    peer_info = [p.describe() for p in peers]
    op = getattr(importlib.import_module(mod_name), fn_name)
    compiled = torch.compile(op, dynamic=True) if args["compile"] else None
    lim = timing.device_limits()
    tiny_buf = torch.zeros(1, device="cuda")

    def tiny_kernel() -> None:  # one one-element fill: a launch with nothing in it (rewrites its output)
        tiny_buf.fill_(1.0)

    rows = []
    skipped = {}
    for T in args["batches"]:
        if not batch_fits(task, template, T):
            skipped[int(T)] = (f"{task.scope.batch_axis} = {T} with {template.name}'s other sizes breaks the task's "
                               f"[domain] constraints ({'; '.join(task.domain.constraints)})")
            print(f"T={T:3d} skipped: {skipped[int(T)]}", flush=True)
            continue
        axes = dict(template.axes)
        axes[task.scope.batch_axis] = int(T)
        w = template.model_copy(update={"axes": axes, "name": f"bench-{T}"})
        case = build_case(task, w, seed=1234 + int(T))
        inputs = {k: v.cuda() for k, v in case.inputs_a.items()}
        new_inputs = {k: v.cuda() for k, v in case.inputs_b.items()}

        # an in-place output (e.g. kda_decode's state pool) is the input tensor of the same name: it is not
        # allocated or passed again, and the kernel's result is read from that input
        inplace = [k for k, s in case.output_specs.items() if s.get("inplace")]

        def outs() -> dict[str, torch.Tensor]:
            return {k: torch.full(s["shape"], s["poison"], dtype=getattr(torch, s["dtype"]), device="cuda")
                    for k, s in case.output_specs.items() if not s.get("inplace")}

        o_std, o_ker, o_cmp = outs(), outs(), outs()

        def call(fn, backend, o):
            def f() -> None:
                with forward_context(decode_backend=backend, phase=case.phase, requests=case.requests,
                                     query_len=case.query_len):
                    fn(**inputs, **case.kwargs, **o)
            return f

        std = call(op, "standard", o_std)
        ker = call(op, "latency_specialized", o_ker)
        reps = int(args["repetitions"])
        eager = timing.time_pair(std, ker, device="cuda", warmup=20, repetitions=reps)
        # freshness of the kernel's graph: replay after new inputs must equal an eager call
        saved = {k: v.clone() for k, v in inputs.items()}

        def refresh() -> None:
            for k in inputs:
                inputs[k].copy_(new_inputs[k])

        def verify() -> list[str]:  # the task's own checker against its reference, on the new inputs
            cpu_in = {k: v.cpu() for k, v in new_inputs.items()}
            got = {k: v.cpu() for k, v in o_ker.items()} | {k: inputs[k].cpu() for k in inplace}
            return ref.check(cpu_in, case.kwargs, got, ref.reference(cpu_in, case.kwargs), task.correctness.tolerance)

        timing.capture_graph(ker, outputs=list(o_ker.values()), refresh_inputs=refresh, verify=verify)
        for k in inputs:
            inputs[k].copy_(saved[k])
        graph = timing.time_pair(std, ker, device="cuda", warmup=20, repetitions=reps, cuda_graph=True,
                                 outputs={"baseline": list(o_std.values()), "candidate": list(o_ker.values())})
        med = stats.median
        row = {"batch": int(T), "axes": axes,
               "standard_eager_us": med(eager.baseline.samples_us), "kernel_eager_us": med(eager.candidate.samples_us),
               "standard_graph_us": med(graph.baseline.samples_us), "kernel_graph_us": med(graph.candidate.samples_us),
               "samples_us": {"standard_eager": eager.baseline.samples_us, "kernel_eager": eager.candidate.samples_us,
                              "standard_graph": graph.baseline.samples_us, "kernel_graph": graph.candidate.samples_us}}
        row["speedup_vs_graph"] = row["standard_graph_us"] / row["kernel_graph_us"]
        row["speedup_vs_graph_ci99"] = stats.bootstrap_ratio_ci(graph.baseline.samples_us, graph.candidate.samples_us,
                                                                confidence=0.99, resamples=1000)
        row["speedup_vs_eager"] = row["standard_eager_us"] / row["kernel_eager_us"]
        if compiled is not None:
            cmp_fn = call(compiled, "standard", o_cmp)
            for _ in range(3):
                cmp_fn()  # compile (and recompile for this shape) outside timing
            comp = timing.time_pair(cmp_fn, ker, device="cuda", warmup=10, repetitions=reps)
            row["standard_compile_us"] = med(comp.baseline.samples_us)
            row["samples_us"]["standard_compile"] = comp.baseline.samples_us
            row["speedup_vs_compile"] = row["standard_compile_us"] / row["kernel_eager_us"]
        row["peers_not_run"] = {}
        for peer, info in zip(peers, peer_info):
            why = info["reason"] or peer.applies(axes, case.kwargs)
            if why is None:
                try:
                    pt = timing.time_pair(peer.build(inputs, case.kwargs), ker, device="cuda", warmup=10,
                                          repetitions=reps, cuda_graph=True,
                                          outputs={"candidate": list(o_ker.values())})
                except Exception as exc:  # a peer that fails here is reported, never the bench's failure
                    why = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
                else:
                    row[f"peer_{peer.name}_graph_us"] = med(pt.baseline.samples_us)
                    row["samples_us"][f"peer_{peer.name}_graph"] = pt.baseline.samples_us
                    row[f"kernel_vs_{peer.name}"] = med(pt.baseline.samples_us) / med(pt.candidate.samples_us)
            if why is not None:
                row["peers_not_run"][peer.name] = why
        # the launch floor of this row: one tiny kernel's graph replayed interleaved with the kernel's graph,
        # so both see the same clocks (a floor measured once at the start, on a cold GPU, read up to 1.5x
        # high on the H200: bench/results/h200/cutedsl/session12)
        fl = timing.time_pair(tiny_kernel, ker, device="cuda", warmup=10, repetitions=reps, cuda_graph=True,
                              outputs={"baseline": [tiny_buf], "candidate": list(o_ker.values())})
        row["launch_graph_us"] = med(fl.baseline.samples_us)
        nbytes = timing.min_bytes([*inputs.values(), *o_ker.values()])
        row["min_bytes"] = nbytes
        row["floor_eager_us"] = timing.floor_us(nbytes, bandwidth_gbps=lim.copy_gbps, launch_us=lim.launch_us)
        row["floor_graph_us"] = timing.floor_us(nbytes, bandwidth_gbps=lim.copy_gbps, launch_us=row["launch_graph_us"])
        row["kernel_graph_pct_of_floor"] = 100.0 * row["floor_graph_us"] / row["kernel_graph_us"]
        row["kernel_eager_pct_of_floor"] = 100.0 * row["floor_eager_us"] / row["kernel_eager_us"]
        rows.append(row)
        print(f"T={T:3d} std eager {row['standard_eager_us']:7.1f} graph {row['standard_graph_us']:6.1f} "
              f"compile {row.get('standard_compile_us', float('nan')):7.1f} | kernel eager {row['kernel_eager_us']:6.1f} "
              f"graph {row['kernel_graph_us']:6.1f} | x{row['speedup_vs_graph']:.2f} vs graph, "
              f"{row['kernel_graph_pct_of_floor']:.0f}% of floor"
              + "".join(f" | {p.name} graph {row[f'peer_{p.name}_graph_us']:6.1f}" for p in peers
                        if f"peer_{p.name}_graph_us" in row), flush=True)
    return {"schema": "workbench-bench/1", "task_id": task.task_id, "workload": template.name,
            "candidate": args.get("candidate"),
            "variants": [*VARIANTS, *(f"peer_{p.name}_graph" for p in peers)], "peers": peer_info,
            "device_limits": lim.to_dict(),
            "timing": {"repetitions": int(args["repetitions"]), "flush_l2": True, "interleaved": True,
                       "timer": "cuda_event", "statistic": "median"},
            "environment": envmod.collect("cuda"), "rows": rows, "batches_skipped": skipped}


def plot(json_path: Path, png_path: Path, *, floor_label: str = "floor (graph launch / bandwidth)",
         xlabel: str = "decode batch (tokens)", ylabel: str = "us per call (median)") -> None:
    """Plot microseconds per call against batch for every variant (log-log) with the graph floor.

    Args:
        json_path: a ``workbench bench`` (or ``bench_dist``) result file: ``rows`` with ``batch``,
            ``<variant>_us`` per variant and ``floor_graph_us`` (microseconds); a variant missing from a
            row is not drawn.
        png_path: where the figure goes.
        floor_label, xlabel, ylabel: the floor's legend and the axis labels.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    rows = data["rows"]
    xs = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in data.get("variants") or VARIANTS:
        key = f"{v}_us"
        if all(key in r for r in rows):
            ax.plot(xs, [r[key] for r in rows], marker="o", label=v.replace("_", " "))
    ax.plot(xs, [r["floor_graph_us"] for r in rows], "k--", label=floor_label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    gpu = data.get("environment", {}).get("gpu_name") or ""
    tp = f" TP{data['world_size']}" if data.get("world_size") else ""
    ax.set_title(f"{data['task_id']}{tp} ({data['workload']} sizes) on {gpu}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """Child entry: ``python -m workbench.bench '<json args>'`` (see :func:`run_bench`)."""
    args = json.loads(argv[0])
    sys.path.insert(0, args["worktree"])
    result = _measure(args)
    Path(args["out"]).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
