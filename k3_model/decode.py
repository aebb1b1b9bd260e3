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
    with record_trace() as trace, forward_context(decode_backend=decode_backend, phase=phase):
        logits = model.forward(tokens, cache)
    impls = Counter(f"{d.op}:{d.implementation}" for d in trace.decisions)
    steps.append({"index": len(steps), "phase": phase, "tokens": int(tokens.shape[1]), "implementations": dict(impls)})
    return logits


def generate(model: K3Model, prompts: torch.Tensor, max_new_tokens: int, *, decode_backend: str = "standard",
             temperature: float = 0.0, seed: int = 0, forced: torch.Tensor | None = None,
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK, page_tokens: int = DEFAULT_PAGE_TOKENS,
             max_tokens: int | None = None, record_routing: bool = False) -> GenerationResult:
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
        choice = logp.argmax(-1)
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
        with record_trace() as trace, forward_context(decode_backend=self.decode_backend, phase="decode"):
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

