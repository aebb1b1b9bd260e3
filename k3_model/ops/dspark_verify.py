"""K3 speculative-decoding draft verification (DSpark drafts): rejection sampling of up to D drafts.

One verify step for a pure-decode batch of B requests. Request b proposed ``n_b <= D`` draft tokens;
the target model scored the ``n_b + 1`` positions (``target_logits[b, :n_b + 1]``). Greedy requests
(``temperature == 0.0``, exactly; never a -1 sentinel) accept while the draft equals the target argmax;
sampled requests accept draft ``d_i`` iff ``q_i(d_i) > 0 and u_i < p_i(d_i) / q_i(d_i)`` and, at the
first rejection, emit a token drawn from the residual ``max(p_i - q_i, 0)``; a request whose drafts
are all accepted emits a bonus token drawn from ``p_{n_b}``.

**The random numbers are inputs**, so a candidate and the reference emit identical tokens:

* ``uniform_draws[b, i]`` in [0, 1): the accept test of draft i (strict ``<``: u = 0 never accepts
  a token of zero probability, the reason vLLM draws float64, kernel_targets.md §2.5).
* ``exponential_noise[b, :]`` > 0: one Exp(1) vector per request. The single token a request samples
  in a step (the recovered token at its first rejection, or else its bonus token) is the exponential
  race ``argmax_t w(t) / E[b, t]`` over the unnormalized weights ``w`` (residual or bonus
  distribution); this is a categorical sample proportional to ``w`` (vLLM v1's
  ``sample_recovered_tokens``; scale-invariant, so ``w`` is never normalized). Exactly one race
  runs per sampled request, so sharing the vector between the recovered and the bonus draw is sound.

Target distribution of a sampled request at one position (fp32): ``z = logits.float() / T``; top-k
(``0 < k < V``) keeps tokens whose logit is >= the k-th largest (ties at the boundary kept); softmax;
top-p (``top_p < 1``) keeps token j iff the mass of tokens with strictly larger probability is
``< top_p`` (the smallest set reaching top_p, ties kept together; vLLM's sort-and-cumsum rule up to
ties); renormalize. Greedy requests ignore top-k, top-p, the draws and the draft probabilities.
Without draft probabilities the drafts are one-hot (vLLM with ngram / greedy-draft EAGLE / MTP
drafts): accept iff ``u < p(d)``; residual = ``p`` with the draft token zeroed. A residual that is
zero everywhere (only reachable when ``p <= q`` at every token) falls back to ``p``.
Ties in every argmax go to the lowest vocabulary id (``torch.argmax``'s rule). Emitted ids are
vocabulary ids, never positions in a reordered candidate list.

Source: shared/reference/kernel_targets.md §2.1 (vLLM v1 ``rejection_sampler.py``), §2.3 (Leviathan
et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Algorithm 1 and Theorem 1),
§2.4 (shapes, dtypes), §2.5 (edge cases); issue 3 (public bug reports).
"""

from __future__ import annotations

import torch

from k3_model import dispatch

OP = "dspark_verify"
PLACEHOLDER_TOKEN_ID = -1
"""Fills the output columns after the last emitted token (vLLM's ``PLACEHOLDER_TOKEN_ID``)."""
SHAPE_DOMAIN = {"D": {"min": 1, "max": 8}, "V": {"min": 2, "max": 163840}, "Q": {"choices": (1, 2)}}
"""The shapes ``tasks/k3_dspark_verify`` judges (its ``[domain.axes]``, kept equal by
tests/k3_model/test_dispatch_shapes.py): a call outside them never runs a latency-specialized kernel
(:func:`k3_model.dispatch.route`). Axes: D max drafts, V vocabulary, Q 2 with draft probabilities, 1 without."""
dispatch.register_op_shapes(OP, SHAPE_DOMAIN)


def has_draft_probs(draft_probs: torch.Tensor | None) -> bool:
    """Whether draft probabilities were passed (``None`` or an empty tensor means one-hot drafts)."""
    return draft_probs is not None and draft_probs.numel() > 0


def shape_axes(target_logits: torch.Tensor, draft_probs: torch.Tensor | None) -> dict[str, int]:
    """The call's shape axes, named as the task's: ``D`` (positions - 1), ``V``, ``Q`` (2: draft probs given)."""
    return {"D": target_logits.shape[1] - 1, "V": target_logits.shape[2], "Q": 2 if has_draft_probs(draft_probs) else 1}


