"""Correctness guard: the candidate matches the reference on every configuration of the task.

Cases = the task's workloads plus random draws inside the declared scope (seeded at run time, never
shown to the candidate). Each case is called three times in a child process: fresh buffers;
the same buffers refilled with other data (an output cache keyed by pointer returns stale data);
fresh buffers again (a moving result is a race). Outputs are poisoned before the first and third
call; the second call's output buffers are the first call's, their values shuffled (plausible values
where none belongs, as a model's reused buffers hold another step's). Inputs must
be unchanged after each call, and outputs are compared in this process against ``reference.py`` with the
task's ``check`` (or per-output tolerances when the task has none). When the kernel's scope declares
shapes (``OpScope.shapes``), every configuration outside them (run by the standard path), a fixed
workload as much as a random draw, gets a counterpart moved inside them, run in a second child
(:mod:`guards.scope_shapes`): a kernel cannot leave an edge workload behind by declaring shapes that
exclude its size.

Metamorphic pairs (issue 19 item 2): a random draw that a checked ``[domain.invariances]`` entry
applies to gets, as its second call's data, the transformed twin of its first draw (a permutation
of the batch, a bias shift), so the pair costs no extra call; besides the reference on both, the
task's ``relation`` compares the candidate's outputs on the twin with its own outputs on the
original (``_relation_lines``). That catches what a tolerance accepts on each call alone (a choice
among ties, a rounding that depends on the batch position). The twin is the second call's data, so
for an invariance whose outputs equal the original's (the bias shift) that case no longer catches an
output cache keyed by buffer address; the fixed workloads and the other draws (independent data, or
a permutation, whose outputs move) still do, and the audit guard looks for such caches too.

Source: issue 2 guard 2; DESIGN.md "Trust model".
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any

from guards import progress, scope_shapes
from guards.base import GuardContext
from guards.cases import (
    Case,
    ShrinkResult,
    build_case,
    correctness_cases,
    load_task_module,
    rank_inputs,
    shrink,
    untouched,
)
from guards.sandbox import run_child, run_ranks, tail_lines
from guards.verdict import Evidence, Status, Verdict

SHRINK_CHILD_RUNS = 8
"""Child runs spent shrinking a failing random draw to a smaller failing configuration (count)."""
SHRINK_BUDGET_S = 90.0
"""Wall-clock budget of the shrinking (seconds): past it, the smallest failure found so far is reported."""
MAX_MISMATCH_LINES = 8


def response_bytes(cases, calls: int) -> int:
    """What a correctness child's response may hold (bytes): every output of ``calls`` calls of every case
    (three eager calls, and a CUDA-graph replay where one is wanted), twice over for its framing, plus 64 MiB.
    The child is held to it or to ``guards.sandbox.MAX_RESPONSE_BYTES``, whichever is larger: KDA's state
    pools (up to 65 slots of 12 x 128 x 128 fp32 a case) took the H100 run of session 24 past a fixed 1 GiB
    with the replay's outputs (``bench/results/h100/session24/``)."""
    import torch

    per_call = sum(math.prod(s["shape"]) * torch.empty((), dtype=getattr(torch, s["dtype"])).element_size()
                   for c in cases for s in c.output_specs.values())
    return 2 * calls * per_call + 64 * 2**20


