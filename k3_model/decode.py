"""Standalone decode loop for K3 / K3-mini in plain PyTorch (CPU or GPU, no vLLM).

``generate(model, prompts, max_new_tokens)``: chunked prefill of the prompts (each chunk a
``prefill`` batch for the dispatcher), then one ``decode`` step per new token for the whole batch;
greedy (``temperature == 0``) or seeded temperature sampling; or teacher-forced on given tokens
(``forced``), which is how the model-eval guard replays the standard path's tokens through a
candidate: agreement of the argmax with every forced token is the same statement as "greedy
generation produces the same tokens", and the log-probs stay comparable past a benign near-tie.

Every forward runs inside :func:`k3_model.dispatch.forward_context` with the step's phase and the
requested ``decode_backend``, and under a trace recorder, so :attr:`GenerationResult.steps` says which
implementation each op took on each step.

:class:`StaticDecodeStep` is one greedy decode step over fixed storage (a static cache, fixed input
and output buffers, no host synchronisation), the form a CUDA graph captures and replays
(``workbench bench-model``); it runs eagerly on any device.

Source: issue 6 ("a standalone decode loop ... KV cache for MLA, recurrent state for KDA");
DESIGN.md "K3 ops and the decode backend".
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from k3_model.dispatch import Decision, forward_context, record_trace
from k3_model.layers import KDAState, StaticMLACache, check_finite
from k3_model.layers import record_routing as _record_routing
from k3_model.model import K3Cache, K3Model

DEFAULT_PREFILL_CHUNK = 512
"""Prompt tokens per prefill forward (tokens); the KDA state and conv window are handed over between chunks."""
DEFAULT_PAGE_TOKENS = 256
"""MLA cache growth unit (tokens)."""


@dataclasses.dataclass
class GenerationResult:
    """What :func:`generate` returns.

    Attributes:
        tokens: (B, G) int64, the generated (or forced) tokens, G = max_new_tokens.
        logprobs: (B, G) float32, log-probability of ``tokens[:, g]`` under the model at step g (nats).
        argmax: (B, G) int64, the model's own greedy choice at step g.
        margin: (B, G) float32, top-1 minus top-2 logit at step g (nats; a near-tie when small).
        steps: one dict per forward call: ``index``, ``phase`` (prefill/decode), ``tokens`` (per
            sequence), ``implementations`` (``"op:implementation" -> calls``).
        cache: the final cache (prompt + G - 1 tokens processed).
        routing_scores: with ``record_routing``: (B, G - 1, L, E) float32, decode step j's selection
            scores (sigmoid + bias, -inf outside kept groups) of every LatentMoE layer (L of them, in
            order) for each sequence; step j consumes token j and yields the logits of token j + 1.
            Else None.
        routing_ids: with ``record_routing``: (B, G - 1, L, K) int64, the experts each step picked,
            ascending. Else None.
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    argmax: torch.Tensor
    margin: torch.Tensor
    steps: list[dict[str, Any]]
    cache: K3Cache
    routing_scores: torch.Tensor | None = None
    routing_ids: torch.Tensor | None = None

    def implementation_counts(self, phase: str | None = None) -> dict[str, int]:
        """``"op:implementation" -> calls`` summed over steps (of one phase if given)."""
        total: Counter[str] = Counter()
        for s in self.steps:
            if phase is None or s["phase"] == phase:
                total.update(s["implementations"])
        return dict(total)


def _step(model: K3Model, tokens: torch.Tensor, cache: K3Cache, *, phase: str, decode_backend: str,
          steps: list[dict[str, Any]]) -> torch.Tensor:
    requests = int(tokens.shape[0]) if phase == "decode" else None
    with record_trace() as trace, forward_context(decode_backend=decode_backend, phase=phase, requests=requests):
        logits = model.forward(tokens, cache)
    impls = Counter(f"{d.op}:{d.implementation}" for d in trace.decisions)
    steps.append({"index": len(steps), "phase": phase, "tokens": int(tokens.shape[1]), "implementations": dict(impls)})
    return logits