def _check_args(target_logits, draft_token_ids, num_draft_tokens, draft_probs, temperature, top_k, top_p,
                uniform_draws, exponential_noise, max_draft_tokens, output_token_ids, num_accepted_tokens) -> None:
    """Shapes, dtypes and devices (no value checks: they would synchronize a GPU).

    Raises:
        ValueError: a tensor has the wrong shape, dtype or device.
    """
    where = "k3_model.ops.dspark_verify.dspark_verify"
    if target_logits.dim() != 3:
        raise ValueError(f"{where}: target_logits must be (B, D+1, V); got shape {tuple(target_logits.shape)}. "
                         "Pass one row per verified position, bonus position last.")
    B, D1, V = target_logits.shape
    D = D1 - 1
    if D != max_draft_tokens:
        raise ValueError(f"{where}: target_logits has D+1 = {D1} positions but max_draft_tokens = {max_draft_tokens}; "
                         f"expected {max_draft_tokens + 1} positions.")
    if target_logits.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{where}: target_logits must be bfloat16 or float32; got {target_logits.dtype}.")
    want = {
        "draft_token_ids": (draft_token_ids, (B, D), (torch.int32,)),
        "num_draft_tokens": (num_draft_tokens, (B,), (torch.int32,)),
        "temperature": (temperature, (B,), (torch.float32,)),
        "top_k": (top_k, (B,), (torch.int32,)),
        "top_p": (top_p, (B,), (torch.float32,)),
        "uniform_draws": (uniform_draws, (B, D), (torch.float32,)),
        "exponential_noise": (exponential_noise, (B, V), (torch.float32,)),
        "output_token_ids": (output_token_ids, (B, D1), (torch.int32,)),
        "num_accepted_tokens": (num_accepted_tokens, (B,), (torch.int32,)),
    }
    if has_draft_probs(draft_probs):
        want["draft_probs"] = (draft_probs, (B, D, V), (torch.float32,))
    for name, (t, shape, dtypes) in want.items():
        if tuple(t.shape) != shape or t.dtype not in dtypes:
            raise ValueError(f"{where}: {name} must be {shape} {dtypes[0]}; got {tuple(t.shape)} {t.dtype}.")
        if t.device != target_logits.device:
            raise ValueError(f"{where}: {name} is on {t.device} but target_logits is on {target_logits.device}; "
                             "move every tensor to one device.")


def _apply_top_k_top_p_capturable(z: torch.Tensor, logits: torch.Tensor, top_k: torch.Tensor,
                                  top_p: torch.Tensor) -> torch.Tensor:
    """:func:`_apply_top_k_top_p` without host synchronisation (no ``bool()``/``int()`` of device
    values, no data-dependent shapes), so the standard path can be captured into a CUDA graph: the
    k-th largest logit comes from a full descending sort and top-p runs on every row, masked by
    ``top_p < 1`` (vLLM's ``apply_top_k_top_p`` sorts the whole row too). Same results row by row."""
    B, P, V = z.shape
    k = top_k.long()
    k_on = (k > 0) & (k < V)
    sorted_logits = logits.sort(dim=-1, descending=True).values
    kth = sorted_logits.gather(-1, (k.clamp(1, V) - 1).view(B, 1, 1).expand(B, P, 1))
    z = z.masked_fill((logits < kth) & k_on.view(B, 1, 1), float("-inf"))
    probs = z.softmax(-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    above = sorted_p.cumsum(-1) - sorted_p
    first = torch.searchsorted(-sorted_p.contiguous(), -sorted_p.contiguous(), side="left")
    keep_sorted = above.gather(-1, first) < top_p.view(B, 1, 1)
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted) | (top_p >= 1.0).view(B, 1, 1)
    return z.masked_fill(~keep, float("-inf"))