def generic_check(task, got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Per-output comparison from the task's tolerances (exact or allclose)."""
    import torch

    out = []
    for name, tol in task.correctness.tolerance.items():
        g, w = got.get(name), want[name]
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            out.append(f"{name}: expected {tuple(w.shape)} {w.dtype}, got {getattr(g, 'shape', None)} {getattr(g, 'dtype', None)}")
            continue
        ok = torch.equal(g, w) if tol.exact else torch.allclose(g.float(), w.float(), rtol=tol.rtol, atol=tol.atol)
        if not ok:
            out.append(f"{name}: differs from the reference (tolerance: {tol.source})")
    return out


GRAPH_HINT = ("the launch escaped graph capture (it ran on a stream other than torch's current one, e.g. the "
              "default stream) or the code is capture-unsafe; vLLM serves decode steps as CUDA-graph replays")
"""Why a CUDA-graph replay can differ from eager calls that match (the wording of every graph mismatch).

Source: shared/reference/h200_peers.md "CuTe DSL on this H200" (a launch on the default stream inside
``torch.cuda.graph`` is left out of the graph; the replay leaves the output stale)."""


def graph_check_wanted(task, device: str) -> bool:
    """Whether the correctness child captures and replays each case in a CUDA graph: on CUDA, for a
    single-process task (a distributed task's collectives are not captured here)."""
    return device == "cuda" and task.distributed is None


def _compare(task, ref, inputs: dict[str, Any], kwargs: dict[str, Any], got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Mismatch lines of one call's outputs: the task's ``check`` when it has one, else :func:`generic_check`."""
    if hasattr(ref, "check"):
        return untouched(task, "reference.check", (inputs,), ref.check, dict(inputs), dict(kwargs), got, want,
                         task.correctness.tolerance)
    return generic_check(task, got, want)


def graph_mismatches(task, ref, case, result: dict[str, Any], want_b: dict[str, Any], device: str,
                     digests: dict | None = None) -> list[str]:
    """Mismatch lines of a case's CUDA-graph replay (empty when it matches or is not wanted).

    The child (``guards/_child_main.py`` ``_graph_case``) captured the call on ``inputs_a``, copied
    ``inputs_b`` into the static inputs, poisoned the outputs and replayed once; the replay's outputs must
    match the reference on ``inputs_b`` and the static inputs must be ``inputs_b`` still. A case whose eager
    calls ran the candidate's kernel must come with a replay result.

    Args:
        result: the child's result of the case (``calls``, and ``graph`` when it replayed).
        want_b: the reference outputs on ``case.inputs_b``.
        device: the run's device (nothing is wanted off CUDA).
        digests: the case's input digests memo (:func:`input_digest`; its eager calls computed ``inputs_b``'s).

    Returns:
        Lines that start with ``[graph_replay]`` and name :data:`GRAPH_HINT`.
    """
    if not graph_check_wanted(task, device):
        return []
    calls = result.get("calls") or [{}]
    ran = any(d.get("op") == task.op and d.get("implementation") == "latency_specialized"
              for d in calls[0].get("trace", []) if isinstance(d, dict))
    g = result.get("graph")
    if not isinstance(g, dict):
        return (["[graph_replay] the child returned no CUDA-graph replay result, though the eager calls ran the "
                 "candidate's kernel"] if ran else [])
    if g.get("error"):
        return [f"[graph_replay] the CUDA graph's {g.get('stage') or 'run'} raised "
                f"{str(g['error']).splitlines()[0]} (capture-unsafe code; {GRAPH_HINT})"]
    inplace = {k for k, o in task.outputs.items() if o.inplace}
    out = []
    seen = {k: v for k, v in case.inputs_b.items() if k not in inplace}
    changed = _inputs_changed(seen, g.get("inputs_after", {}), digests)
    if changed:
        out.append(f"[graph_replay] the CUDA-graph replay mutated input(s) {', '.join(changed)}")
    lines = _compare(task, ref, case.inputs_b, case.kwargs, g.get("outputs", {}), want_b)
    if lines:
        out.append(f"[graph_replay] the CUDA-graph replay differs from the reference on fresh inputs (the eager "
                   f"calls are judged separately): {lines[0]}; {GRAPH_HINT}")
        out += [f"[graph_replay] {m}" for m in lines[1:]]
    return out


def _clip(text: str, n: int) -> str:
    """One sentence: at most ``n`` characters, exactly one final period."""
    text = " ".join(text.split()).rstrip(".")
    return (text[: n - 3] + "..." if len(text) > n else text) + "."


def _inputs_changed(before: dict[str, Any], after: dict[str, Any], digests: dict | None = None) -> list[str]:
    """Names of the inputs whose bits the call changed (or whose tensor it replaced by another shape or dtype).

    Bitwise: ``after`` holds the child's :func:`guards._protocol.tensor_digest` of each input, compared
    with the digest of the copy taken before the call, so NaN written over a zero, a flipped sign of
    zero or a changed NaN payload all count, as any value comparison (``torch.equal``, ``nan_to_num``)
    would miss them.

    Args:
        before: input name -> tensor as handed to the candidate (a copy taken before the call).
        after: input name -> the digest of the same tensor after the call (a dict; anything else,
            or a missing name, counts as changed).
        digests: a memo of the ``before`` digests (:func:`input_digest`), shared by the calls of one case
            (``inputs_a`` is checked after its first and third call); ``None``: none kept.

    Returns:
        The changed names, in ``before``'s order; empty when every input is bit-for-bit unchanged.

    Source: issue 12 ("inputs-unchanged compared through nan_to_num, so NaN written over zeros
    passes"; "comparisons are bitwise where they must be").
    """
    memo = {} if digests is None else digests
    return [k for k, v in before.items() if after.get(k) != input_digest(v, memo)]


def input_digest(t, memo: dict) -> dict:
    """:func:`guards._protocol.tensor_digest` of an input as handed to the child, once per tensor and ``memo``.

    ``memo`` (``id(tensor) -> (tensor, version, digest)``) belongs to one case of one judgment: it holds
    its tensors (no address is reused while it lives) and is dropped with the case's check. The digest is
    computed again when the tensor's in-place version counter moved; writes that leave it unchanged
    (``.data``, a numpy view) are not seen, and need not be: these tensors are the judge's own, handed
    to the child as a serialized copy and to the task's reference and relations as clones.
    """
    from guards._protocol import tensor_digest

    hit = memo.get(id(t))
    if hit is not None and hit[0] is t and hit[1] == t._version:
        return hit[2]
    digest = tensor_digest(t)
    memo[id(t)] = (t, t._version, digest)
    return digest


def _same_outputs(a: dict, b: dict) -> bool:
    """Whether two calls' outputs are the same tensors bit for bit (any other value: never the same)."""
    return set(a) == set(b) and all(same_bits(v, b[k]) for k, v in a.items())


def same_bits(a: Any, b: Any) -> bool:
    """Whether two tensors hold the same bits (NaN payloads and the sign of zero included)."""
    import torch

    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))
    return torch.equal(a, b)