def generate(model: K3Model, prompts: torch.Tensor, max_new_tokens: int, *, decode_backend: str = "standard",
             temperature: float = 0.0, seed: int = 0, forced: torch.Tensor | None = None,
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK, page_tokens: int = DEFAULT_PAGE_TOKENS,
             max_tokens: int | None = None, record_routing: bool = False,
             greedy_logits_dtype: torch.dtype | None = None) -> GenerationResult:
    """Prefill ``prompts`` then generate ``max_new_tokens`` per sequence.

    Args:
        model: the model.
        prompts: (B, T0) int64 token ids, T0 >= 1 (equal lengths: the batch advances together).
        max_new_tokens: G >= 1 tokens to produce per sequence (EOS does not stop the loop).
        decode_backend: ``standard`` or ``latency_specialized`` (told to the dispatcher every step).
        temperature: 0 for greedy; > 0 samples from ``softmax(logits / temperature)``.
        seed: seed of the sampling generator (temperature > 0).
        forced: optional (B, G) int64 tokens to feed instead of the model's choices (teacher forcing).
        prefill_chunk: prompt tokens per prefill forward (1 = token by token).
        page_tokens: MLA cache page (tokens). max_tokens: MLA cache limit (tokens; default
            max_position_embeddings).
        record_routing: keep every decode step's MoE routing (:attr:`GenerationResult.routing_scores`,
            ``routing_ids``; :func:`k3_model.layers.record_routing`).
        greedy_logits_dtype: round the logits to this dtype for the greedy choice (:attr:`GenerationResult.argmax`
            and the tokens of greedy generation; lowest id on ties), as a verification over bf16 logits
            chooses (:func:`generate_speculative`); default the fp32 logits. Log-probs stay fp32.

    Returns:
        A :class:`GenerationResult` (log-probs of the temperature-1 distribution, i.e. of the model).

    Raises:
        ValueError: bad shapes or arguments, or a context longer than the cache limit.
        FloatingPointError: the model produced non-finite logits.
    """
    if prompts.dim() != 2 or prompts.shape[1] < 1:
        raise ValueError(f"generate: prompts must be (B, T0) with T0 >= 1; got {tuple(prompts.shape)}.")
    if max_new_tokens < 1 or prefill_chunk < 1 or temperature < 0:
        raise ValueError(f"generate: need max_new_tokens >= 1, prefill_chunk >= 1, temperature >= 0; got "
                         f"{max_new_tokens}, {prefill_chunk}, {temperature}.")
    B, T0 = prompts.shape
    if forced is not None and tuple(forced.shape) != (B, max_new_tokens):
        raise ValueError(f"generate: forced must be ({B}, {max_new_tokens}); got {tuple(forced.shape)}.")
    dev = model.device
    prompts = prompts.to(dev, torch.int64)
    cache = model.new_cache(B, page_tokens=page_tokens, max_tokens=max_tokens)
    steps: list[dict[str, Any]] = []
    gen = torch.Generator(device=dev).manual_seed(int(seed)) if temperature > 0 else None
    logits = None
    for s in range(0, T0, prefill_chunk):
        logits = _step(model, prompts[:, s:s + prefill_chunk], cache, phase="prefill",
                       decode_backend=decode_backend, steps=steps)
    last = logits[:, -1]
    toks, lps, amax, margins = [], [], [], []
    routed: list[list] = []
    for g in range(max_new_tokens):
        check_finite(f"generate: logits at new token {g}", last)
        logp = torch.log_softmax(last.float(), dim=-1)
        top2 = torch.topk(last.float(), 2, dim=-1).values
        choice = logp.argmax(-1) if greedy_logits_dtype is None else last.to(greedy_logits_dtype).argmax(-1)
        if forced is not None:
            nxt = forced[:, g].to(dev, torch.int64)
        elif temperature > 0:
            nxt = torch.multinomial(torch.softmax(last.float() / temperature, -1), 1, generator=gen).squeeze(1)
        else:
            nxt = choice
        toks.append(nxt)
        lps.append(logp.gather(1, nxt.unsqueeze(1)).squeeze(1))
        amax.append(choice)
        margins.append(top2[:, 0] - top2[:, 1])
        if g + 1 < max_new_tokens:
            with _record_routing() if record_routing else contextlib.nullcontext([]) as log:
                last = _step(model, nxt.unsqueeze(1), cache, phase="decode", decode_backend=decode_backend,
                             steps=steps)[:, -1]
            routed.append(log)
    stack = lambda xs: torch.stack(xs, 1).cpu()  # noqa: E731
    res = GenerationResult(stack(toks), stack(lps).float(), stack(amax), stack(margins).float(), steps, cache)
    if record_routing and routed and routed[0]:
        # (B, G - 1, L, E) and (B, G - 1, L, K): steps along dim 1, layers along dim 2
        res.routing_scores = torch.stack([torch.stack([r.scores for r in log], 1) for log in routed], 1)
        res.routing_ids = torch.stack([torch.stack([r.ids for r in log], 1) for log in routed], 1)
    return res


