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

Source: issue 6 ("a standalone decode loop ... KV cache for MLA, recurrent state for KDA");
DESIGN.md "K3 ops and the decode backend".
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch

from k3_model.dispatch import forward_context, record_trace
from k3_model.layers import check_finite
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
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    argmax: torch.Tensor
    margin: torch.Tensor
    steps: list[dict[str, Any]]
    cache: K3Cache

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
             max_tokens: int | None = None) -> GenerationResult:
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
            last = _step(model, nxt.unsqueeze(1), cache, phase="decode", decode_backend=decode_backend, steps=steps)[:, -1]
    stack = lambda xs: torch.stack(xs, 1).cpu()  # noqa: E731
    return GenerationResult(stack(toks), stack(lps).float(), stack(amax), stack(margins).float(), steps, cache)
