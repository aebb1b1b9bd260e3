"""Input generators for the TP all-reduce + residual + RMSNorm task, one per ``case`` in task.toml.

``x`` comes back stacked ``[W, T, D]`` (rank r's partial is ``x[r]``: it is ``per_rank`` in task.toml);
``residual`` ``[T, D]`` and ``weight`` ``[D]`` are the same on every rank. Every draw is deterministic
for a seed (a private ``torch.Generator``) and lives on the CPU.

Partials and residuals lie on an **exact grid**: bf16 values whose magnitudes fall in one window
``[2^lo, 2^(lo+12))`` (or are zero). The smallest ulp there is ``2^(lo-7)`` and a sum of up to 8
partials plus the residual stays below ``2^(lo+16)``, so every fp32 partial sum needs at most 23
significant bits: fp32 addition is exact in any order, the reference is unique, and a kernel's R'
may differ from it only by the final rounding. bf16 accumulation is not exact there. One case, ``order_sensitive``, leaves the grid on purpose:
there the fp32 sum depends on the order of the partials, which every rank must share.

Source: kernel_targets.md §1.2-1.5 (math, edge cases, tolerances); sglang issue 34603 (bf16
accumulation), §1.4 (-0.0 Lamport sentinel, NaN/inf must propagate).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

WINDOW_BITS = 12
"""Width of the exponent window of the exact grid (binary orders of magnitude)."""


def on_grid(t: torch.Tensor, lo: int) -> torch.Tensor:
    """Round ``t`` to bf16 and move it onto the exact grid: magnitudes in ``[2^lo, 2^(lo+12))``.

    Values below ``2^lo`` in magnitude become 0, values at or above the top are clamped just below it.

    Args:
        t: float tensor (any shape).
        lo: log2 of the smallest non-zero magnitude.

    Returns:
        bfloat16 tensor of ``t``'s shape.
    """
    top = torch.tensor(2.0 ** (lo + WINDOW_BITS), dtype=torch.bfloat16)
    below_top = torch.nextafter(top, torch.tensor(0.0, dtype=torch.bfloat16)).float()
    b = t.to(torch.bfloat16).float()
    mag = b.abs().clamp(max=float(below_top))
    mag = torch.where(mag < 2.0 ** lo, torch.zeros_like(mag), mag)
    return (torch.sign(b) * mag).to(torch.bfloat16)


def _weight(D: int, gen: torch.Generator) -> torch.Tensor:
    return (1.0 + 0.1 * torch.randn(D, generator=gen)).to(torch.bfloat16)


def _realistic(W: int, T: int, D: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Partials of unit scale (o_proj shards), a residual stream ~4x larger, weight near 1."""
    x = on_grid(torch.randn(W, T, D, generator=gen), -8)
    residual = on_grid(4.0 * torch.randn(T, D, generator=gen), -8)
    return {"x": x, "residual": residual, "weight": _weight(D, gen)}