class SyntheticDrafter:
    """A drafter that reproduces chosen acceptance lengths on greedy requests (the seed's "synthetic AL").

    At each verification step request b, having emitted p tokens, proposes n_b drafts for its tokens p,
    p + 1, ...: the first ``AL_b - 1`` are the reference continuation's tokens there
    (``reference[b, p + i]``), the rest differ from it (``(reference[b, p + i] + 1) % V``; token 0 past the
    reference's end). While a greedy request's tokens equal the reference (its own greedy continuation,
    e.g. from :func:`generate` on the standard path), it accepts exactly ``min(AL_b - 1, n_b)`` drafts a
    step. A sampled request accepts each draft with the target's probability of it (one-hot drafts).

    Args:
        reference: (B, R) int64 token ids, the continuation drafts are taken from.
        acceptance_length: AL >= 1, for every request or one per request.
        vocab_size: V (wrong drafts stay inside the vocabulary).
        draft_counts: n_b per request (ragged drafts), each in [0, D]; default D for every request.

    Raises:
        ValueError: ``reference`` is not 2-D, an acceptance length < 1, a draft count < 0, or a per-request
            list whose length is not B.
    """

    def __init__(self, reference: torch.Tensor, acceptance_length: int | Sequence[int], vocab_size: int, *,
                 draft_counts: Sequence[int] | None = None) -> None:
        B = reference.shape[0] if reference.dim() == 2 else -1
        als = [acceptance_length] * max(B, 0) if isinstance(acceptance_length, int) else list(acceptance_length)
        counts = None if draft_counts is None else list(draft_counts)
        if (reference.dim() != 2 or len(als) != B or min(als, default=1) < 1
                or (counts is not None and (len(counts) != B or min(counts, default=0) < 0))):
            raise ValueError(f"SyntheticDrafter: need a (B, R) reference, acceptance lengths >= 1 and draft counts "
                             f">= 0 (one per request when a list); got shape {tuple(reference.shape)}, acceptance "
                             f"lengths {acceptance_length}, draft counts {draft_counts}.")
        self.reference = reference.to("cpu", torch.int64)
        self.acceptance_lengths, self.draft_counts, self.vocab_size = als, counts, vocab_size

    def propose(self, request: int, emitted: int, num_drafts: int) -> list[int]:
        """The drafts of ``request`` after ``emitted`` tokens, at most ``num_drafts`` (see the class docstring)."""
        R = self.reference.shape[1]
        n = num_drafts if self.draft_counts is None else min(num_drafts, self.draft_counts[request])
        out = []
        for i in range(n):
            j = emitted + i
            ref = int(self.reference[request, j]) if j < R else None
            if ref is None:
                out.append(0)
            elif i < self.acceptance_lengths[request] - 1:
                out.append(ref)
            else:
                out.append((ref + 1) % self.vocab_size)
        return out


