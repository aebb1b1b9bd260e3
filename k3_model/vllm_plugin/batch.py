"""Classify one vLLM forward step as ``decode``, ``spec_verify``, ``prefill`` or ``mixed`` from per-request
query lengths.

vLLM's CPU attention metadata cannot be asked directly: ``CPUAttentionMetadata.num_decode_tokens`` is
always 0 (the CPU builder never sets it), and a speculative verification step feeds every request
1 + D tokens (D draft tokens), so "query length 1" alone would call it prefill. The rule here:

* a request is a **decode** request when it already has context (``context_len > 0``) and either its
  query length is 1, or it is a speculative row (the scheduler gave it drafts; its query length is then
  at most 1 + D);
* the step is ``decode`` when every request is a decode request of query length 1, ``spec_verify``
  when every request is a decode request and one of them verifies drafts (query length above 1: the
  dispatcher's scopes count its requests and 1 + D query tokens, issue 21), ``prefill`` when none is a
  decode request, ``mixed`` otherwise.

A prompt of one token (no context) is prefill; a chunked-prefill continuation whose chunk happens to be
1 + D tokens long is prefill too when the scheduler did not mark it as speculative, which is why the
speculative rows are taken from vLLM's state metadata (``spec_sequence_masks_cpu``) when present and
only inferred from the lengths when not.

Source: shared/reference/vllm_cpu.md §4 ("Distinguishing decode from prefill/mixed inside forward");
issue 6 ("classify by per-request query lengths ... speculative verification steps have query length 1 + D").
"""

from __future__ import annotations

from collections.abc import Sequence

PHASES = ("decode", "spec_verify", "prefill", "mixed")


def classify_batch(query_lens: Sequence[int], context_lens: Sequence[int], *, num_spec: int = 0,
                   spec_rows: Sequence[bool] | None = None) -> str:
    """The phase of one step.

    Args:
        query_lens: new tokens per request this step (tokens), in the batch's order.
        context_lens: tokens each request had already computed before this step (tokens).
        num_spec: D, draft tokens per verification step (0 without speculative decoding).
        spec_rows: per request, whether the scheduler verifies drafts for it this step; ``None`` to
            infer it (query length exactly 1 + D with context, when ``num_spec > 0``).

    Returns:
        ``"decode"``, ``"spec_verify"``, ``"prefill"`` or ``"mixed"``.

    Raises:
        ValueError: the sequences differ in length, are empty, or hold a negative length.
    """
    n = len(query_lens)
    if n == 0 or len(context_lens) != n or (spec_rows is not None and len(spec_rows) != n):
        raise ValueError(
            f"classify_batch: need one query length, one context length (and one spec flag) per request; "
            f"got {n} query lengths, {len(context_lens)} context lengths"
            f"{'' if spec_rows is None else f', {len(spec_rows)} spec flags'} (and at least one request)."
        )
    if any(q < 0 for q in query_lens) or any(c < 0 for c in context_lens):
        raise ValueError(f"classify_batch: lengths must be >= 0; got query {list(query_lens)}, "
                         f"context {list(context_lens)}.")
    decode = []
    for i, (q, c) in enumerate(zip(query_lens, context_lens)):
        if spec_rows is not None:
            spec = bool(spec_rows[i]) and 1 <= q <= 1 + num_spec
        else:
            spec = num_spec > 0 and q == 1 + num_spec
        decode.append(c > 0 and (q == 1 or spec))
    if all(decode):
        return "spec_verify" if max(query_lens) > 1 else "decode"
    if not any(decode):
        return "prefill"
    return "mixed"