def _problem_verdict(name: str, outcome, rank: int | None = None, begun: str | None = None) -> Verdict:
    """A FAIL for a child that did not complete; ``begun``: the configuration it had begun when it was killed
    past its time limit (from the judge's own list, by the child's progress page)."""
    why = outcome.problem or str(outcome.response.get("error", "")).strip().splitlines()[0]
    where = "" if rank is None else f" (TP rank {rank})"
    if begun and outcome.timed_out:
        why = f"{why}; it had begun configuration {begun}"
    return Verdict(
        guard=name, status=Status.FAIL,
        summary=f"The candidate's code did not complete{where}: {_clip(why, 400)}",
        evidence=(
            Evidence(name="child_problem", value=why),
            Evidence(name="child_duration", value=round(outcome.duration_s, 2), unit="s"),
            Evidence(name="stderr_tail", value=tail_lines(outcome.stderr_tail, 1500)),
            *([Evidence(name="child_error", value=str(outcome.response.get("error"))[-2000:])] if outcome.response else []),
        ),
    )


@contextlib.contextmanager
def progress_page():
    """A one-value shared page for the correctness child's progress (``guards._protocol.PROGRESS``): yields the
    fd to pass to the child (closed here once the child has it) and a function reading the 1-based index of the
    configuration the child has begun (0: none). The fd's name is neutral: the mapping shows in the child's
    /proc/self/maps, which candidate code may not read."""
    import mmap

    from guards._protocol import PROGRESS

    fd = os.memfd_create("shm", 0)
    try:
        os.ftruncate(fd, PROGRESS.size)
        page = mmap.mmap(fd, PROGRESS.size)
        try:
            yield fd, lambda: PROGRESS.unpack_from(page, 0)[0]
        finally:
            page.close()
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _failed(outcome) -> bool:
    return outcome.response is None or not outcome.response.get("ok")


def scope_limits(task, device: str, tp_sizes: list[int]) -> dict:
    """What a run on ``device`` judges, for the child's early scope check: a declared scope beyond it is
    rejected before any configuration runs (``_child_main._beyond``; the judge decides with
    :func:`guards.activation.scope_verdict`).

    Args:
        tp_sizes: the world sizes this run's configurations use.
    """
    return {**task.scope.claim_dict(), "devices": [device], "tp_sizes": list(tp_sizes)}


def available_world_sizes(device: str) -> int | None:
    """Most ranks a run on ``device`` can host: GPUs on CUDA (one per rank); ``None`` (no limit) on CPU."""
    if device != "cuda":
        return None
    import torch

    return torch.cuda.device_count()