@dataclasses.dataclass
class SpeculativeResult:
    """What :func:`generate_speculative` returns.

    Attributes:
        tokens: (B, G) int64, the first G tokens each request emitted.
        accepted: (S, B) int64, drafts each request accepted at each of the S verification steps (0..D;
            -1 once the request has its G tokens and has left the batch).
        emitted: (S, B) int64, tokens each request emitted at each step (accepted + 1; 0 after it left).
        num_drafts: (S, B) int64, drafts each request proposed at each step (n_b; -1 after it left).
        steps: one dict per forward, as :attr:`GenerationResult.steps`; a verification step's
            ``implementations`` include the ``dspark_verify`` call.
        verify_implementations: ``"dspark_verify:implementation" -> calls`` over all steps.
        num_draft_tokens: D.
        verify_reasons: the dispatcher's distinct reasons for the ``dspark_verify`` calls, in order.
    """

    tokens: torch.Tensor
    accepted: torch.Tensor
    emitted: torch.Tensor
    steps: list[dict[str, Any]]
    verify_implementations: dict[str, int]
    num_draft_tokens: int
    num_drafts: torch.Tensor | None = None
    verify_reasons: list[str] = dataclasses.field(default_factory=list)

    def acceptance_length(self) -> torch.Tensor:
        """(B,) float64: mean tokens emitted per verification step of each request (accepted drafts + 1),
        over the steps it took part in."""
        return acceptance_length(self.accepted)


def acceptance_length(accepted: torch.Tensor) -> torch.Tensor:
    """(B,) float64 mean acceptance length (accepted drafts + 1) per request of an (S, B) accepted-count log
    (:attr:`SpeculativeResult.accepted`; -1 = not in that step)."""
    taken = accepted >= 0
    return ((accepted + 1).clamp_min(0).double().sum(0) / taken.sum(0).clamp_min(1)).double()


def split_cache(model: K3Model, cache: K3Cache, *, page_tokens: int, max_tokens: int | None = None) -> list[K3Cache]:
    """One batch-1 cache per sequence of ``cache`` (copies; ``cache`` is not changed), so sequences can
    advance by different numbers of tokens (speculative decoding).

    Raises:
        ValueError: a static cache.
    """
    if cache.static:
        raise ValueError("split_cache: a static cache cannot be split; pass an ordinary one (model.new_cache).")
    B = next(st.recurrent.shape[0] for st in cache.layers if isinstance(st, KDAState))
    out = []
    for b in range(B):
        one = model.new_cache(1, page_tokens=page_tokens, max_tokens=max_tokens)
        for dst, src in zip(one.layers, cache.layers):
            if isinstance(src, KDAState):
                dst.recurrent.copy_(src.recurrent[b:b + 1])
                dst.conv.copy_(src.conv[b:b + 1])
            else:
                latent, k_pe = src.view()
                dst.append(latent[b:b + 1], k_pe[b:b + 1])
        one.length = cache.length
        out.append(one)
    return out


def rewind_cache(cache: K3Cache, length: int, keep: int) -> None:
    """Keep the first ``keep`` tokens of the verification step that started at ``length`` tokens: each MLA
    cache truncated to ``length + keep``, each KDA state restored from its snapshot after token ``keep``
    (:meth:`KDAState.rewind`; the step must have run with :meth:`KDAState.track_positions`).

    Raises:
        ValueError: a KDA state that did not track the step, or ``keep`` beyond the step's tokens.
    """
    for st in cache.layers:
        if isinstance(st, KDAState):
            st.rewind(keep)
        else:
            st.truncate(length + keep)
    cache.length = length + keep


