"""``workbench bench-model``: K3-mini end to end, ``decode_backend=standard`` against ``latency_specialized``.

For each context length L and decode batch B (every pair of ``--contexts`` and ``--batches``), two step
kinds, both sides timed interleaved (A B / B A) with the one harness in :mod:`kernels.timing`:

- **decode**: every sequence decodes one token (the dispatcher's phase ``decode``). Each side's step is a
  :class:`k3_model.decode.StaticDecodeStep` (static cache sized for the configuration, fixed input and
  output buffers, no host synchronisation). On CUDA it is captured once into a CUDA graph and replayed
  (both sides alike: comparing a graph with an eager step would compare launch overhead); the capture
  is checked first (the replay's tokens must equal an eager step's from the same state, the logits must
  all be rewritten, the dispatcher's decisions must be the eager step's). On the CPU the same step runs
  eagerly.
- **speculative** (``--draft-tokens`` D > 0): a verification step of every request's last token and its D
  drafts, with a synthetic acceptance length (:func:`_speculative`). On CUDA the model forward is
  captured once per side into a CUDA graph and replayed, and the verification (``dspark_verify``) and
  each request's cache rollback run eagerly after it, as a serving engine runs its rejection sampler
  after the model's graph; a side that does not capture runs both sides eagerly, and the result says
  why (``eager_reason``). On the CPU every step is eager.
- **mixed**: one sequence prefills the last chunk of ``--chunk`` tokens of its L-token prompt while the
  other B - 1 decode at context L, in one forward (:meth:`k3_model.model.K3Model.forward_groups`: the
  MoE routing op sees all chunk + B - 1 tokens in one call). The phase is what the vLLM plugin's
  classifier says (``mixed``; ``prefill`` at B = 1). Mixed steps run eager on every device.

Contexts are built once: a standard-path chunked prefill of B_max sequences of real text
(``bench/prompts/k3_mini_prose.txt``, K3-mini's tokenizer, each sequence from its own offset) up to the
longest context, with the recurrent state kept at every length a configuration starts from; both sides
start from copies of the same state. Per configuration and side the result has every step's time,
the median with a 99% bootstrap interval, tokens/s, the dispatcher's decisions per step (the fraction
of steps where the latency-specialized kernel ran, and why not where it did not), and a
``torch.profiler`` breakdown of a few eager decode steps (top ops by self time); per step kind the
speedup (ratio of medians) with a 99% interval. The parent writes ``k3_mini_bench_model.json`` (with
the environment and the command), ``.png`` (tokens/s against batch per context) and ``.log`` (the
child's output) and prints a table.

The measurement runs in a child process rooted at the candidate's worktree (created exactly as
``workbench bench`` creates it: :func:`workbench.bench.candidate_worktree`), so the candidate's
``k3_model`` is imported there and never into the workbench process.

Source: issue 15 item 2 (batch 1-64, context 128 to 32k, pure decode vs mixed, both sides as CUDA
graphs, real text, intervals, profile, plot, result file); issue 3 (benchmark conventions).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from workbench.errors import WorkbenchError

RESULT_NAME = "k3_mini_bench_model"
"""Stem of the result files in ``--out-dir`` (``.json``, ``.png``, ``.log``)."""
FORMAT = "workbench-bench-model/1"
BACKENDS = ("standard", "latency_specialized")
"""The values of ``decode_backend`` (k3_model.config.DECODE_BACKENDS), in the order they are timed."""
DEVICES = ("cuda", "cpu")
DTYPES = ("float32", "bfloat16")
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
"""Decode batches (requests): the declared scope of the tasks (issue 15)."""
DEFAULT_CONTEXTS = {"cuda": (128, 1024, 8192, 32768), "cpu": (32, 128)}
"""Context lengths (tokens): 128 to 32k on CUDA (issue 15); small on the CPU, where a step of K3-mini
at 32k and batch 64 takes seconds."""
DEFAULT_CHUNK = {"cuda": 128, "cpu": 32}
"""Prompt chunk (tokens): one prefill forward while the contexts are built, and the chunk the prefilling
sequence of a mixed step runs. At most the shortest default context."""
DEFAULT_STEPS = {"cuda": 50, "cpu": 8}
"""Decode steps timed per side and configuration."""
DEFAULT_MIXED_STEPS = {"cuda": 5, "cpu": 2}
"""Mixed steps timed per side and configuration (eager, each a prefill chunk: ~0.1 s on the H200)."""
DEFAULT_PROFILE_STEPS = 3
"""Eager decode steps profiled per side and configuration (0: no profile)."""
DEFAULT_DTYPE = {"cuda": "bfloat16", "cpu": "float32"}
"""Compute dtype: the serving dtype on CUDA; float32 on the CPU (the CPU kernels declare float32; the
router logits are float32 in either, so the MoE kernel's scope is met in both)."""
DEFAULT_TASK = "k3_moe_dispatch"
DEFAULT_DRAFT_TOKENS = 7
"""Drafts per request of the speculative steps (K3's DSpark: 7; seed)."""
DEFAULT_ACCEPTANCE_LENGTH = 6
"""Tokens each request emits per speculative step (the seed's synthetic AL = 6)."""
SPEC_LOGITS_DTYPE = "bfloat16"
"""Dtype of the logits the verification reads (the serving model's; tasks/k3_dspark_verify declares bf16)."""
PROMPT_FILE = Path("bench/prompts/k3_mini_prose.txt")
"""The prompt text, relative to the workbench checkout (written for the project; nothing is fetched)."""
GRAPH_WARMUP = 3
"""Eager steps on a side stream before a capture (allocator, lazy init, Triton compiles; PyTorch's rule)."""
DECODE_WARMUP = 5
"""Untimed decode steps (replays on CUDA) per side before the timed ones."""
MIXED_WARMUP = 1
"""Untimed mixed steps per side before the timed ones."""
TOP_OPS = 12
"""Ops listed per profile."""
PREFILL_BUDGET_BYTES = {"cuda": 24 * 2**30, "cpu": 2 * 2**30}
"""Memory for the attention scores of one prefill chunk (bytes): sequences are prefilled in groups that
fit (each chunk holds about five fp32 copies of (heads, chunk, context) scores per sequence)."""
PROGRESS_PREFIX = "@@bench-model-progress "
ERROR_PREFIX = "@@bench-model-error "
LOG_PREFIX = "bench-model: "
CHILD_TIMEOUT_S = 1800.0


class BenchModelError(WorkbenchError):
    """Bad ``bench-model`` input, or a measurement that cannot be trusted (a capture that fails its check)."""


# ------------------------------------------------------------------------------------------ settings


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BenchModelSpec(_Model):
    """What one ``bench-model`` run measures; built and checked by :meth:`resolve`."""

    device: Literal["cuda", "cpu"]
    dtype: Literal["float32", "bfloat16"]
    backends: tuple[str, ...] = Field(description="decode backends timed, standard first")
    batches: tuple[int, ...] = Field(description="decode batches (requests), ascending")
    contexts: tuple[int, ...] = Field(description="context lengths (tokens), ascending")
    chunk: int = Field(description="prompt chunk (tokens)")
    steps: int = Field(description="decode steps timed per side and configuration")
    mixed_steps: int = Field(description="mixed steps timed per side and configuration")
    profile_steps: int = Field(description="eager decode steps profiled per side and configuration")
    seed: int = Field(description="K3-mini weight seed")
    draft_tokens: int = Field(default=DEFAULT_DRAFT_TOKENS, description="speculative steps: drafts per request (0: none)")
    acceptance_length: int = Field(default=DEFAULT_ACCEPTANCE_LENGTH,
                                   description="speculative steps: tokens each request emits per step (synthetic)")
    candidate: str | None = None
    task_id: str = DEFAULT_TASK

    @classmethod
    def resolve(cls, *, device: str = "cuda", batches: Sequence[int] | None = None,
                contexts: Sequence[int] | None = None, chunk: int | None = None, steps: int | None = None,
                mixed_steps: int | None = None, profile_steps: int | None = None,
                backends: Sequence[str] | None = None, dtype: str | None = None, seed: int = 0,
                candidate: str | None = None, task_id: str = DEFAULT_TASK, draft_tokens: int = DEFAULT_DRAFT_TOKENS,
                acceptance_length: int = DEFAULT_ACCEPTANCE_LENGTH) -> BenchModelSpec:
        """Fill the per-device defaults and check every value (no torch needed).

        Raises:
            BenchModelError: an unknown device, backend or dtype; a batch below 1; a context below the
                prompt chunk; a count below its minimum; draft tokens outside 0-8 or an acceptance length
                outside 1..draft tokens + 1.
        """
        where = "workbench bench-model"
        if device not in DEVICES:
            raise BenchModelError(f"{where}: --device {device!r} is not one of {', '.join(DEVICES)}.")
        names = tuple(dict.fromkeys(BACKENDS if backends is None else backends))
        unknown = [b for b in names if b not in BACKENDS]
        if unknown or not names:
            what = f"unknown decode backend {unknown[0]!r}" if unknown else "no decode backend given"
            raise BenchModelError(f"{where}: --backends: {what}; expected {' and/or '.join(BACKENDS)} "
                                  "(k3_model.config.DECODE_BACKENDS).")
        dtype = dtype or DEFAULT_DTYPE[device]
        if dtype not in DTYPES:
            raise BenchModelError(f"{where}: --dtype {dtype!r} is not one of {', '.join(DTYPES)}.")
        bs = tuple(sorted(set(batches or DEFAULT_BATCHES)))
        if bs[0] < 1:
            raise BenchModelError(f"{where}: --batches: batch {bs[0]} is below 1; give decode batch sizes >= 1 "
                                  "(requests), e.g. --batches 1,2,4.")
        ch = DEFAULT_CHUNK[device] if chunk is None else chunk
        if ch < 1:
            raise BenchModelError(f"{where}: --chunk {ch} is below 1 token.")
        cs = tuple(sorted(set(contexts or DEFAULT_CONTEXTS[device])))
        if cs[0] < ch:
            raise BenchModelError(f"{where}: --contexts: context {cs[0]} tokens is below the prompt chunk of {ch} "
                                  "tokens (--chunk); each context must hold a whole chunk (a mixed step prefills "
                                  "the last chunk of its prompt). Raise the context or lower --chunk.")
        counts = {"--steps": (DEFAULT_STEPS[device] if steps is None else steps, 1),
                  "--mixed-steps": (DEFAULT_MIXED_STEPS[device] if mixed_steps is None else mixed_steps, 1),
                  "--profile-steps": (DEFAULT_PROFILE_STEPS if profile_steps is None else profile_steps, 0)}
        for opt, (v, lo) in counts.items():
            if v < lo:
                raise BenchModelError(f"{where}: {opt} {v} is below {lo}.")
        if not 0 <= draft_tokens <= 8:
            raise BenchModelError(f"{where}: --draft-tokens {draft_tokens} is outside 0-8 (0: no speculative steps; "
                                  "K3's DSpark drafts 7).")
        if draft_tokens and not 1 <= acceptance_length <= draft_tokens + 1:
            raise BenchModelError(f"{where}: --acceptance-length {acceptance_length} is outside 1-{draft_tokens + 1} "
                                  f"(accepted drafts + 1, with --draft-tokens {draft_tokens}).")
        return cls(device=device, dtype=dtype, backends=tuple(b for b in BACKENDS if b in names), batches=bs,
                   contexts=cs, chunk=ch, steps=counts["--steps"][0], mixed_steps=counts["--mixed-steps"][0],
                   profile_steps=counts["--profile-steps"][0], seed=seed, candidate=candidate, task_id=task_id,
                   draft_tokens=draft_tokens, acceptance_length=acceptance_length)

    def command(self) -> str:
        """The command line that repeats this run (every default spelled out)."""
        import shlex

        parts = ["workbench", "bench-model"]
        if self.candidate:
            parts += ["--candidate", self.candidate, "--task", self.task_id]
        parts += ["--device", self.device, "--dtype", self.dtype, "--backends", ",".join(self.backends),
                  "--batches", ",".join(map(str, self.batches)), "--contexts", ",".join(map(str, self.contexts)),
                  "--chunk", str(self.chunk), "--steps", str(self.steps), "--mixed-steps", str(self.mixed_steps),
                  "--profile-steps", str(self.profile_steps), "--seed", str(self.seed),
                  "--draft-tokens", str(self.draft_tokens), "--acceptance-length", str(self.acceptance_length)]
        return shlex.join(parts)

    def decode_calls(self) -> int:
        """Decode steps that advance a side's static cache per configuration (count): the verified replay
        (CUDA) or first step, the warm-up, the timed steps, the profiled steps."""
        return 1 + DECODE_WARMUP + self.steps + self.profile_steps

    def capacity(self, context: int) -> int:
        """MLA slots of a configuration's static cache (tokens): the context plus every step that advances
        it (the side-stream warm-up before a capture is undone, so it needs room only once)."""
        return context + max(self.decode_calls(), GRAPH_WARMUP) + 1


# ------------------------------------------------------------------------------------------ the result


class OpTime(_Model):
    """One op of a profile (averaged per profiled step)."""

    name: str
    calls_per_step: float
    self_cpu_us_per_step: float = Field(description="host time inside the op itself (microseconds)")
    self_device_us_per_step: float | None = Field(description="CUDA: kernel time the op launched itself "
                                                  "(microseconds); None on the CPU")
    share_pct: float = Field(description="of the profile's summed self time in the sort key")


class ProfileReport(_Model):
    """``torch.profiler`` over a few eager decode steps of one side (the ops a graph replay runs, with the
    host time the replay removes)."""

    steps: int
    sort_by: Literal["self_device_us", "self_cpu_us"]
    step_wall_ms: float = Field(description="wall time per profiled step, profiler overhead included (ms)")
    total_self_us_per_step: float = Field(description="summed self time in the sort key (microseconds)")
    total_self_cpu_us_per_step: float = Field(description="summed host self time of the ops (microseconds; on CUDA "
                                              "what a graph replay no longer spends)")
    top_ops: list[OpTime]
    error: str | None = Field(default=None, description="why there is no breakdown (the run went on)")


class TraceSummary(_Model):
    """The dispatcher's decisions over the timed steps of one side."""

    steps: int
    kernel_steps: int = Field(description="steps in which the latency-specialized kernel ran at least once")
    kernel_steps_fraction: float
    kernel_calls_fraction: float = Field(description="of all dispatched op calls in those steps")
    implementations: dict[str, int] = Field(description="'op:implementation' -> calls, summed over the steps")
    reasons: list[str] = Field(description="'op -> implementation: reason', each distinct one")
    source: Literal["per_call", "capture"] = Field(description="per_call: recorded at every eager step; capture: "
                                                    "recorded when the graph was captured, which every replay repeats")


class GraphCheck(_Model):
    """CUDA only: how a side's decode step was captured and checked before it was timed."""

    warmup_steps: int = Field(description="eager steps on a side stream before capture, then undone")
    capture_ms: float
    logits_rewritten: bool = Field(description="the replay rewrote every poisoned logit and token")
    tokens_equal_eager: bool = Field(description="the replay's tokens equal an eager step's from the same state")
    max_abs_logit_diff: float = Field(description="replay against the eager step (nats)")
    trace_equal_eager: bool = Field(description="the capture's dispatch decisions equal the eager step's")


class SideResult(_Model):
    """One side (decode backend) of one step kind of one configuration."""

    backend: str
    samples_us: list[float] = Field(description="every timed step (microseconds)")
    median_us: float
    ci99_us: tuple[float, float] = Field(description="99% bootstrap interval of the median (microseconds)")
    tokens_per_s: float = Field(description="tokens_per_step / median step time")
    trace: TraceSummary
    graph: GraphCheck | None = None
    profile: ProfileReport | None = None


class StepKindResult(_Model):
    """Decode or mixed steps of one configuration, every side."""

    kind: Literal["decode", "mixed", "speculative"]
    phase: str = Field(description="the phase the dispatcher was told (vLLM plugin's classify_batch)")
    mode: Literal["cuda_graph", "eager"]
    tokens_per_step: int = Field(description="tokens one step processes: B (decode), chunk + B - 1 (mixed); "
                                 "speculative: tokens the step emits, B x acceptance length")
    sides: dict[str, SideResult]
    speedup: float | None = Field(description="median standard / median latency_specialized; None with one side")
    speedup_ci99: tuple[float, float] | None = None
    first_tokens_agree: bool | None = Field(default=None, description="decode: both sides' first greedy tokens equal")
    eager_reason: str | None = Field(default=None, description="speculative on CUDA: why the forward ran eagerly "
                                     "(a side's capture failed or its replay check did)")


class ConfigRow(_Model):
    """One (batch, context) configuration."""

    batch: int
    context: int
    capacity_tokens: int = Field(description="slots of the decode steps' static MLA cache")
    decode: StepKindResult
    mixed: StepKindResult
    speculative: StepKindResult | None = Field(default=None, description="a verification step of D drafts per "
                                               "request at the synthetic acceptance length (None: --draft-tokens 0)")


class BenchModelResult(_Model):
    """``k3_mini_bench_model.json``."""

    format: Literal["workbench-bench-model/1"] = FORMAT
    complete: bool = Field(description="every planned configuration measured; false in the file the child "
                           "rewrites after each configuration until it is done (a run stopped early leaves that)")
    configurations_planned: int
    command: str
    spec: BenchModelSpec
    model: str = "k3_mini"
    config_overrides: dict[str, Any]
    worktree: str
    worktree_commit: str | None
    settings: dict[str, Any]
    prompts: dict[str, Any]
    build: dict[str, Any]
    notes: list[str]
    environment: dict[str, Any]
    rows: list[ConfigRow]
    duration_s: float


def read_result(path: Path) -> BenchModelResult:
    """Load and validate a result file.

    Raises:
        BenchModelError: not a readable ``bench-model`` result.
    """
    try:
        return BenchModelResult.model_validate_json(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise BenchModelError(f"{path}: not a workbench bench-model result ({exc}).") from None


# --------------------------------------------------------------------------------------- parent side


def run_bench_model(root: Path, spec: BenchModelSpec, *, out_dir: Path | None = None,
                    timeout_s: float = CHILD_TIMEOUT_S, log: Callable[[str], None] | None = None) -> Path:
    """Run the benchmark in a child rooted at the candidate's worktree; write JSON, PNG and log.

    Args:
        root: the workbench checkout.
        spec: what to measure (:meth:`BenchModelSpec.resolve`).
        out_dir: where the files go (default ``bench/results/local``).
        timeout_s: wall-clock limit of the child (seconds).
        log: receives the child's log lines (default: dropped; the ``.log`` file has them all).

    Returns:
        The JSON path.

    Raises:
        BenchModelError: CUDA asked for without a CUDA device, a task whose op K3-mini never calls, or a
            measurement the child refused (a capture that failed its check: the message says which).
        CandidateError, RepoError, TaskSpecError: the candidate cannot be committed into a worktree.
        RuntimeError: the child crashed or ran past ``timeout_s`` (its output's tail in the message).
    """
    import torch

    from guards import progress
    from workbench.bench import candidate_worktree, run_measuring_child

    if spec.device == "cuda" and not torch.cuda.is_available():
        build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise BenchModelError(f"workbench bench-model: --device cuda, but torch {torch.__version__} sees no CUDA device "
                              f"({build}); run on a GPU machine or pass --device cpu.")
    if spec.candidate:
        from k3_model.model import DISPATCHED_OPS, SPECULATIVE_OPS
        from workbench.taskspec import load_task

        task = load_task(root, spec.task_id)
        if task.op not in DISPATCHED_OPS + SPECULATIVE_OPS:
            raise BenchModelError(f"workbench bench-model: task {spec.task_id!r} targets op {task.op!r}, which K3-mini "
                                  f"never calls (it dispatches {list(DISPATCHED_OPS)}, and {list(SPECULATIVE_OPS)} in "
                                  "speculative steps); its kernel cannot change the model's speed. Pass --task with "
                                  "one of those ops.")
        if task.op in SPECULATIVE_OPS and not spec.draft_tokens:
            raise BenchModelError(f"workbench bench-model: task {spec.task_id!r} targets op {task.op!r}, which runs only "
                                  "in speculative steps, but --draft-tokens is 0; pass --draft-tokens 7.")
    prompt_file = Path(root) / PROMPT_FILE
    if not prompt_file.is_file():
        raise BenchModelError(f"workbench bench-model: the prompt text {prompt_file} is missing; restore it from git.")
    out_dir = Path(out_dir or Path(root) / "bench" / "results" / "local")
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{RESULT_NAME}.json"
    wt = candidate_worktree(Path(root), spec.task_id, spec.candidate)
    args = {"spec": spec.model_dump(mode="json"), "worktree": str(wt), "worktree_commit": _head(wt),
            "prompt_file": str(prompt_file), "prompt_name": str(PROMPT_FILE), "out": str(json_path)}
    logf = json_path.with_suffix(".log").open("w")
    refused: list[str] = []

    def on_line(line: str) -> None:
        logf.write(line + "\n")
        logf.flush()
        if line.startswith(PROGRESS_PREFIX):
            p = json.loads(line[len(PROGRESS_PREFIX):])
            if p["phase"] != progress.current().phase:
                progress.phase(p["phase"], done=p.get("done"), total=p.get("total"))
            elif p.get("done") is not None:
                progress.advance(p["done"])
        elif line.startswith(ERROR_PREFIX):
            refused.append(line[len(ERROR_PREFIX):])
        elif log is not None and line.startswith(LOG_PREFIX):
            log(line[len(LOG_PREFIX):])

    json_path.unlink(missing_ok=True)
    try:
        run_measuring_child("workbench.bench_model", args, wt, timeout_s=timeout_s, what="workbench bench-model",
                            on_line=on_line)
    except RuntimeError as exc:
        partial = _partial_note(json_path)
        if refused:
            raise BenchModelError(f"workbench bench-model: {refused[-1]}{partial}") from None
        raise RuntimeError(str(exc) + partial) from None
    finally:
        logf.close()
    result = read_result(json_path)
    if not result.complete:
        raise BenchModelError(f"workbench bench-model: the child exited 0 but {json_path} holds {len(result.rows)} of "
                              f"{result.configurations_planned} configurations.")
    plot(result, json_path.with_suffix(".png"))
    return json_path


def _partial_note(json_path: Path) -> str:
    """`` (partial result: ...)`` when a stopped child left configurations behind (plotted too), else ``""``."""
    if not json_path.is_file():
        return ""
    try:
        result = read_result(json_path)
        if result.rows:
            plot(result, json_path.with_suffix(".png"))
    except BenchModelError:
        return ""
    return (f" (partial result: {len(result.rows)} of {result.configurations_planned} configurations in {json_path}, "
            f"log in {json_path.with_suffix('.log')})")


def _head(path: Path) -> str | None:
    import git

    try:
        return git.Repo(path, search_parent_directories=True).head.commit.hexsha
    except (git.InvalidGitRepositoryError, git.NoSuchPathError, ValueError):
        return None


def plot(result: BenchModelResult, png_path: Path) -> None:
    """Tokens/s of the decode steps against batch, one panel per context, one line per side (log-log).

    Args:
        result: a loaded result with at least one configuration (a partial one: the contexts it has).
        png_path: where the figure goes.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    contexts = sorted({r.context for r in result.rows})  # a partial result lacks the later contexts
    fig, axes = plt.subplots(1, len(contexts), figsize=(3.6 * len(contexts) + 1, 4), squeeze=False)
    for ax, c in zip(axes[0], contexts):
        rows = [r for r in result.rows if r.context == c]
        for side in result.spec.backends:
            ax.plot([r.batch for r in rows], [r.decode.sides[side].tokens_per_s for r in rows], marker="o",
                    label=side.replace("_", " "))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(list(result.spec.batches), [str(b) for b in result.spec.batches])
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(f"context {c}")
        ax.set_xlabel("decode batch (sequences)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("decode tokens/s (median step)")
    axes[0][0].legend(fontsize=8)
    mode = "CUDA graphs" if result.spec.device == "cuda" else "eager"
    gpu = result.environment.get("gpu_name") or f"CPU ({result.settings.get('torch_threads')} torch thread(s))"
    fig.suptitle(f"K3-mini decode, {result.spec.dtype}, {mode}, {gpu}"
                 + (f" - candidate {Path(result.spec.candidate).name}" if result.spec.candidate else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def summary_rows(result: BenchModelResult) -> list[dict[str, str]]:
    """One row of text per configuration for the command line's table."""
    def ms(s: SideResult | None) -> str:
        return "-" if s is None else f"{s.median_us / 1e3:.2f}"

    def sp(k: StepKindResult) -> str:
        if k.speedup is None:
            return "-"
        lo, hi = k.speedup_ci99 or (math.nan, math.nan)
        return f"{k.speedup:.2f}x ({lo:.2f}-{hi:.2f})"

    def kern(k: StepKindResult) -> str:
        s = k.sides.get("latency_specialized")
        return "-" if s is None else f"{100 * s.trace.kernel_steps_fraction:.0f}%"

    def spec_tps(k: StepKindResult | None) -> str:
        if k is None:
            return "-"
        side = k.sides.get("latency_specialized") or k.sides["standard"]
        return f"{side.tokens_per_s:,.0f}"

    out = []
    for r in result.rows:
        std, ls = r.decode.sides.get("standard"), r.decode.sides.get("latency_specialized")
        main = ls or std
        out.append({"context": str(r.context), "batch": str(r.batch), "std ms": ms(std), "lat.spec ms": ms(ls),
                    "decode speedup (99% CI)": sp(r.decode),
                    "tok/s": f"{main.tokens_per_s:,.0f}" if main else "-", "kernel": kern(r.decode),
                    "mixed step (phase)": r.mixed.phase, "mixed speedup": sp(r.mixed), "mixed kernel": kern(r.mixed),
                    "spec tok/s": spec_tps(r.speculative), "spec speedup": sp(r.speculative) if r.speculative else "-"})
    return out


# ---------------------------------------------------------------------------------------- child side


def _progress(phase: str, done: int | None = None, total: int | None = None) -> None:
    print(PROGRESS_PREFIX + json.dumps({"phase": phase, "done": done, "total": total}), flush=True)


def _log(msg: str) -> None:
    print(LOG_PREFIX + msg, file=sys.stderr, flush=True)


def _noop() -> None:
    return None


def _prompts(path: Path, batch: int, length: int, bos: int):
    """(batch, length) int64 prompts: ``[BOS]`` then the text's tokens from offset ``b * stride``,
    repeated as often as needed (stride = text tokens / batch, so sequences differ), on the CPU."""
    import torch

    from k3_model.tokenizer import build_tokenizer

    text = path.read_text()
    ids = torch.tensor(build_tokenizer().encode(text), dtype=torch.int64)
    n = ids.numel()
    stride = max(1, n // batch)
    idx = (torch.arange(batch).view(-1, 1) * stride + torch.arange(length - 1).view(1, -1)) % n
    out = torch.cat([torch.full((batch, 1), bos, dtype=torch.int64), ids[idx]], dim=1)
    info = {"source": None, "sha256": hashlib.sha256(text.encode()).hexdigest(), "text_tokens": n,
            "offset_stride_tokens": stride, "bos_id": bos,
            "tokenizer": "k3_model.tokenizer.build_tokenizer() (vocab 4096, seed 0)",
            "construction": "[BOS] + the text's tokens from offset b * stride for sequence b, repeated and "
                            "truncated to the context"}
    return out, info


@dataclasses.dataclass
class _Contexts:
    """The prefilled contexts: per group of sequences its cache at the longest context, the KDA states at
    every boundary a configuration starts from, and each sequence's greedy token after each context."""

    model: Any
    groups: list[tuple[int, int, Any]]  # (first row, end row, K3Cache at the longest context)
    kda: dict[int, list[list[Any]]]  # boundary -> per group -> per layer KDAState (None for MLA layers)
    next_tokens: dict[int, Any]  # context -> (B_max,) int64 on the device

    def cache_at(self, rows: range, length: int, *, capacity: int):
        """An ordinary K3Cache of sequences ``rows`` at ``length`` tokens (copies), room for ``capacity``."""
        import torch

        from k3_model.layers import KDAState, MLACache
        from k3_model.model import K3Cache

        picks = [(gi, slice(max(rows.start, g0) - g0, min(rows.stop, g1) - g0))
                 for gi, (g0, g1, _) in enumerate(self.groups) if max(rows.start, g0) < min(rows.stop, g1)]
        layers = []
        for li, lw in enumerate(self.model.layers):
            if lw.kind == "kda":
                snaps = [(self.kda[length][gi][li], sl) for gi, sl in picks]
                layers.append(KDAState(torch.cat([s.recurrent[sl] for s, sl in snaps]),
                                       torch.cat([s.conv[sl] for s, sl in snaps])))
            else:
                srcs = [(self.groups[gi][2].layers[li], sl) for gi, sl in picks]
                lat = torch.cat([s.latent[sl, :length] for s, sl in srcs])
                pe = torch.cat([s.k_pe[sl, :length] for s, sl in srcs])
                dst = MLACache(lat.shape[0], lat.shape[2], pe.shape[2], dtype=lat.dtype, device=lat.device,
                               page_tokens=capacity, max_tokens=capacity)
                if length:
                    dst.append(lat, pe)
                layers.append(dst)
        return K3Cache(layers, length)


def _build_contexts(model, prompts, spec: BenchModelSpec) -> tuple[_Contexts, dict[str, Any]]:
    """Prefill every sequence on the standard path up to the longest context (chunks of ``spec.chunk``,
    cut at every length a configuration starts from), in groups whose attention scores fit the budget."""
    import torch

    from k3_model.dispatch import forward_context
    from k3_model.layers import KDAState

    t0 = time.perf_counter()
    B_max, C_max = prompts.shape
    ch = spec.chunk
    starts = {0} | set(spec.contexts) | {c - ch for c in spec.contexts}
    cuts = sorted((set(range(ch, C_max + 1, ch)) | starts | {C_max}) - {0})
    heads = model.text.num_attention_heads
    per_seq = 5 * 4 * heads * ch * C_max  # bytes: ~5 fp32 (heads, chunk, C_max) score tensors per sequence
    group = max(1, min(B_max, PREFILL_BUDGET_BYTES[spec.device] // per_seq))
    bounds = [(g0, min(B_max, g0 + group)) for g0 in range(0, B_max, group)]
    groups, kda = [], {s: [] for s in starts}
    next_tokens = {c: torch.empty(B_max, dtype=torch.int64, device=model.device) for c in spec.contexts}
    total, done = len(bounds) * len(cuts), 0
    phase = f"prefilling {B_max} x {C_max} tokens of prose (standard path, chunks of {ch})"
    _log(f"{phase}: {len(bounds)} group(s) of up to {group} sequences, {len(cuts)} chunks each")

    def kda_snapshot(cache) -> list:
        return [KDAState(st.recurrent.clone(), st.conv.clone()) if isinstance(st, KDAState) else None
                for st in cache.layers]

    for g0, g1 in bounds:
        cache = model.new_cache(g1 - g0, page_tokens=C_max, max_tokens=C_max)
        kda[0].append(kda_snapshot(cache))
        pos = 0
        for cut in cuts:
            with forward_context(decode_backend="standard", phase="prefill"):
                logits = model.forward(prompts[g0:g1, pos:cut].to(model.device), cache)
            pos = cut
            if cut in starts:
                kda[cut].append(kda_snapshot(cache))
            if cut in next_tokens:
                next_tokens[cut][g0:g1] = logits[:, -1].argmax(-1)
            done += 1
            _progress(phase, done, total)
        groups.append((g0, g1, cache))
    if spec.device == "cuda":
        torch.cuda.synchronize()
    info = {"prefill_s": time.perf_counter() - t0, "sequences": B_max, "tokens_per_sequence": C_max,
            "chunks_per_group": len(cuts), "groups": len(bounds), "group_size": group,
            "backend": "standard (both sides start from the same state)"}
    _log(f"contexts built in {info['prefill_s']:.1f} s")
    return _Contexts(model, groups, kda, next_tokens), info


def _trace_summary(per_step: Sequence[Sequence[Any]], source: str) -> TraceSummary:
    """Summarise per-step dispatch decisions (``k3_model.dispatch.Decision`` lists)."""
    impl: Counter[str] = Counter()
    reasons: dict[str, None] = {}
    kernel_steps = ls_calls = calls = 0
    for decisions in per_step:
        ls = [d for d in decisions if d.implementation == "latency_specialized"]
        kernel_steps += bool(ls)
        ls_calls += len(ls)
        calls += len(decisions)
        for d in decisions:
            impl[f"{d.op}:{d.implementation}"] += 1
            reasons.setdefault(f"{d.op} -> {d.implementation}: {d.reason}")
    n = len(per_step)
    return TraceSummary(steps=n, kernel_steps=kernel_steps, kernel_steps_fraction=kernel_steps / n if n else 0.0,
                        kernel_calls_fraction=ls_calls / calls if calls else 0.0, implementations=dict(impl),
                        reasons=list(reasons), source=source)


def _side(backend: str, samples: list[float], tokens_per_step: int, trace: TraceSummary, **extra) -> SideResult:
    from kernels import stats

    med = stats.median(samples)
    return SideResult(backend=backend, samples_us=samples, median_us=med,
                      ci99_us=stats.bootstrap_median_ci(samples, confidence=0.99),
                      tokens_per_s=tokens_per_step / (med * 1e-6), trace=trace, **extra)


def _kind(kind: str, phase: str, mode: str, tokens: int, sides: dict[str, SideResult], **extra) -> StepKindResult:
    from kernels import stats

    speedup = ci = None
    if "standard" in sides and "latency_specialized" in sides:
        a, b = sides["standard"], sides["latency_specialized"]
        speedup = a.median_us / b.median_us
        ci = stats.bootstrap_ratio_ci(a.samples_us, b.samples_us, confidence=0.99)
    return StepKindResult(kind=kind, phase=phase, mode=mode, tokens_per_step=tokens, sides=sides, speedup=speedup,
                          speedup_ci99=ci, **extra)


def _time_sides(fns: dict[str, Callable[[], None]], spec: BenchModelSpec, *, warmup: int, repetitions: int,
                before_call: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Per-step samples (microseconds) of one or two sides, interleaved A B / B A (kernels.timing)."""
    from kernels import timing

    names = list(fns)
    second = fns[names[1]] if len(names) > 1 else _noop
    r = timing.time_pair(fns[names[0]], second, device=spec.device, warmup=warmup, repetitions=repetitions,
                         flush_l2=True, before_call=before_call)
    out = {names[0]: r.baseline.samples_us}
    if len(names) > 1:
        out[names[1]] = r.candidate.samples_us
    return out


def _time_from_state(fns: dict[str, Callable[[], None]], restore: Callable[[], None], spec: BenchModelSpec, *,
                     repetitions: int) -> dict[str, list[float]]:
    """Eager steps that each start from the same state: :data:`MIXED_WARMUP` untimed calls per side, then
    :func:`_time_sides` with ``restore`` before every call (untimed)."""
    for _ in range(MIXED_WARMUP):
        for f in fns.values():
            restore()
            f()
    return _time_sides(fns, spec, warmup=0, repetitions=repetitions, before_call=restore)


def _profile(fn: Callable[[], None], steps: int, device: str) -> ProfileReport:
    """``torch.profiler`` over ``steps`` calls of ``fn``: the top ops by self device time (CUDA) or self
    CPU time (CPU), per step. A profiler failure is recorded in ``error`` (the numbers stand without it)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sort_by = "self_device_us" if device == "cuda" else "self_cpu_us"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    try:
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            if device == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        rows = []
        for e in prof.key_averages():
            if device == "cuda" and not str(getattr(e, "device_type", "CPU")).endswith("CPU"):
                continue  # kernel rows repeat the device time of the op that launched them
            dev_us = float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) or 0.0)
            rows.append((e.key, e.count / steps, e.self_cpu_time_total / steps,
                         dev_us / steps if device == "cuda" else None))
    except Exception as exc:  # the profiler is a second opinion: keep the run's numbers, say what failed
        _log(f"profile failed ({type(exc).__name__}: {exc}); the result has no breakdown for this side")
        return ProfileReport(steps=steps, sort_by=sort_by, step_wall_ms=0.0, total_self_us_per_step=0.0,
                             total_self_cpu_us_per_step=0.0, top_ops=[], error=f"{type(exc).__name__}: {exc}")
    key = 3 if device == "cuda" else 2
    total = sum(r[key] for r in rows)
    top = sorted((r for r in rows if r[key] > 0), key=lambda r: -r[key])[:TOP_OPS]
    return ProfileReport(steps=steps, sort_by=sort_by, step_wall_ms=1e3 * wall / steps, total_self_us_per_step=total,
                         total_self_cpu_us_per_step=sum(r[2] for r in rows),
                         top_ops=[OpTime(name=n, calls_per_step=c, self_cpu_us_per_step=cpu, self_device_us_per_step=d,
                                         share_pct=100.0 * (d if device == "cuda" else cpu) / total if total else 0.0)
                                  for n, c, cpu, d in top])


def _first_step(step) -> tuple[Any, Any, list[Any]]:
    """One eager step from the current state, undone: ``(next_tokens, logits, decisions)`` copies."""
    snap = step.snapshot()
    step()
    out = step.next_tokens.clone(), step.logits.clone(), list(step.last_decisions)
    step.restore(snap)
    return out


# ---- CUDA only: capture a decode step and prove the replay computes it --------------------------------


def _capture_verified(step, label: str) -> tuple[Any, GraphCheck, Any, list[Any]]:
    """Capture ``step`` (a StaticDecodeStep on CUDA) into a CUDA graph and check one replay.

    Phases, each logged: (1) warm-up: :data:`GRAPH_WARMUP` eager steps on a side stream (allocator, lazy
    init, Triton compiles), then the state is restored; (2) capture of one step (nothing runs: a
    capture records); (3) an eager step from the restored state gives the expected tokens, logits and
    dispatch decisions, and the state is restored again; (4) the outputs are poisoned (NaN logits, -1
    tokens) and the graph is replayed once from that state: every output must be rewritten, the tokens
    must equal the eager ones, and the decisions recorded at capture must equal the eager step's. The
    state is then one step past the start (the verified replay counts as the first decode step).

    Returns:
        ``(graph, check, eager_tokens, captured)``: ``captured`` the dispatch decisions recorded at capture
        (what every replay runs).

    Raises:
        BenchModelError: the capture raised (capture-unsafe code: a host sync, a CPU tensor, a launch on
            another stream), or the replay failed a check; the message names the configuration and phase.

    Source: PyTorch "CUDA Graphs" notes (side-stream warm-up, static inputs and outputs, capture records).
    """
    import torch

    snap = step.snapshot()
    _log(f"{label}: warm-up: {GRAPH_WARMUP} eager steps on a side stream")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(GRAPH_WARMUP):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    step.restore(snap)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    try:
        with torch.cuda.graph(graph):
            step()
        torch.cuda.synchronize()
    except Exception as exc:  # any capture failure: name the configuration, keep the cause
        raise BenchModelError(f"{label}: CUDA graph capture failed ({type(exc).__name__}: {exc}); the decode step "
                              "is not capturable (a host sync, a CPU tensor or a launch off the capture stream in "
                              "the model or the kernel).") from exc
    capture_ms = 1e3 * (time.perf_counter() - t0)
    captured = list(step.last_decisions)
    _log(f"{label}: captured one decode step in {capture_ms:.0f} ms")
    step.restore(snap)
    eager_tokens, eager_logits, eager_decisions = _first_step(step)
    torch.cuda.synchronize()
    step.logits.fill_(float("nan"))
    step.next_tokens.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    unwritten = int(torch.isnan(step.logits).sum()) + int((step.next_tokens < 0).sum())
    if unwritten:
        raise BenchModelError(f"{label}: the CUDA graph replay left {unwritten} logits/tokens unwritten (still "
                              "poisoned): the step's work was not captured (a launch on another stream?).")
    diff = step.next_tokens != eager_tokens
    if bool(diff.any()):
        i = int(diff.nonzero()[0, 0])
        raise BenchModelError(f"{label}: the CUDA graph replay's tokens differ from the eager step's at {int(diff.sum())} "
                              f"of {diff.numel()} sequences (first: sequence {i}, eager {int(eager_tokens[i])}, replay "
                              f"{int(step.next_tokens[i])}); the replay does not compute the step.")
    same_trace = [(d.op, d.implementation) for d in captured] == [(d.op, d.implementation) for d in eager_decisions]
    if not same_trace:
        raise BenchModelError(f"{label}: the dispatcher decided differently at capture ({_counts(captured)}) than in "
                              f"the eager step ({_counts(eager_decisions)}).")
    max_diff = float((step.logits - eager_logits).abs().max())
    _log(f"{label}: replay verified: tokens equal the eager step's, max |logit diff| {max_diff:.3g}, "
         f"dispatch {_counts(captured)}")
    return graph, GraphCheck(warmup_steps=GRAPH_WARMUP, capture_ms=capture_ms, logits_rewritten=True,
                             tokens_equal_eager=True, max_abs_logit_diff=max_diff, trace_equal_eager=True), \
        eager_tokens, captured


# ---- every device ---------------------------------------------------------------------------------


def _counts(decisions: Sequence[Any]) -> dict[str, int]:
    return dict(Counter(f"{d.op}:{d.implementation}" for d in decisions))


def _decode(model, store: _Contexts, spec: BenchModelSpec, B: int, c: int) -> StepKindResult:
    """The decode steps of one configuration, every side (see the module docstring)."""
    import torch

    from k3_model.decode import StaticDecodeStep

    cuda = spec.device == "cuda"
    cap = spec.capacity(c)
    steps, checks, firsts, calls = {}, {}, {}, dict.fromkeys(spec.backends, 0)
    graphs: dict[str, Any] = {}
    captured: dict[str, list[Any]] = {}
    for side in spec.backends:
        steps[side] = StaticDecodeStep(model, store.cache_at(range(0, B), c, capacity=c), store.next_tokens[c][:B],
                                       decode_backend=side, capacity=cap)
        label = f"B={B} context={c} {side}"
        if cuda:
            graphs[side], checks[side], firsts[side], captured[side] = _capture_verified(steps[side], label)
        else:
            firsts[side] = _first_step(steps[side])[0]
            steps[side]()  # the first decode step (on CUDA: the verified replay)
        calls[side] += 1
    per_step: dict[str, list[list[Any]]] = {s: [] for s in spec.backends}

    def timed(side: str) -> Callable[[], None]:
        step, run = steps[side], (graphs[side].replay if cuda else steps[side])

        def call() -> None:
            run()
            calls[side] += 1
            per_step[side].append(captured[side] if cuda else step.last_decisions)
        return call

    samples = _time_sides({s: timed(s) for s in spec.backends}, spec, warmup=DECODE_WARMUP, repetitions=spec.steps)
    profiles = {}
    for side in spec.backends:
        if spec.profile_steps:
            def counted(side: str = side) -> None:
                steps[side]()
                calls[side] += 1
            profiles[side] = _profile(counted, spec.profile_steps, spec.device)
        got = steps[side].positions()
        if got != [c + calls[side]] * len(got):  # the plan and the device agree on every step that ran
            raise BenchModelError(f"B={B} context={c} {side}: the static cache holds {got} tokens per MLA layer; "
                                  f"expected {c + calls[side]} ({calls[side]} steps after the context).")
    if cuda:
        graphs.clear()
        torch.cuda.synchronize()
    sides = {s: _side(s, samples[s], B, _trace_summary(per_step[s][-spec.steps:], "capture" if cuda else "per_call"),
                      graph=checks.get(s), profile=profiles.get(s)) for s in spec.backends}
    agree = bool(torch.equal(*firsts.values())) if len(firsts) == 2 else None
    ls = sides.get("latency_specialized") or sides["standard"]
    _log(f"B={B} context={c} decode: " + ", ".join(f"{s} {v.median_us / 1e3:.3f} ms" for s, v in sides.items())
         + f"; kernel ran in {100 * ls.trace.kernel_steps_fraction:.0f}% of {ls.backend} steps")
    return _kind("decode", "decode", "cuda_graph" if cuda else "eager", B, sides, first_tokens_agree=agree)


def _mixed(model, store: _Contexts, prompts, spec: BenchModelSpec, B: int, c: int) -> StepKindResult:
    """The mixed steps of one configuration, every side, eager (see the module docstring)."""
    from k3_model.dispatch import forward_context, record_trace
    from k3_model.layers import KDAState
    from k3_model.vllm_plugin.batch import classify_batch

    ch, dev = spec.chunk, model.device
    phase = classify_batch([ch] + [1] * (B - 1), [c - ch] + [c] * (B - 1))
    chunk_tokens = prompts[0:1, c - ch:c].to(dev)
    dec_tokens = store.next_tokens[c][1:B].view(-1, 1)
    caches = {s: [store.cache_at(range(0, 1), c - ch, capacity=c)]
              + ([store.cache_at(range(1, B), c, capacity=c + 1)] if B > 1 else []) for s in spec.backends}
    saved = {s: [([st.recurrent.clone(), st.conv.clone()] if isinstance(st, KDAState) else st.length)
                 for k in caches[s] for st in k.layers] for s in spec.backends}

    def restore() -> None:  # every mixed step starts at the same state: the prefilling sequence at c - chunk
        for s in spec.backends:
            states = [st for k in caches[s] for st in k.layers]
            for st, v in zip(states, saved[s]):
                if isinstance(st, KDAState):
                    st.recurrent.copy_(v[0])
                    st.conv.copy_(v[1])
                else:
                    st.length = v
            for k, L in zip(caches[s], (c - ch, c)):
                k.length = L

    per_step: dict[str, list[list[Any]]] = {s: [] for s in spec.backends}

    def mixed(side: str) -> Callable[[], None]:
        groups = [(chunk_tokens, caches[side][0])] + ([(dec_tokens, caches[side][1])] if B > 1 else [])

        def call() -> None:
            with record_trace() as trace, forward_context(decode_backend=side, phase=phase):
                model.forward_groups(groups)
            per_step[side].append(list(trace.decisions))
        return call

    samples = _time_from_state({s: mixed(s) for s in spec.backends}, restore, spec, repetitions=spec.mixed_steps)
    tokens = ch + B - 1
    sides = {s: _side(s, samples[s], tokens, _trace_summary(per_step[s][-spec.mixed_steps:], "per_call"))
             for s in spec.backends}
    _log(f"B={B} context={c} {phase} (eager, {tokens} tokens): "
         + ", ".join(f"{s} {v.median_us / 1e3:.3f} ms" for s, v in sides.items()))
    return _kind("mixed", phase, "eager", tokens, sides)


@dataclasses.dataclass
class _VerifyGraph:
    """A side's verification forward captured as a CUDA graph (:func:`_capture_verify_forward`)."""

    graph: Any
    logits: Any  # (B, 1 + D, V) float32: the graph's output buffer
    tracked: list[tuple[Any, list[Any]]]  # (KDAState, its per-token snapshots that every replay rewrites)
    lengths: list[tuple[Any, int]]  # (K3Cache or MLACache, its token count after the forward: host-side state)
    decisions: list[Any]  # the dispatcher's decisions recorded at capture (every replay repeats them)
    check: GraphCheck

    def replay(self) -> Any:
        """Run the forward from the caches' current state (the caller restored it); re-arm each KDA state's
        per-token snapshots (the replay rewrote them) and set the caches' token counts as the forward does, so
        the rollback finds them. Returns ``logits``."""
        self.graph.replay()
        for st, snaps in self.tracked:
            st.positions = list(snaps)
        for obj, n in self.lengths:  # the host-side counts the forward's Python code advanced at capture
            obj.length = n
        return self.logits


def _capture_verify_forward(fwd: Callable[[], Any], restore: Callable[[], None], caches: list[Any],
                            label: str) -> _VerifyGraph:
    """Capture a side's verification forward (every request's 1 + D tokens, per-request caches at a fixed
    context) into a CUDA graph and check one replay against an eager forward from the same state.

    The caches must not grow during the forward (their MLA storage holds the step's tokens), so the capture
    records writes into the same storage every replay writes; ``restore`` resets them (in place) before
    each step. Phases as :func:`_capture_verified`: warm-up on a side stream, capture, an eager forward,
    then a replay with the output poisoned: every logit must be rewritten and the replay's greedy choices
    must equal the eager forward's.

    Raises:
        BenchModelError: the capture raised or the replay failed a check (the caller runs the side eagerly
            and records why).

    Source: PyTorch "CUDA Graphs" notes; vLLM runs the model's graph and then its rejection sampler eagerly.
    """
    import torch

    from k3_model.dispatch import record_trace
    from k3_model.layers import KDAState

    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):
        for _ in range(GRAPH_WARMUP):
            restore()
            fwd()
    torch.cuda.current_stream().wait_stream(side_stream)
    torch.cuda.synchronize()
    restore()
    graph = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    try:
        with record_trace() as trace, torch.cuda.graph(graph):
            logits = fwd()
        torch.cuda.synchronize()
    except Exception as exc:  # any capture failure: name it, keep the cause
        raise BenchModelError(f"{label}: CUDA graph capture of the verification forward failed "
                              f"({type(exc).__name__}: {exc})") from exc
    capture_ms = 1e3 * (time.perf_counter() - t0)
    tracked = [(st, list(st.positions or [])) for k in caches for st in k.layers if isinstance(st, KDAState)]
    lengths = [(o, o.length) for k in caches for o in (k, *(st for st in k.layers if not isinstance(st, KDAState)))]
    restore()
    with record_trace() as eager_trace:
        eager = fwd().clone()
    restore()
    logits.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    restore()
    if bool(torch.isnan(logits).any()):
        raise BenchModelError(f"{label}: the replay left {int(torch.isnan(logits).sum())} logits unwritten")
    if not torch.equal(logits.argmax(-1), eager.argmax(-1)):
        raise BenchModelError(f"{label}: the replay's greedy choices differ from an eager forward's")
    same = [(d.op, d.implementation) for d in trace.decisions] == [(d.op, d.implementation) for d in eager_trace.decisions]
    if not same:
        raise BenchModelError(f"{label}: the dispatcher decided differently at capture ({_counts(trace.decisions)}) "
                              f"than eagerly ({_counts(eager_trace.decisions)})")
    diff = float((logits - eager).abs().max())
    _log(f"{label}: verification forward captured in {capture_ms:.0f} ms; replay verified (max |logit diff| "
         f"{diff:.3g}, dispatch {_counts(trace.decisions)})")
    return _VerifyGraph(graph, logits, tracked, lengths, list(trace.decisions),
                        GraphCheck(warmup_steps=GRAPH_WARMUP, capture_ms=capture_ms, logits_rewritten=True,
                                   tokens_equal_eager=True, max_abs_logit_diff=diff, trace_equal_eager=True))


def _speculative(model, store: _Contexts, spec: BenchModelSpec, B: int, c: int) -> StepKindResult:
    """The speculative verification steps of one configuration, every side, eager (module docstring).

    Each request has its own cache at context ``c``. Its drafts are its next ``acceptance_length - 1``
    greedy tokens and then wrong ones, as the standard path's verification forward itself chooses them (found
    untimed: the decode loop's tokens, then corrected by verification passes until they agree). A step: restore every
    cache to context ``c``, one :meth:`K3Model.forward_groups` over the B x (1 + D) tokens, ``dspark_verify``
    on the logits, roll each cache back to the tokens it kept (k3_model.decode's rollback). The tokens a
    step emits are counted on its first run (B x acceptance length unless a near tie in the bf16 logits
    moved a greedy choice; the log says so).

    Raises:
        BenchModelError: the verification emitted no token for a request (a broken step).
    """
    import torch

    from k3_model.decode import rewind_cache
    from k3_model.dispatch import forward_context, record_trace
    from k3_model.layers import KDAState
    from k3_model.ops.dspark_verify import dspark_verify

    D, AL, dev = spec.draft_tokens, spec.acceptance_length, model.device
    ldt = getattr(torch, SPEC_LOGITS_DTYPE)
    first = store.next_tokens[c][:B]
    V, n_right = model.text.vocab_size, min(AL - 1, D)
    # on CUDA every verification forward (the drafts' passes, eager checks, the captured one) takes the capturable
    # form (no host sync, the MoE layout read with fixed shapes), so all of them compute alike; the token ids
    # were checked when the contexts were built
    capturable = spec.device == "cuda"
    # each request's next greedy tokens (untimed, standard path): the first AL - 1 are its right drafts, and the
    # AL-th, changed, is the first wrong one (the drafts after a greedy rejection are never read)
    probe = store.cache_at(range(0, B), c, capacity=c + AL + 1)
    cont, tok = [], first.view(B, 1)
    for _ in range(min(AL, D)):
        with forward_context(decode_backend="standard", phase="decode"):
            tok = model.forward(tok, probe)[:, -1].to(ldt).argmax(-1).view(B, 1)
        cont.append(tok)
    right = torch.cat(cont, 1)[:, :n_right]
    wrong = ((cont[-1] + 1) % V).expand(B, D - n_right)
    drafts = torch.cat([right, wrong], dim=1)  # (B, D)
    inputs = torch.cat([first.view(B, 1), drafts], dim=1)  # (B, 1 + D)

    def verify_choices(tokens: Any) -> Any:
        """(B, 1 + D) greedy choices of the standard path's verification forward itself (untimed)."""
        ks = [store.cache_at(range(b, b + 1), c, capacity=c + D + 1) for b in range(B)]
        for k in ks:
            for st in k.layers:
                if isinstance(st, KDAState):
                    st.track_positions()
        with forward_context(decode_backend="standard", phase="spec_verify", requests=B, query_len=1 + D):
            logits = torch.cat(model.forward_groups([(tokens[b:b + 1].to(dev), ks[b]) for b in range(B)],
                                                    capturable=capturable))
        return logits.to(ldt).argmax(-1)

    # The verification forward (1 + D query tokens, per-token KDA) rounds differently from a decode step, so on
    # bf16 logits a near tie can make it disagree with the decode loop's choice (H200, session 21: 3 tokens a step
    # at B = 1 where AL = 6 was asked). Make the drafts its own choices: position j's choice depends on the drafts
    # before it only, so each pass fixes one more position; n_right + 1 passes reach the fixed point.
    for _ in range(n_right + 1):
        pred = verify_choices(inputs)
        fixed = torch.cat([pred[:, :n_right], ((pred[:, n_right:n_right + 1] + 1) % V).expand(B, D - n_right)], 1)
        if torch.equal(fixed, drafts):
            break
        drafts = fixed
        inputs = torch.cat([first.view(B, 1), drafts], dim=1)
    caches = {s: [store.cache_at(range(b, b + 1), c, capacity=c + D + 1) for b in range(B)] for s in spec.backends}
    saved = {s: [[(st.recurrent.clone(), st.conv.clone()) if isinstance(st, KDAState) else None for st in k.layers]
                 for k in caches[s]] for s in spec.backends}

    def restore() -> None:  # every step starts at context c
        for s in spec.backends:
            for k, snaps in zip(caches[s], saved[s]):
                for st, snap in zip(k.layers, snaps):
                    if snap is None:
                        st.truncate(c)
                    else:
                        st.recurrent.copy_(snap[0])
                        st.conv.copy_(snap[1])
                        st.positions = None
                k.length = c

    greedy = torch.zeros(B, dtype=torch.float32, device=dev)
    top_k, top_p = torch.zeros(B, dtype=torch.int32, device=dev), torch.ones(B, dtype=torch.float32, device=dev)
    u = torch.zeros(B, D, device=dev)
    noise = torch.ones(B, model.text.vocab_size, device=dev)
    draft_ids = drafts.to(dev, torch.int32).contiguous()
    n_drafts = torch.full((B,), D, dtype=torch.int32, device=dev)
    per_step: dict[str, list[list[Any]]] = {s: [] for s in spec.backends}
    emitted: dict[str, int] = {}
    graphs: dict[str, _VerifyGraph] = {}
    eager_reason: dict[str, str] = {}

    def forward(side: str) -> Callable[[], Any]:
        """The verification forward of every request: (B, 1 + D, V) float32 logits."""
        groups = [(inputs[b:b + 1].to(dev), caches[side][b]) for b in range(B)]

        def fwd() -> Any:
            for k in caches[side]:
                for st in k.layers:
                    if isinstance(st, KDAState):
                        st.track_positions()
            with forward_context(decode_backend=side, phase="spec_verify", requests=B, query_len=1 + D):
                return torch.cat(model.forward_groups(groups, capturable=capturable))
        return fwd

    if spec.device == "cuda":
        for side in spec.backends:
            try:
                graphs[side] = _capture_verify_forward(forward(side), restore, caches[side], f"B={B} context={c} "
                                                       f"{side} speculative")
            except BenchModelError as exc:  # logged and recorded: this side's steps run eagerly
                eager_reason[side] = str(exc)
                _log(f"B={B} context={c} {side} speculative: {exc}; its verification steps run eagerly")
        if graphs and len(graphs) != len(spec.backends):  # a graph against an eager step compares launch costs
            for side in graphs:
                eager_reason[side] = "the other side could not be captured; both sides run eagerly"
            graphs.clear()

    def step(side: str) -> Callable[[], None]:
        out_ids = torch.empty(B, D + 1, dtype=torch.int32, device=dev)
        n_acc = torch.empty(B, dtype=torch.int32, device=dev)
        fwd, graph = forward(side), graphs.get(side)

        def call() -> None:
            target = graph.replay().to(ldt) if graph is not None else None  # the model forward: one graph replay
            with record_trace() as trace, forward_context(decode_backend=side, phase="spec_verify", requests=B,
                                                          query_len=1 + D):
                if target is None:
                    target = fwd().to(ldt)
                # the verification and the rollback run eagerly, as a serving engine runs its rejection
                # sampler after the model's graph
                dspark_verify(target, draft_ids, n_drafts, None, greedy, top_k, top_p, u, noise, max_draft_tokens=D,
                              output_token_ids=out_ids, num_accepted_tokens=n_acc)
            kept = (n_acc + 1).tolist()  # the host reads the counts to roll back, as an engine does
            for k, a in zip(caches[side], kept):
                rewind_cache(k, c, a)
            emitted.setdefault(side, sum(kept))
            per_step[side].append((graph.decisions if graph is not None else []) + list(trace.decisions))
        return call

    samples = _time_from_state({s: step(s) for s in spec.backends}, restore, spec, repetitions=spec.steps)
    restore()
    tokens = emitted[spec.backends[0]]
    if tokens < B:
        raise BenchModelError(f"B={B} context={c} speculative: the verification kept {tokens} tokens for {B} requests; "
                              "each request emits at least one.")
    if tokens != B * AL:
        _log(f"B={B} context={c} speculative: the steps emit {tokens} tokens, not {B} x {AL}: a near tie in the "
             f"{SPEC_LOGITS_DTYPE} logits moved a greedy choice; tokens/s uses {tokens}")
    sides = {s: _side(s, samples[s], tokens, _trace_summary(per_step[s][-spec.steps:], "per_call"),
                      graph=graphs[s].check if s in graphs else None) for s in spec.backends}
    mode = "cuda_graph" if graphs else "eager"
    _log(f"B={B} context={c} speculative ({'forward as a CUDA graph' if graphs else 'eager'}, D={D}, {tokens} tokens "
         "emitted per step): " + ", ".join(f"{s} {v.median_us / 1e3:.3f} ms, {v.tokens_per_s:,.0f} tok/s"
                                           for s, v in sides.items()))
    return _kind("speculative", "spec_verify", mode, tokens, sides,
                 eager_reason="; ".join(f"{s}: {r}" for s, r in eager_reason.items()) or None)


def _measure(args: dict[str, Any]) -> BenchModelResult:
    import torch

    from k3_model.hf_config import k3_mini_hf_config, parse_hf_config
    from k3_model.model import K3Model, random_weights
    from workbench import env as envmod

    t0 = time.perf_counter()
    spec = BenchModelSpec.model_validate(args["spec"])
    if spec.device == "cpu":
        torch.set_num_threads(1)  # the CPU timer reads this thread's clock (kernels/timing.py)
    _progress("loading K3-mini and the prompts")
    raw = k3_mini_hf_config()
    need = spec.capacity(max(spec.contexts))
    overrides: dict[str, Any] = {}
    if need > raw["text_config"]["max_position_embeddings"]:
        overrides["max_position_embeddings"] = raw["text_config"]["max_position_embeddings"] = need
    cfg = parse_hf_config(raw)
    model = K3Model(cfg, random_weights(cfg, spec.seed), dtype=getattr(torch, spec.dtype), device=spec.device)
    prompts, prompt_info = _prompts(Path(args["prompt_file"]), max(spec.batches), max(spec.contexts), raw["bos_token_id"])
    prompt_info["source"] = args["prompt_name"]
    _log(f"K3-mini {spec.dtype} on {spec.device}, seed {spec.seed}; sides {', '.join(spec.backends)}; worktree "
         f"{args['worktree']}")
    store, build = _build_contexts(model, prompts, spec)
    rows: list[ConfigRow] = []
    total = len(spec.contexts) * len(spec.batches)
    kinds = "decode + mixed" + (" + speculative" if spec.draft_tokens else "")
    phase = f"measuring {total} configurations ({kinds}, {len(spec.backends)} side(s))"
    _progress(phase, 0, total)
    env = envmod.collect(spec.device)
    for c in spec.contexts:
        for B in spec.batches:
            rows.append(ConfigRow(batch=B, context=c, capacity_tokens=spec.capacity(c),
                                  decode=_decode(model, store, spec, B, c), mixed=_mixed(model, store, prompts, spec, B, c),
                                  speculative=_speculative(model, store, spec, B, c) if spec.draft_tokens else None))
            _progress(phase, len(rows), total)
            _write(Path(args["out"]), _result(args, spec, overrides, prompt_info, build, env, rows, total, t0))
            if spec.device == "cuda":
                torch.cuda.empty_cache()
    return _result(args, spec, overrides, prompt_info, build, env, rows, total, t0)


def _write(path: Path, result: BenchModelResult) -> None:
    """Write ``result`` whole or not at all (a stopped child never leaves half a file)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(result.model_dump_json(indent=1))
    tmp.replace(path)


def _result(args: dict[str, Any], spec: BenchModelSpec, overrides: dict[str, Any], prompt_info: dict[str, Any],
            build: dict[str, Any], env: dict[str, Any], rows: list[ConfigRow], total: int, t0: float) -> BenchModelResult:
    """The result file's content with the configurations measured so far."""
    import torch

    cuda = spec.device == "cuda"
    notes = [
        ("decode steps: each side's step captured once per configuration and replayed as a CUDA graph (standard "
         "and latency_specialized alike); before timing, one replay's tokens were checked equal to an eager step's "
         "from the same state") if cuda else "decode steps: eager (no CUDA graphs on the CPU), the same static step",
        "mixed steps: eager on both sides; one sequence prefills the last chunk of its prompt while the others "
        "decode, in one forward (at batch 1 it is a plain prefill chunk)",
        "contexts: one standard-path prefill of the shipped prose for all configurations; both sides start from "
        "copies of the same state",
        "timing: kernels.timing.time_pair, sides interleaved A B / B A after warm-up"
        + (", L2 flushed and the device idle before every step (cold L2: a serving engine's back-to-back steps "
           "keep part of the weights in L2)" if cuda else ", this thread's CPU clock, torch on one thread"),
        "speedup: median standard / median latency_specialized, 99% percentile-bootstrap interval",
        "speculative steps (" + ("the forward replayed as a CUDA graph (a side that does not capture: both eager, "
                                 "eager_reason says why), verification and rollback eager" if cuda else "eager")
        + f"): each request runs its last token and {spec.draft_tokens} drafts in one forward "
        f"(the MoE routing sees B x {spec.draft_tokens + 1} rows), dspark_verify reads the logits in "
        f"{SPEC_LOGITS_DTYPE}, and each request's caches roll back to the kept tokens; the first "
        f"{spec.acceptance_length - 1} drafts are the request's greedy tokens (a synthetic acceptance length of "
        f"{spec.acceptance_length}), so tokens/s = B x {spec.acceptance_length} / step time",
    ]
    if overrides:
        notes.append(f"config override: max_position_embeddings {overrides['max_position_embeddings']} (K3-mini declares "
                     "4096; its MLA is NoPE and KDA has no positions, so the limit changes no computation)")
    return BenchModelResult(
        complete=len(rows) == total, configurations_planned=total,
        command=spec.command(), spec=spec, config_overrides=overrides, worktree=args["worktree"],
        worktree_commit=args.get("worktree_commit"),
        settings={"graph_warmup_steps": GRAPH_WARMUP, "decode_warmup_steps": DECODE_WARMUP,
                  "mixed_warmup_steps": MIXED_WARMUP, "timer": "cuda_event" if cuda else "cpu_thread_time",
                  "flush_l2": cuda, "torch_threads": torch.get_num_threads(), "top_ops": TOP_OPS,
                  "statistic": "median", "interval": "bootstrap percentile, 99%"},
        prompts=prompt_info, build=build, notes=notes, environment=env, rows=list(rows),
        duration_s=time.perf_counter() - t0)


def main(argv: list[str]) -> int:
    """Child entry: ``python -m workbench.bench_model '<json args>'`` (see :func:`run_bench_model`).

    A refused measurement (:class:`BenchModelError`) is printed as one ``@@bench-model-error`` line and
    exits 3; anything else raises (the traceback lands in the ``.log`` file and the error's tail).
    """
    args = json.loads(argv[0])
    sys.path.insert(0, args["worktree"])
    try:
        _write(Path(args["out"]), _measure(args))
    except BenchModelError as exc:
        print(ERROR_PREFIX + str(exc), flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