class CorrectnessGuard:
    """Runs the candidate's op through the dispatcher in a child (one per TP rank) and checks every output."""

    name = "correctness"
    reads: tuple[str, ...] = ()
    writes = ("scope", "scope_verdict", "imported_files", "tested_tp_sizes", "cases", "traces", "case_objects")

    def _run(self, ctx: GuardContext, cases: list[Case], ref=None, tp_sizes: list[int] | None = None):
        """Run every case; returns (per-case list of per-rank results, failure verdict or None, duration, outcome).

        ``tp_sizes``: the world sizes the whole judgment tests, added to those of ``cases`` (the child's
        early scope check compares the declared scope with them). A later run of a few cases (shrinking, the
        draws moved into declared shapes) passes the first run's, or a scope claiming TP sizes those few
        cases lack would be refused there and return no result.

        A distributed task runs one world size after the other, smallest first; with ``ref`` (the task's
        reference module) a world size with a wrong case ends the run there, and the larger world sizes
        are not run (their cases are absent from the results): the first failure decides, as the first
        FAIL stops the pipeline, and the children of the larger groups cost the most.
        """
        task = ctx.task
        base = {"mode": "correctness", "target": task.target, "op": task.op, "device": ctx.device,
                "decode_backend": "latency_specialized",
                "scope_limits": scope_limits(task, ctx.device, sorted(set(tp_sizes or ()) | {c.world_size for c in cases}))}
        results: dict[str, list[dict]] = {}
        duration = 0.0
        if task.distributed is None:
            progress.phase(f"{len(cases)} configurations in one child (import, run, check)")
            graph = graph_check_wanted(task, ctx.device)
            with progress_page() as (fd, read_begun):
                outcome = run_child(ctx.child_root, {**base, "progress_fd": fd,
                                                     "cases": [{**c.request_entry(), "graph": graph} for c in cases]},
                                    timeout_s=task.timeouts.correctness_s, memory_bytes=task.timeouts.memory_bytes,
                                    device=ctx.device, max_response_bytes=response_bytes(cases, 3 + int(graph)),
                                    pass_fds=(fd,))
                i = read_begun()
            if _failed(outcome):
                begun = f"{i} of {len(cases)} ({cases[i - 1].name})" if 1 <= i <= len(cases) else None
                return None, _problem_verdict(self.name, outcome, begun=begun), outcome.duration_s, outcome
            for c in outcome.response.get("cases", []):
                if isinstance(c, dict):
                    results[c.get("name")] = [c]
            return results, None, outcome.duration_s, outcome
        d = task.distributed
        backend = d.backend_cuda if ctx.device == "cuda" else d.backend_cpu
        last = None
        worlds = sorted({c.world_size for c in cases})
        for k, world in enumerate(worlds):
            group = [c for c in cases if c.world_size == world]
            progress.phase(f"TP {world}: {len(group)} configurations, one child per rank; TP sizes done", done=k,
                           total=len(worlds))
            reqs = [{**base, "cases": [c.request_entry(r) for c in group]} for r in range(world)]
            outcomes = run_ranks(ctx.child_root, reqs, backend=backend, collective_timeout_s=d.collective_timeout_s,
                                 timeout_s=task.timeouts.correctness_s, memory_bytes=task.timeouts.memory_bytes,
                                 device=ctx.device)
            duration += max(o.duration_s for o in outcomes)
            bad = [r for r, o in enumerate(outcomes) if _failed(o)]
            if bad:
                # the rank that raised is the news; its peers then time out waiting for it
                first = next((r for r in bad if outcomes[r].response is not None), bad[0])
                return None, _problem_verdict(self.name, outcomes[first], first), duration, outcomes[first]
            for c in group:
                results[c.name] = []
            for o in outcomes:
                for c in o.response.get("cases", []):
                    if isinstance(c, dict) and c.get("name") in results:
                        results[c["name"]].append(c)
            last = outcomes[0]
            if (last.response or {}).get("scope_beyond_limits"):
                break  # the declared scope is rejected before any configuration ran (check())
            if ref is not None and any(self._judge_case(task, ref, c, results[c.name], ctx.device)[0] for c in group):
                break
        return results, None, duration, last

    def _judge_case(self, task, ref, case: Case, ranks: list[dict],
                    device: str = "cpu") -> tuple[list[str], list[str], list]:
        """Check one case's per-rank results: (mismatch lines, implementations seen, per-call traces).

        On CUDA a single-process case's CUDA-graph replay is checked too (:func:`graph_mismatches`)."""
        inplace = {k for k, o in task.outputs.items() if o.inplace}
        identical = task.distributed.identical_across_ranks if task.distributed else ()
        mism: list[str] = []
        impls: list[str] = []
        call_traces = []
        digests: dict = {}  # the inputs' digests, shared by the case's calls (inputs_a: the first and third)
        checked: list = []  # (inputs, outputs, check lines) of the calls checked so far (any rank)
        if len(ranks) != case.world_size or any(len(rc.get("calls", [])) != 3 for rc in ranks):
            mism.append(f"the child returned no result for this case ({len(ranks)} of {case.world_size} rank(s))")
        else:
            want_a = untouched(task, "reference.reference", (case.inputs_a,), ref.reference, dict(case.inputs_a),
                               dict(case.kwargs))
            want_b = untouched(task, "reference.reference", (case.inputs_b,), ref.reference, dict(case.inputs_b),
                               dict(case.kwargs))
            for rank, rc in enumerate(ranks):
                tag = f"[rank {rank}]" if case.world_size > 1 else ""
                for call, inputs, want in zip(rc["calls"], (case.inputs_a, case.inputs_b, case.inputs_a),
                                              (want_a, want_b, want_a)):
                    label = f"{tag}[{call.get('label', '?')}]"
                    call_traces.append(call.get("trace", []))
                    impls += [d.get("implementation", "?") for d in call.get("trace", []) if d.get("op") == task.op]
                    if call.get("error"):
                        mism.append(f"{label} raised {call['error'].splitlines()[0]}")
                        continue
                    seen = {k: v for k, v in rank_inputs(inputs, case.per_rank, rank).items() if k not in inplace}
                    changed = _inputs_changed(seen, call.get("inputs_after", {}), digests)
                    if changed:
                        mism.append(f"{label} mutated input(s) {', '.join(changed)}")
                    outputs = call.get("outputs", {})
                    lines = next((seen_lines for seen_inputs, seen_outputs, seen_lines in checked
                                  if seen_inputs is inputs and _same_outputs(outputs, seen_outputs)), None)
                    if lines is None:  # the task's check is a function of (inputs, outputs): run once per pair
                        lines = _compare(task, ref, inputs, case.kwargs, outputs, want)
                        checked.append((inputs, outputs, lines))
                    mism += [f"{label} {m}" for m in lines]
            if case.world_size == 1:
                mism += graph_mismatches(task, ref, case, ranks[0], want_b, device, digests)
            if case.twin is not None:
                mism += self._relation_lines(task, ref, case, ranks)
            for i in range(3):
                for out in identical:
                    ref_bits = ranks[0]["calls"][i].get("outputs", {}).get(out)
                    for rank in range(1, case.world_size):
                        if not same_bits(ranks[rank]["calls"][i].get("outputs", {}).get(out), ref_bits):
                            mism.append(f"[call {i}] output {out} on rank {rank} differs bitwise from rank 0 "
                                        "(every rank must hold identical bits)")
                            break
        return mism, impls, call_traces

    @staticmethod
    def _relation_lines(task, ref, case: Case, ranks: list[dict]) -> list[str]:
        """The metamorphic pair of one case: the candidate's outputs on the twin (second call) against its
        own outputs on the original (first call), through the task's relation, per rank.

        Each line reads ``[rank r][metamorphic <invariance>] <what the relation says>``; nothing when a
        call of the pair raised (that is a mismatch already) or when neither call ran the candidate's
        kernel (both took the standard path: outside its declared scope). A relation that raises is a broken task,
        not a candidate's fault: the exception propagates (the guard ERRORs).

        Source: issue 19 item 2 ("metamorphic pairs: input and its transformed twin, compared by the
        invariance"); ``guards.cases.Twin``; the task's ``[domain.invariances]``.
        """
        twin = case.twin
        relation = getattr(ref, twin.relation)
        out = []

        def ran_kernel(call: dict) -> bool:
            return any(d.get("op") == task.op and d.get("implementation") == "latency_specialized"
                       for d in call.get("trace") or ())

        for rank, rc in enumerate(ranks):
            first, second = rc["calls"][0], rc["calls"][1]
            if first.get("error") or second.get("error"):
                continue
            # a pair the dispatcher sent to the standard path on both calls (outside the kernel's declared
            # scope) says nothing about the candidate: the relation holds the candidate's kernel to the
            # contract, and the standard path's own collectives need not meet a bitwise one (session 23: gloo's
            # fp32 ring all-reduce sums a token's partials in an order that follows its position, which broke
            # the allreduce pair on a verification step an honest decode-only kernel does not claim)
            if not (ran_kernel(first) or ran_kernel(second)):
                continue
            tag = f"[rank {rank}]" if case.world_size > 1 else ""
            lines = untouched(task, f"reference.{twin.relation}", (case.inputs_a, case.inputs_b), relation,
                              dict(case.inputs_a), first.get("outputs", {}), dict(case.inputs_b),
                              second.get("outputs", {}), dict(twin.info), dict(case.kwargs), task.correctness.tolerance)
            out += [f"{tag}[metamorphic {twin.invariance}] {m}" for m in lines]
        return out

    def _shrink(self, ctx: GuardContext, ref, case: Case, tp_sizes: list[int]) -> ShrinkResult:
        """The smallest configuration near a failing random draw that still fails (issue 19: a minimal
        failing case in the report). Each try is one child run of one configuration; a child that
        crashes or times out on it counts as failing there too. ``tp_sizes``: the world sizes of the whole
        run (the child's early scope check of a one-configuration try compares with those: a kernel
        declaring TP 1-8 is not refused on a TP 1 try, which would read as "still fails").

        Source: ``guards.cases.shrink`` (the search), :data:`SHRINK_CHILD_RUNS`, :data:`SHRINK_BUDGET_S`.
        """
        end = time.monotonic() + SHRINK_BUDGET_S
        tried = 0

        def still_fails(w) -> bool:
            nonlocal tried
            if time.monotonic() > end:
                return False
            tried += 1
            progress.phase(f"shrinking {case.name}: try {tried} of at most {SHRINK_CHILD_RUNS}")
            c = build_case(ctx.task, w, ctx.seed)
            by_name, failed, _, _ = self._run(ctx, [c], tp_sizes=tp_sizes)
            if failed is not None:
                return True
            return bool(self._judge_case(ctx.task, ref, c, by_name.get(c.name) or [], ctx.device)[0])

        return shrink(ctx.task, case.workload, still_fails, max_calls=SHRINK_CHILD_RUNS)

    def check(self, ctx: GuardContext) -> Verdict:
        task = ctx.task
        ref = load_task_module(task, "reference")
        cases: list[Case] = correctness_cases(task, ctx.seed)
        limit = available_world_sizes(ctx.device) if task.distributed is not None else None
        not_run = [c for c in cases if limit is not None and c.world_size > limit]
        cases = [c for c in cases if c not in not_run]
        if not cases:
            return Verdict(guard=self.name, status=Status.FAIL,
                           summary=f"No configuration fits this machine ({limit} GPU(s) for "
                                   f"{sorted({c.world_size for c in not_run})} ranks): nothing was tested.",
                           evidence=(Evidence(name="gpus", value=limit or 0, unit="count"),))
        planned_tp = sorted({c.world_size for c in cases})
        by_name, failed, duration, outcome = self._run(ctx, cases, ref)
        if failed is not None:
            return failed
        if not outcome.response.get("scope_beyond_limits"):  # configurations moved into the declared shapes
            extra = [build_case(task, w, ctx.seed) for w in scope_shapes.followups(
                task, outcome.response.get("scope"), [c.workload for c in cases])]
            if extra:
                more, failed, more_s, _ = self._run(ctx, extra, ref, tp_sizes=planned_tp)
                if failed is not None:
                    return failed
                by_name.update(more)
                cases += extra
                duration += more_s
        # distributed: every case of a world size that ran has an entry (maybe empty: "no result"), so an
        # absent one belongs to a larger world size not run after a failing one; one process: none is absent
        stopped = [c for c in cases if c.name not in by_name] if task.distributed is not None else []
        cases = [c for c in cases if c not in stopped]
        resp = outcome.response
        ctx.artifacts.scope = resp.get("scope")
        if resp.get("scope_beyond_limits"):
            from guards.activation import scope_verdict

            early = scope_verdict(resp.get("scope"), task, ctx.device, planned_tp)
            if early is not None:  # the activation guard reports it; no configuration ran
                ctx.artifacts.scope_verdict = early
                return Verdict(guard=self.name, status=Status.SKIP,
                               summary="Not run: the kernel's declared scope claims what this run does not test, "
                                       f"so no configuration ran (the activation guard rejects it): {early.summary}",
                               evidence=early.evidence)
            # the child's shortcut disagrees with the judge's rule: judge what ran (nothing), fail below
        ctx.artifacts.imported_files = [f for f in resp.get("imported_files", []) if isinstance(f, str)]
        ctx.artifacts.tested_tp_sizes = sorted({c.world_size for c in cases})
        case_results, failures, traces = [], [], {}
        for case in cases:
            ranks = by_name.get(case.name) or []
            mism, impls, call_traces = self._judge_case(task, ref, case, ranks, ctx.device)
            traces[case.name] = call_traces
            g = ranks[0].get("graph") if len(ranks) == 1 and isinstance(ranks[0].get("graph"), dict) else None
            impl = ",".join(sorted(set(impls))) or "none"
            passed = not mism
            case_results.append({
                "name": case.name, "axes": dict(case.workload.axes), "params": dict(case.kwargs),
                "case": case.workload.case, "implementation": impl, "passed": passed,
                "mismatches": tuple(mism[:20]), "calls": 3, "world_size": case.world_size,
                **({"graph_replay": {k: g.get(k) for k in ("capture_ms", "replay_ms")}} if g else {}),
            })
            if not passed:
                failures.append((case, mism))
        ctx.artifacts.cases = case_results
        ctx.artifacts.traces = traces
        ctx.artifacts.case_objects = cases
        n = len(cases)
        pairs: dict[str, int] = {}
        for c in cases:
            if c.twin is not None:
                pairs[c.twin.invariance] = pairs.get(c.twin.invariance, 0) + 1
        pairs_ev = (Evidence(name="metamorphic_pairs", value=sum(pairs.values()), unit="count",
                             path=", ".join(f"{k}: {v}" for k, v in pairs.items()) or "none declared"),)
        skipped_ev = tuple(Evidence(name="not_run", value=c.name, path=f"{c.world_size} ranks > {limit} GPU(s)")
                           for c in not_run)
        if failures:
            case, mism = failures[0]
            ev = [Evidence(name="failed_cases", value=len(failures), unit="count"),
                  Evidence(name="cases", value=n, unit="count")]
            for c, m in failures[:MAX_MISMATCH_LINES]:
                ev.append(Evidence(name="mismatch", value=m[0][:300], path=f"{c.name} {dict(c.workload.axes)}"))
            if stopped:
                ev.append(Evidence(name="not_run", value=len(stopped), unit="count",
                                   path=f"world sizes {sorted({c.world_size for c in stopped})}: a smaller one failed"))
            shrunk = ""
            if task.domain is not None and all(c.name.startswith("random-") for c, _ in failures):
                # only random draws fail: their configuration is arbitrary, so find a smaller one
                sr = self._shrink(ctx, ref, case, planned_tp)
                w = sr.workload
                where = f"{dict(w.axes)} {dict(w.params)} case {w.case}"
                ev.append(Evidence(name="shrunk", value=where, path="; ".join(sr.steps) or "no smaller failing "
                                   f"configuration found in {sr.calls} tries"))
                if sr.steps:
                    shrunk = f"; shrunk to {where}"
            ev += pairs_ev
            return Verdict(
                guard=self.name, status=Status.FAIL,
                summary=f"{len(failures)} of {n} configurations wrong; first: {case.name} "
                        f"({task.scope.batch_axis}={case.workload.axes[task.scope.batch_axis]}"
                        f"{f', {case.world_size} ranks' if task.distributed else ''}): {_clip(mism[0], 400)}{shrunk}",
                evidence=tuple(ev) + skipped_ev,
            )
        sizes = sorted({c.world_size for c in cases})
        return Verdict(
            guard=self.name, status=Status.PASS,
            summary=f"All {n} configurations ({len([c for c in cases if not c.name.startswith('random-')])} fixed, "
                    f"{len([c for c in cases if c.name.startswith('random-')])} random"
                    f"{f'; world sizes {sizes}' if task.distributed else ''}) match the reference on 3 calls each"
                    f"{f'; {sum(pairs.values())} metamorphic pairs consistent ({pairs_ev[0].path})' if pairs else ''}"
                    f"{f'; {len(not_run)} not run on this machine (more ranks than GPUs)' if not_run else ''}.",
            evidence=(Evidence(name="cases", value=n, unit="count"),
                      Evidence(name="calls_per_case", value=3, unit="count"),
                      Evidence(name="child_duration", value=round(duration, 2), unit="s")) + pairs_ev + skipped_ev,
        )