def generate_speculative(model: K3Model, prompts: torch.Tensor, max_new_tokens: int, *, drafter: SyntheticDrafter,
                         num_draft_tokens: int, temperature: torch.Tensor | None = None,
                         top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None, seed: int = 0,
                         decode_backend: str = "standard", verify_backend: str | None = None,
                         logits_dtype: torch.dtype = torch.float32, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                         page_tokens: int = DEFAULT_PAGE_TOKENS, max_tokens: int | None = None) -> SpeculativeResult:
    """Prefill ``prompts``, then speculative decoding: each verification step runs the model on every
    request's last token and its D drafts, verifies them with :func:`k3_model.ops.dspark_verify.dspark_verify`
    and rolls each request's cache back to the tokens it kept.

    Each request has its own cache (requests advance by different numbers of tokens) and leaves the batch
    once it has G tokens, as in a serving engine; one
    :meth:`K3Model.forward_groups` call runs all of them, so the MoE routing sees B x (1 + D) rows, as in
    a serving engine's verification step (phase ``decode``). KDA runs the 1 + D tokens one ``kda_decode``
    step at a time and keeps the state after each (:meth:`KDAState.track_positions`); the rejected
    tokens are then dropped: the MLA cache by length, the KDA state from the kept position.

    A request's drafts may be fewer than D (ragged, ``n_b``; the drafter decides): it runs 1 + n_b tokens
    and the verification reads rows past n_b as padding. Random numbers come from one generator seeded
    with ``seed``: first an Exp(1) vector (B, V) for the sampled requests' first token (the op's
    exponential race over the request's target distribution, :func:`k3_model.ops.dspark_verify.target_probs`),
    then per step ``uniform_draws`` (A, D) and ``exponential_noise`` (A, V) for the A requests still in the
    batch, so two runs whose verifications agree draw the same numbers.

    Args:
        model: the model.
        prompts: (B, T0) int64, T0 >= 1.
        max_new_tokens: G >= 1 tokens to emit per request (the last step's extra tokens are dropped).
        drafter: proposes each request's drafts (:class:`SyntheticDrafter`).
        num_draft_tokens: D in [1, 8] drafts per request per step (7 for K3's DSpark).
        temperature: (B,) float32, 0 = greedy (default: all greedy). top_k: (B,) int32 (default 0, off).
            top_p: (B,) float32 (default 1.0, off).
        seed: seed of the verification's random numbers.
        decode_backend: the backend of the model's forwards (``standard`` or ``latency_specialized``).
        verify_backend: the backend of the ``dspark_verify`` calls (default: ``decode_backend``); the
            model-eval guard runs the model on the standard path and varies only this.
        logits_dtype: dtype the target logits are handed to the verification in (the serving model emits
            bf16 logits; the model computes fp32).
        prefill_chunk, page_tokens, max_tokens: as :func:`generate`.

    Returns:
        A :class:`SpeculativeResult`.

    Raises:
        ValueError: bad shapes or arguments (what, expected, got).
        FloatingPointError: the model produced non-finite logits.

    Source: kernel_targets.md §2 (verification semantics); Leviathan et al. 2023, Algorithm 1 (one target
    forward over the drafts, then rejection sampling); issue 21 item 3 (the synthetic-acceptance mode).
    """
    from k3_model.ops.dspark_verify import dspark_verify

    if prompts.dim() != 2 or prompts.shape[1] < 1 or max_new_tokens < 1:
        raise ValueError(f"generate_speculative: need prompts (B, T0) with T0 >= 1 and max_new_tokens >= 1; got "
                         f"{tuple(prompts.shape)}, {max_new_tokens}.")
    if not 1 <= num_draft_tokens <= 8:
        raise ValueError(f"generate_speculative: num_draft_tokens must lie in [1, 8]; got {num_draft_tokens}.")
    B, T0 = prompts.shape
    D, V, dev = num_draft_tokens, model.text.vocab_size, model.device
    temperature = torch.zeros(B) if temperature is None else temperature
    top_k = torch.zeros(B, dtype=torch.int32) if top_k is None else top_k
    top_p = torch.ones(B) if top_p is None else top_p
    for name, t, dtype in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
                           ("top_p", top_p, torch.float32)):
        if tuple(t.shape) != (B,) or t.dtype != dtype:
            raise ValueError(f"generate_speculative: {name} must be ({B},) {dtype}; got {tuple(t.shape)} {t.dtype}.")
    verify_backend = verify_backend or decode_backend
    prompts = prompts.to(dev, torch.int64)
    cache = model.new_cache(B, page_tokens=page_tokens, max_tokens=max_tokens)
    steps: list[dict[str, Any]] = []
    logits = None
    for s in range(0, T0, prefill_chunk):
        logits = _step(model, prompts[:, s:s + prefill_chunk], cache, phase="prefill", decode_backend=decode_backend,
                       steps=steps)
    check_finite("generate_speculative: logits after the prompt", logits[:, -1])
    caches = split_cache(model, cache, page_tokens=page_tokens, max_tokens=max_tokens)
    del cache
    # the first token comes from the prompt's last logits: the greedy choice the verification makes, or one
    # draw from the request's target distribution (temperature, top-k, top-p) by the op's exponential race
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    last = logits[:, -1].to(logits_dtype).cpu()
    first = last.argmax(-1)
    sampled = temperature > 0
    if bool(sampled.any()):
        from k3_model.ops.dspark_verify import target_probs

        race = target_probs(last, temperature, top_k, top_p) / torch.empty(B, V).exponential_(generator=gen).clamp_min(
            torch.finfo(torch.float32).tiny)
        first = torch.where(sampled, race.argmax(-1), first)
    emitted_tokens: list[list[int]] = [[int(t)] for t in first]
    accepted_log, emitted_log, drafts_log = [], [], []
    verify_impls: Counter[str] = Counter()
    reasons: dict[str, None] = {}
    params = [x.to(dev) for x in (temperature, top_k, top_p)]
    while True:
        active = [b for b in range(B) if len(emitted_tokens[b]) < max_new_tokens]  # a finished request leaves
        if not active:
            break
        A = len(active)
        drafts = [drafter.propose(b, len(emitted_tokens[b]), D) for b in active]
        if any(len(d) > D for d in drafts):
            raise ValueError(f"generate_speculative: the drafter proposed {max(len(d) for d in drafts)} drafts; at "
                             f"most num_draft_tokens = {D}.")
        groups = [(torch.tensor([[emitted_tokens[b][-1], *d]], device=dev), caches[b]) for b, d in zip(active, drafts)]
        lengths = [caches[b].length for b in active]
        for b in active:
            for st in caches[b].layers:
                if isinstance(st, KDAState):
                    st.track_positions()
        idx = torch.tensor(active, device=dev)
        padded = torch.full((A, D), -1, dtype=torch.int32)  # -1 past n_b: padding the op never reads
        for i, d in enumerate(drafts):
            padded[i, :len(d)] = torch.tensor(d, dtype=torch.int32)
        n_b = torch.tensor([len(d) for d in drafts], dtype=torch.int32)
        q = 1 + int(n_b.max())  # the step's query length: 1 + the most drafts of a request
        step_phase = "spec_verify" if q > 1 else "decode"
        with record_trace() as trace:
            with forward_context(decode_backend=decode_backend, phase=step_phase, requests=A, query_len=q):
                out = model.forward_groups(groups)  # request i: (1, 1 + n_i, V)
            target = torch.zeros(A, D + 1, V, dtype=logits_dtype, device=dev)  # rows past n_b: padding
            for i, lg in enumerate(out):
                target[i, :lg.shape[1]] = lg[0].to(logits_dtype)
            check_finite("generate_speculative: verification logits", target)
            u = torch.rand(A, D, generator=gen).to(dev)
            noise = torch.empty(A, V).exponential_(generator=gen).clamp_min(torch.finfo(torch.float32).tiny).to(dev)
            ids = torch.full((A, D + 1), -1, dtype=torch.int32, device=dev)
            n_acc = torch.zeros(A, dtype=torch.int32, device=dev)
            with forward_context(decode_backend=verify_backend, phase="spec_verify", requests=A, query_len=1 + D):
                dspark_verify(target, padded.to(dev), n_b.to(dev), None, *(x[idx].contiguous() for x in params), u,
                              noise, max_draft_tokens=D, output_token_ids=ids, num_accepted_tokens=n_acc)
        impls = Counter(f"{d.op}:{d.implementation}" for d in trace.decisions)
        verify_impls.update({k: v for k, v in impls.items() if k.startswith("dspark_verify:")})
        reasons.update({d.reason: None for d in trace.decisions if d.op == "dspark_verify"})
        steps.append({"index": len(steps), "phase": step_phase, "tokens": int(n_b.sum()) + A, "requests": A,
                      "implementations": dict(impls)})
        n_acc, ids = n_acc.cpu().long(), ids.cpu().long()
        if bool(((n_acc < 0) | (n_acc > n_b)).any()):
            raise ValueError(f"generate_speculative: dspark_verify returned accepted counts {n_acc.tolist()} outside "
                             f"[0, n_b] for draft counts {n_b.tolist()}.")
        row = torch.full((B,), -1, dtype=torch.int64)
        nrow = torch.full((B,), -1, dtype=torch.int64)
        for i, b in enumerate(active):
            a = int(n_acc[i])
            emitted_tokens[b] += [int(t) for t in ids[i, :a + 1]]
            rewind_cache(caches[b], lengths[i], a + 1)
            row[b], nrow[b] = a, int(n_b[i])
        accepted_log.append(row)
        emitted_log.append(torch.where(row >= 0, row + 1, torch.zeros_like(row)))
        drafts_log.append(nrow)
    tokens = torch.tensor([e[:max_new_tokens] for e in emitted_tokens], dtype=torch.int64)
    log = lambda xs: torch.stack(xs) if xs else torch.zeros(0, B, dtype=torch.int64)  # noqa: E731
    return SpeculativeResult(tokens, log(accepted_log), log(emitted_log), steps, dict(verify_impls), D,
                             num_drafts=log(drafts_log), verify_reasons=list(reasons))


