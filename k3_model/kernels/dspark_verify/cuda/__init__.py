"""Latency-specialized K3 DSpark draft verification on CUDA: three Triton launches per call.

Every launch spreads the vocabulary of each verified position over many programs (grid
``(B*(D+1), chunks)``, or ``(B, chunks)`` for the race), so even batch 1 fills the GPU; the last
program of a row (or request) merges its siblings' partial results, so no launch waits on another
inside itself. Positions past a request's ``n_b`` are never read.

1. Stats: row max and lowest-id argmax (greedy rows are then done: accept while the draft equals
   it), the softmax sum, and for rows with top-k / top-p a count histogram of log-probability cells
   that brackets both thresholds.
2. Refine (rows with top-k / top-p): the exact mass above each bracket and the exact bf16 values
   inside it (a histogram of at most 64 values, or the values themselves when at most 512 lie
   there) give the k-th largest value (ties kept), the top-p boundary (keep a value iff the mass of
   strictly larger ones is < ``top_p * Z``) and the kept mass; then the accept test
   ``q(d) > 0 and u < p(d) / q(d)``. A bracket that fits neither takes the exact serial path.
3. Race: per request, the first rejected position from the accept flags; a sampled request runs its
   single exponential race ``argmax_t w(t) / E(t)`` there (residual ``max(p - q, 0)``, or p with the
   draft zeroed for one-hot drafts; p if the residual is all zero; p at the bonus position), lowest
   id on ties; the last program writes the row (drafts up to the stop, the token there, -1 after)
   and ``num_accepted_tokens``.

Details, bins and workspace layout: ``_triton_verify``. Triton is imported on the first call only,
so this package imports on machines without it (the dispatcher never selects it there: SCOPE is
CUDA only). Same contract as ``k3_model.ops.dspark_verify.dspark_verify``.

Source: k3_model/ops/dspark_verify.py (contract); kernel_targets.md §2.1-2.5.
"""

from __future__ import annotations

from k3_model.dispatch import OpScope

SCOPE = OpScope(devices=("cuda",), phases=("spec_verify",), tp_sizes=(1,), dtypes=("bfloat16",), requests_min=1, requests_max=64,
                query_len_min=2, query_len_max=9)


def dspark_verify(target_logits, draft_token_ids, num_draft_tokens, draft_probs, temperature, top_k, top_p,
                  uniform_draws, exponential_noise, *, max_draft_tokens, output_token_ids, num_accepted_tokens):
    """See ``k3_model.ops.dspark_verify.dspark_verify`` (shapes, dtypes, semantics).

    Raises:
        ValueError: ``target_logits`` is not bfloat16 (outside the declared scope).
    """
    from ._triton_verify import launch

    launch(target_logits, draft_token_ids, num_draft_tokens, draft_probs, temperature, top_k, top_p,
           uniform_draws, exponential_noise, max_draft_tokens=max_draft_tokens,
           output_token_ids=output_token_ids, num_accepted_tokens=num_accepted_tokens)