def _apply_top_k_top_p(z: torch.Tensor, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask ``z`` (B, P, V) fp32 with -inf outside each request's top-k / top-p set (per request).

    While a CUDA stream is being captured into a graph, the synchronisation-free variant
    :func:`_apply_top_k_top_p_capturable` runs instead (same masks)."""
    if z.is_cuda and torch.cuda.is_current_stream_capturing():
        return _apply_top_k_top_p_capturable(z, logits, top_k, top_p)
    B, P, V = z.shape
    k = top_k.long()
    k_on = (k > 0) & (k < V)
    if bool(k_on.any()):
        max_k = int(torch.where(k_on, k, torch.ones_like(k)).max())
        kth = logits.topk(max_k, dim=-1).values.gather(-1, (k.clamp(1, max_k) - 1).view(B, 1, 1).expand(B, P, 1))
        drop = (logits < kth) & k_on.view(B, 1, 1)
        z = z.masked_fill(drop, float("-inf"))
    p_on = top_p < 1.0
    if bool(p_on.any()):
        rows = p_on.nonzero().squeeze(1)
        zr = z[rows]  # (R, P, V), top-k already applied
        probs = zr.softmax(-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        above = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens sorted before each one
        # Ties: a token's "strictly larger" mass is the one at the first member of its tie group.
        first = torch.searchsorted(-sorted_p.contiguous(), -sorted_p.contiguous(), side="left")
        above = above.gather(-1, first)
        keep_sorted = above < top_p[rows].view(-1, 1, 1)
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        z[rows] = zr.masked_fill(~keep, float("-inf"))
    return z


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The target distribution of each request at one position, by the contract's rule (module docstring):
    ``logits / T``, top-k on the logits (ties kept), softmax, top-p, renormalised.

    Args:
        logits: (B, V) bfloat16 or float32 (computed on in fp32). temperature: (B,) float32, > 0 for the
            rows that are used (a greedy row, T = 0, gets T = 1 here: use its argmax instead).
            top_k: (B,) int32. top_p: (B,) float32.

    Returns:
        (B, V) float32 probabilities.

    Source: kernel_targets.md §2.1 (vLLM v1 sampling order: temperature, top-k, top-p).
    """
    x = logits.float().unsqueeze(1)
    temp = torch.where(temperature == 0.0, torch.ones_like(temperature), temperature)
    return _apply_top_k_top_p(x / temp.view(-1, 1, 1), x, top_k, top_p).softmax(-1).squeeze(1)


def dspark_verify_standard(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform_draws: torch.Tensor,
    exponential_noise: torch.Tensor,
    *,
    max_draft_tokens: int,
    output_token_ids: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
) -> None:
    """The standard path, structured like vLLM v1: every position of every request is scored
    (argmax, then temperature/top-k/top-p probabilities, recovered and bonus candidates), then the
    first rejection picks what is emitted. See :func:`dspark_verify` for the contract."""
    B, D1, V = target_logits.shape
    D = D1 - 1
    dev = target_logits.device
    logits = target_logits.float()
    n = num_draft_tokens.long()
    cols = torch.arange(D1, device=dev)
    valid = cols[:D].view(1, D) < n.view(B, 1)
    drafts = torch.where(valid, draft_token_ids.long(), torch.zeros_like(draft_token_ids, dtype=torch.long))
    greedy = temperature == 0.0

    target_argmax = logits.argmax(-1)  # (B, D+1), first maximum
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)  # greedy rows: 1, never / 0
    z = _apply_top_k_top_p(logits / temp.view(B, 1, 1), logits, top_k, top_p)
    probs = z.softmax(-1)  # (B, D+1, V)

    p_d = probs[:, :D].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    if has_draft_probs(draft_probs):
        q_d = draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        residual = (probs[:, :D] - draft_probs).clamp_min(0.0)
    else:
        q_d = torch.ones_like(p_d)
        residual = probs[:, :D].scatter(-1, drafts.unsqueeze(-1), 0.0)
    empty = residual.sum(-1, keepdim=True) == 0
    residual = torch.where(empty, probs[:, :D], residual)
    accept_sampled = (q_d > 0) & (uniform_draws < p_d / q_d)
    accept_greedy = drafts == target_argmax[:, :D]
    accept = torch.where(greedy.view(B, 1), accept_greedy, accept_sampled) & valid
    accepted = accept.long().cumprod(1).sum(1)  # leading accepts, in [0, n_b]

    noise = exponential_noise.view(B, 1, V)
    recovered = (residual / noise).argmax(-1)  # (B, D)
    bonus = (probs / noise).argmax(-1)  # (B, D+1)
    stop = accepted.view(B, 1)
    sampled_tok = torch.where(
        stop < n.view(B, 1),
        recovered.gather(1, stop.clamp_max(max(D - 1, 0))) if D > 0 else bonus.gather(1, stop),
        bonus.gather(1, stop),
    )
    stop_tok = torch.where(greedy.view(B, 1), target_argmax.gather(1, stop), sampled_tok)

    out = torch.full((B, D1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=dev)
    out[:, :D] = torch.where(cols[:D].view(1, D) < stop, drafts, out[:, :D])
    out.scatter_(1, stop, stop_tok)
    output_token_ids.copy_(out)
    num_accepted_tokens.copy_(accepted)


def dspark_verify(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform_draws: torch.Tensor,
    exponential_noise: torch.Tensor,
    *,
    max_draft_tokens: int,
    output_token_ids: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
) -> None:
    """Verify up to D draft tokens per request by rejection sampling; write the emitted tokens.

    Row b of ``output_token_ids`` holds ``num_accepted_tokens[b]`` accepted drafts, then one target
    token (the recovered token at the first rejection, or the bonus token when all ``n_b`` drafts are
    accepted), then -1. A request with ``n_b = 0`` emits only its bonus token, at column 0.
    Semantics, tie rules and the use of the random inputs: module docstring.

    Args:
        target_logits: (B, D+1, V) bfloat16 (the target lm_head's output dtype; float32 also
            accepted), contiguous; row ``[b, i]`` scores the token after draft i-1, row
            ``[b, n_b]`` is the bonus position; rows past ``n_b`` are padding and never read.
        draft_token_ids: (B, D) int32 vocabulary ids in [0, V); entries at ``i >= n_b`` are padding
            (-1 by convention) and never read.
        num_draft_tokens: (B,) int32, ``n_b`` in [0, D] (ragged; 0 for a request without drafts).
        draft_probs: (B, D, V) float32 draft distributions ``q_i`` (each row sums to 1), or ``None``
            or an empty tensor (the task harness passes shape (0, D, V)): one-hot drafts.
        temperature: (B,) float32, >= 0; exactly 0.0 means greedy (never divided by).
        top_k: (B,) int32; ``0 < k < V`` keeps the k largest logits (ties kept), else no top-k.
        top_p: (B,) float32 in (0, 1]; 1.0 means no top-p.
        uniform_draws: (B, D) float32 in [0, 1): the accept test of draft i of request b.
        exponential_noise: (B, V) float32, positive and finite: Exp(1) draws of the one exponential
            race a sampled request runs (recovered or bonus token).
        max_draft_tokens: D (drafts per request at most; 7 for K3's DSpark).
        output_token_ids: out (B, D+1) int32, vocabulary ids padded with -1.
        num_accepted_tokens: out (B,) int32 in [0, n_b] (bonus not counted; vLLM's acceptance length
            is this + 1).

    Raises:
        ValueError: shapes, dtypes or devices are inconsistent. Values (ids in range, temperature
            >= 0, ``n_b`` <= D, positive noise) are not checked here (that would synchronize a GPU);
            out-of-range values give undefined results and the task's reference rejects them.
        k3_model.dispatch.DispatchError: a merged latency-specialized kernel is malformed.

    Source: kernel_targets.md §2.1-2.5; Leviathan et al. 2023 (ICML), Algorithm 1.
    """
    _check_args(target_logits, draft_token_ids, num_draft_tokens, draft_probs, temperature, top_k, top_p,
                uniform_draws, exponential_noise, max_draft_tokens, output_token_ids, num_accepted_tokens)
    fn = dispatch.select(
        OP,
        "dspark_verify",
        dspark_verify_standard,
        rows=target_logits.shape[0],
        device=target_logits.device.type,
        dtype=str(target_logits.dtype).removeprefix("torch."),
        shapes=shape_axes(target_logits, draft_probs),
    )
    fn(
        target_logits,
        draft_token_ids,
        num_draft_tokens,
        draft_probs if has_draft_probs(draft_probs) else None,
        temperature,
        top_k,
        top_p,
        uniform_draws,
        exponential_noise,
        max_draft_tokens=max_draft_tokens,
        output_token_ids=output_token_ids,
        num_accepted_tokens=num_accepted_tokens,
    )