class StaticDecodeStep:
    """One greedy decode step of B sequences over fixed storage: the callable a CUDA graph captures.

    Every call reads ``tokens``, runs :meth:`K3Model.forward` over the static cache inside
    ``forward_context(decode_backend=..., phase="decode")``, writes ``logits`` and ``next_tokens`` and
    copies ``next_tokens`` into ``tokens``, so successive calls (or replays of a graph captured from one
    call) decode successive tokens. Nothing in a call synchronises with the host or allocates a tensor
    whose shape depends on data; the caller allocates everything before capture.

    Args:
        model: the model.
        cache: a filled ordinary cache (:meth:`K3Model.new_cache`) of B sequences at context L; copied
            into fixed storage of ``capacity`` slots (the source is not changed).
        first_tokens: (B,) int64, the token each sequence decodes first (its greedy choice after the
            context); checked against the vocabulary here, once, on the host.
        decode_backend: ``standard`` or ``latency_specialized``.
        capacity: MLA slots per sequence (tokens), at least L + the calls to come.

    Attributes:
        tokens: (B, 1) int64 input. logits: (B, V) float32 output. next_tokens: (B,) int64 output.
        cache: the static :class:`K3Cache`.
        last_decisions: the dispatcher's decisions of the last host-side call (for a captured graph: the
            capture's, which every replay repeats). last_trace: the same as ``"op:implementation" -> calls``.

    Raises:
        ValueError: the cache is static already, the token ids or batch do not match, or ``capacity``
            is below the context.

    Source: PyTorch "CUDA Graphs" notes (static inputs and outputs, no sync inside capture).
    """

    def __init__(self, model: K3Model, cache: K3Cache, first_tokens: torch.Tensor, *, decode_backend: str,
                 capacity: int) -> None:
        if cache.static:
            raise ValueError("StaticDecodeStep: pass an ordinary cache (model.new_cache) to copy from; got a static one.")
        B = int(first_tokens.shape[0])
        V = model.text.vocab_size
        if first_tokens.dim() != 1 or int(first_tokens.min()) < 0 or int(first_tokens.max()) >= V:
            raise ValueError(f"StaticDecodeStep: first_tokens must be (B,) ids in [0, {V}); got shape "
                             f"{tuple(first_tokens.shape)}, range [{int(first_tokens.min())}, {int(first_tokens.max())}].")
        if capacity < cache.length:
            raise ValueError(f"StaticDecodeStep: capacity {capacity} is below the context of {cache.length} tokens.")
        self.model, self.decode_backend = model, decode_backend
        self.cache = model.new_static_cache(B, capacity)
        for dst, src in zip(self.cache.layers, cache.layers):
            if isinstance(src, KDAState):
                if src.recurrent.shape[0] != B:
                    raise ValueError(f"StaticDecodeStep: the cache holds {src.recurrent.shape[0]} sequences; "
                                     f"first_tokens has {B}.")
                dst.recurrent.copy_(src.recurrent)
                dst.conv.copy_(src.conv)
            else:
                dst.append(*src.view())
        self.cache.length = cache.length
        dev = model.device
        self.tokens = first_tokens.to(dev, torch.int64).view(B, 1).clone()
        self.logits = torch.zeros(B, V, dtype=torch.float32, device=dev)
        self.next_tokens = torch.zeros(B, dtype=torch.int64, device=dev)
        self.last_decisions: list[Decision] = []

    def __call__(self) -> None:
        """Decode one token per sequence (see the class docstring)."""
        with record_trace() as trace, forward_context(decode_backend=self.decode_backend, phase="decode",
                                                      requests=int(self.tokens.shape[0])):
            logits = self.model.forward(self.tokens, self.cache)
        self.logits.copy_(logits[:, -1])
        self.next_tokens.copy_(self.logits.argmax(dim=-1))
        self.tokens.copy_(self.next_tokens.view(-1, 1))
        self.last_decisions = list(trace.decisions)

    @property
    def last_trace(self) -> dict[str, int]:
        """``"op:implementation" -> calls`` of the last host-side call."""
        return dict(Counter(f"{d.op}:{d.implementation}" for d in self.last_decisions))

    def positions(self) -> list[int]:
        """Tokens stored per sequence in each MLA layer, read from the device (synchronises: not in a step)."""
        return [int(st.position) for st in self.cache.layers if isinstance(st, StaticMLACache)]

    def _state(self) -> list[torch.Tensor]:
        out = [self.tokens]
        for st in self.cache.layers:
            out += [st.recurrent, st.conv] if isinstance(st, KDAState) else [st.position]
        return out

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of the state a step advances: the input tokens, each KDA layer's recurrent and conv
        state, each MLA layer's position (the slots past it are rewritten by the steps that follow)."""
        return [t.clone() for t in self._state()] + [torch.tensor(self.cache.length)]

    def restore(self, snap: list[torch.Tensor]) -> None:
        """Copy a :meth:`snapshot` back into the same storage (addresses unchanged, so a captured graph
        replays from that state)."""
        *tensors, length = snap
        for dst, src in zip(self._state(), tensors):
            dst.copy_(src)
        self.cache.length = int(length)