def _accumulation_trap(W: int, T: int, D: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``x_0 = +-2^k`` and ``x_r = x_0 * 2^-8`` for r >= 1, residual 0.

    In fp32 the sum is ``x_0 (1 + (W-1) 2^-8)``, which rounds to ``x_0`` plus 2 ulp (W = 4) or 4 ulp
    (W = 8); summed in bf16 every step adds half an ulp, which rounds to even, so it stays ``x_0``.
    """
    if W < 3:
        raise ValueError(f"inputs case 'accumulation_trap' needs W >= 3 (one bf16 add rounds once); got W={W}.")
    k = torch.randint(-2, 3, (T, D), generator=gen).float()
    sign = torch.where(torch.rand(T, D, generator=gen) < 0.5, -1.0, 1.0)
    x0 = sign * torch.exp2(k)
    x = torch.stack([x0] + [x0 * 2.0 ** -8] * (W - 1)).to(torch.bfloat16)
    return {"x": x, "residual": torch.zeros(T, D, dtype=torch.bfloat16), "weight": _weight(D, gen)}


def _negative_zero(W: int, T: int, D: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Realistic draws with a quarter of the partials and residuals set to -0.0 (every rank's -0.0 at
    some elements, so the sum there is -0.0 + -0.0 + ...)."""
    d = _realistic(W, T, D, gen)
    mask = torch.rand(T, D, generator=gen) < 0.25
    d["x"] = torch.where(mask.expand(W, T, D), torch.tensor(-0.0, dtype=torch.bfloat16), d["x"])
    d["residual"] = torch.where(mask, torch.tensor(-0.0, dtype=torch.bfloat16), d["residual"])
    return d


def _nan_inf(W: int, T: int, D: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Realistic draws; the last rank's partial has a NaN in token 0 and +inf in token 1."""
    if T < 2:
        raise ValueError(f"inputs case 'nan_inf' needs T >= 2; got T={T}.")
    d = _realistic(W, T, D, gen)
    d["x"][W - 1, 0, int(torch.randint(0, D, (1,), generator=gen))] = float("nan")
    d["x"][W - 1, 1, int(torch.randint(0, D, (1,), generator=gen))] = float("inf")
    return d


def _large_magnitude(W: int, T: int, D: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Partials and residual up to 2^16 (the grid shifted up): fp16 (max 65504) overflows on the sum."""
    x = on_grid(2.0 ** 13 * torch.randn(W, T, D, generator=gen), 4)
    residual = on_grid(2.0 ** 14 * torch.randn(T, D, generator=gen), 4)
    return {"x": x, "residual": residual, "weight": _weight(D, gen)}


def _zero_rows(W: int, T: int, D: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Realistic draws with every even token's partials and residual all zero (output exactly 0)."""
    d = _realistic(W, T, D, gen)
    d["x"][:, ::2] = 0
    d["residual"][::2] = 0
    return d


def _small_rms(W: int, T: int, D: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Rows whose RMS is far below sqrt(eps): partials and residual on the exact grid at 2^-24..2^-12
    (RMS about 1e-5, mean square about 1e-10 against eps = 1e-5), so where eps is added (inside the
    rsqrt, as the contract says, or to the RMS after the root) changes the output by orders of
    magnitude; every odd token keeps realistic magnitudes."""
    d = _realistic(W, T, D, gen)
    d["x"][:, ::2] = on_grid(2.0 ** -18 * torch.randn(W, (T + 1) // 2, D, generator=gen), -24)
    d["residual"][::2] = on_grid(2.0 ** -16 * torch.randn((T + 1) // 2, D, generator=gen), -24)
    return d


def _order_sensitive(W: int, T: int, D: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Partials off the exact grid: every element's W partials share one sign and have independent
    magnitudes 2^e, e uniform in [-24, 8), so their fp32 sum rounds and its bits depend on the
    summation order (a kernel that sums in a rank-dependent order leaves ranks with different bits);
    residual 0, so R' = bf16(A) and no cancellation widens an order's rounding beyond 1 ulp of R'.
    Float addition commutes, so two partials sum alike in either order: the case needs W >= 3.
    Source: issue 12 ("bits that depend on the rank are invisible on inputs where every fp32
    summation order is exact")."""
    if W < 3:
        raise ValueError(f"inputs case 'order_sensitive' needs W >= 3 (a + b == b + a in floating point); got W={W}.")
    sign = torch.where(torch.rand(T, D, generator=gen) < 0.5, -1.0, 1.0)
    e = torch.randint(-24, 8, (W, T, D), generator=gen).float()
    mant = 1.0 + torch.rand(W, T, D, generator=gen)
    x = (sign * mant * torch.exp2(e)).to(torch.bfloat16)
    return {"x": x, "residual": torch.zeros(T, D, dtype=torch.bfloat16), "weight": _weight(D, gen)}


CASES: Mapping[str, Callable[[int, int, int, torch.Generator], dict[str, torch.Tensor]]] = {
    "realistic": _realistic,
    "accumulation_trap": _accumulation_trap,
    "negative_zero": _negative_zero,
    "nan_inf": _nan_inf,
    "large_magnitude": _large_magnitude,
    "zero_rows": _zero_rows,
    "small_rms": _small_rms,
    "order_sensitive": _order_sensitive,
}


def make_inputs(axes: Mapping[str, int], seed: int, case: str = "realistic") -> dict[str, torch.Tensor]:
    """Inputs of one workload.

    Args:
        axes: ``W`` (ranks), ``T`` (tokens), ``D`` (hidden).
        seed: draw seed.
        case: a key of :data:`CASES`.

    Returns:
        ``x`` bf16 [W, T, D], ``residual`` bf16 [T, D], ``weight`` bf16 [D].

    Raises:
        ValueError: unknown case, or axes a case cannot honour.
    """
    if case not in CASES:
        raise ValueError(f"inputs: unknown case {case!r}; known: {', '.join(CASES)}.")
    gen = torch.Generator().manual_seed(int(seed))
    return CASES[case](int(axes["W"]), int(axes["T"]), int(axes["D"]), gen)


def permute_tokens(inputs: Mapping[str, torch.Tensor], axes: Mapping[str, int], params: Mapping[str, object],
                   seed: int) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """The batch with its tokens permuted on every rank: twin token ``i`` is original token ``perm[i]``.

    ``x`` (stacked ``[W, T, D]``) is permuted along T for every rank alike, ``residual`` ``[T, D]`` by
    rows; ``weight`` ``[D]`` stays. ``perm`` is uniform over the permutations of T tokens other than
    the identity (one is redrawn as a rotation by one).

    Args:
        inputs: as :func:`make_inputs` returns.
        axes: the workload's axes (T >= 2: task.toml ``requires``).
        params: the op's scalar arguments (unused).
        seed: RNG seed of the permutation.

    Returns:
        (twin inputs, ``{"perm": perm}``) with ``perm`` a list of T ints.

    Raises:
        ValueError: T < 2 (a permutation of one token is the identity).

    Source: task.toml [domain.invariances.token_permutation] (issue 19 item 2).
    """
    T = int(inputs["residual"].shape[0])
    if T < 2:
        raise ValueError(f"k3_allreduce_rmsnorm permute_tokens: needs T >= 2 tokens (task.toml requires 'T >= 2'); got T={T}.")
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(int(seed)))
    if bool((perm == torch.arange(T)).all()):
        perm = torch.roll(perm, 1)
    twin = {"x": inputs["x"][:, perm].contiguous(), "residual": inputs["residual"][perm].contiguous(),
            "weight": inputs["weight"].clone()}
    return twin, {"perm": perm.tolist()}
