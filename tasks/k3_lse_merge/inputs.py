"""Input generators for the LSE-merge task, one per ``case`` in task.toml.

Every draw is deterministic for a seed (a private ``torch.Generator``, never the global RNG) and lives
on the CPU; the harness moves tensors to the device.

Realistic draws mimic a split-KV decode step: chunk r of row b, head h attended to ``P_r`` keys (full
pages of 256 tokens, the last one partly filled), so its LSE is ``log P_r`` plus the row's score level
(scaled scores of a few units: U(-2, 10)) plus a per-chunk spread N(0, 1.5^2); its partial output is a
softmax-weighted mean of RMS-normalised latents, N(0, s^2) per element with s in [0.05, 1] (sharp
attention near 1, broad attention small). Edge cases mark empty chunks the ways real backends do
(-inf, FA2's +inf, NaN) with partial outputs of 0, NaN or inf, and shift LSEs far beyond exp's range.

Source: tasks/k3_lse_merge/task.toml (workloads and their ``case``); shared/reference/kernel_targets.md
§4.1 (FA2 +inf / FA3 -inf for empty rows), §4.3 (shapes, fp32 LSE), §4.4 (edge cases).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

PAGE_TOKENS = 256
"""Tokens per chunk in realistic draws (K3-mini's MLA page; k3_model.decode.DEFAULT_PAGE_TOKENS)."""
LARGE_LSE = (80.0, 2.0e4)
"""Range of |row offset| in ``large_lse``: exp(80) overflows nothing in fp32 but exp(89) does, and
exp(-104) underflows to 0, so a merge without max subtraction gives inf/inf or 0/0."""

LARGE_OUTS_LOG2 = (12, 100)
"""Range (integers, uniform) of k in the ``large_outputs`` overlay's factor 2^k on partial outputs: from 4096
(past any "a few units" clamp) to 2^100 (~1.3e30; times a draw's |o| <= ~6 stays far below fp32's 3.4e38)."""

_Draw = tuple[torch.Tensor, torch.Tensor]


def _u(gen: torch.Generator, shape: tuple[int, ...], lo: float, hi: float) -> torch.Tensor:
    return torch.rand(shape, generator=gen) * (hi - lo) + lo


def _realistic(N: int, B: int, H: int, D: int, gen: torch.Generator) -> _Draw:
    """A split-KV decode step: (outs (N, B, H, D), lses (N, B, H)), all chunks live."""
    tokens = torch.full((N, B, 1), float(PAGE_TOKENS))
    tokens[-1] = torch.randint(1, PAGE_TOKENS + 1, (B, 1), generator=gen).float()  # the last page is partial
    level = _u(gen, (1, B, H), -2.0, 10.0)
    lses = torch.log(tokens) + level + 1.5 * torch.randn((N, B, H), generator=gen)
    scale = torch.exp(_u(gen, (N, B, H, 1), math.log(0.05), 0.0))
    outs = torch.randn((N, B, H, D), generator=gen) * scale
    return outs, lses


def _empty_fill(mask: torch.Tensor, outs: torch.Tensor, lses: torch.Tensor, marker: float,
                gen: torch.Generator) -> None:
    """Mark the (N, B, H) positions ``mask`` empty: LSE ``marker``; partial outputs 0 (FA), NaN or +-inf
    (a backend that divides 0 by 0), one of the three per empty (chunk, row, head)."""
    lses[mask] = marker
    kind = torch.randint(0, 3, mask.shape, generator=gen)
    fills = (0.0, float("nan"), float("inf"))
    for k, v in enumerate(fills):
        sel = (mask & (kind == k)).unsqueeze(-1).expand_as(outs)
        outs[sel] = v


def _empty_mask(N: int, B: int, H: int, gen: torch.Generator) -> torch.Tensor:
    """(N, B, H) bool: per (row, head) half the time 0, 1, N - 1 or N empty chunks (the edges, certain in
    every run), half the time a count uniform in [0, N] (session 14's red team: a merge wrong only with 2 to
    N - 2 empty chunks was accepted while the counts came from the menu alone), at random positions."""
    menu = torch.tensor([0, 1, max(N - 1, 0), N])[torch.randint(0, 4, (B, H), generator=gen)]
    uniform = torch.randint(0, N + 1, (B, H), generator=gen)
    counts = torch.where(torch.rand((B, H), generator=gen) < 0.5, menu, uniform)
    order = torch.rand((N, B, H), generator=gen).argsort(dim=0).argsort(dim=0)  # a random rank per chunk
    return order < counts.unsqueeze(0)


def _empty_chunks(N: int, B: int, H: int, D: int, gen: torch.Generator) -> _Draw:
    """0, 1, N - 1 or N chunks empty per (row, head), marked -inf (FA3, FlashMLA), outputs 0/NaN/inf."""
    outs, lses = _realistic(N, B, H, D, gen)
    _empty_fill(_empty_mask(N, B, H, gen), outs, lses, float("-inf"), gen)
    return outs, lses


def _all_empty(N: int, B: int, H: int, D: int, gen: torch.Generator) -> _Draw:
    """Every chunk of about half the rows empty (-inf, outputs 0/NaN/inf); row 0 always, the rest live."""
    outs, lses = _realistic(N, B, H, D, gen)
    rows = torch.rand((B,), generator=gen) < 0.5
    rows[0] = True
    mask = rows.view(1, B, 1).expand(N, B, H).clone()
    _empty_fill(mask, outs, lses, float("-inf"), gen)
    return outs, lses


def _plus_inf_lse(N: int, B: int, H: int, D: int, gen: torch.Generator) -> _Draw:
    """Empty chunks marked +inf (FlashAttention-2 for empty KV: FA PR #978), outputs 0/NaN/inf."""
    outs, lses = _realistic(N, B, H, D, gen)
    _empty_fill(_empty_mask(N, B, H, gen), outs, lses, float("inf"), gen)
    return outs, lses


def _nan_lse(N: int, B: int, H: int, D: int, gen: torch.Generator) -> _Draw:
    """Empty chunks marked NaN (a 0/0 in a backend's LSE), outputs 0/NaN/inf."""
    outs, lses = _realistic(N, B, H, D, gen)
    _empty_fill(_empty_mask(N, B, H, gen), outs, lses, float("nan"), gen)
    return outs, lses


def _mixed_markers(N: int, B: int, H: int, D: int, gen: torch.Generator) -> _Draw:
    """Empty chunks marked -inf, +inf or NaN at random (backends mixed across DCP ranks)."""
    outs, lses = _realistic(N, B, H, D, gen)
    mask = _empty_mask(N, B, H, gen)
    which = torch.randint(0, 3, (N, B, H), generator=gen)
    for k, marker in enumerate((float("-inf"), float("inf"), float("nan"))):
        _empty_fill(mask & (which == k), outs, lses, marker, gen)
    return outs, lses


def _large_lse(N: int, B: int, H: int, D: int, gen: torch.Generator) -> _Draw:
    """Each row's LSEs shifted by +-U(80, 2e4) (large score magnitudes): exp without the max overflows
    (positive) or underflows to 0 (negative)."""
    outs, lses = _realistic(N, B, H, D, gen)
    mag = torch.exp(_u(gen, (1, B, H), math.log(LARGE_LSE[0]), math.log(LARGE_LSE[1])))
    sign = torch.where(torch.rand((1, B, H), generator=gen) < 0.5, -1.0, 1.0)
    return outs, lses + sign * mag


def _dominant_chunk(N: int, B: int, H: int, D: int, gen: torch.Generator) -> _Draw:
    """One chunk per (row, head) above the others by 30-200: their weights are tiny or exactly 0 in fp32
    (live chunks of weight 0, finite outputs)."""
    outs, lses = _realistic(N, B, H, D, gen)
    top = torch.randint(0, N, (1, B, H), generator=gen)
    boost = _u(gen, (1, B, H), 30.0, 200.0)
    lses = lses + torch.where(torch.arange(N).view(N, 1, 1) == top, boost, torch.zeros(()))
    return outs, lses


def mark_empty(inputs: dict[str, torch.Tensor], axes: Mapping[str, int], seed: int) -> dict[str, torch.Tensor]:
    """The ``empty_markers`` overlay (task.toml ``[domain.overlays.empty_markers]``): mark chunks empty on top
    of any regime's draw, in place: per (row, head) 0, 1, N - 1 or N chunks at random positions get an LSE
    of -inf, +inf or NaN (at random: backends mixed across DCP ranks) and partial outputs of 0, NaN or inf;
    the live chunks keep the regime's values, so empty chunks meet large and dominant LSEs (session 14's red
    team: a kernel skipping the max subtraction whenever a chunk is empty was accepted while the marker
    regimes drew only realistic LSEs).

    Args:
        inputs: ``outs`` (N, B, H, D) float32 and ``lses`` (N, B, H) float32.
        axes: the workload's axes N, B, H, D.
        seed: RNG seed of the overlay.

    Returns:
        ``inputs``, changed in place.
    """
    gen = torch.Generator().manual_seed(int(seed))
    outs, lses = inputs["outs"], inputs["lses"]
    N, B, H = lses.shape
    mask = _empty_mask(N, B, H, gen)
    which = torch.randint(0, 3, (N, B, H), generator=gen)
    for k, marker in enumerate((float("-inf"), float("inf"), float("nan"))):
        _empty_fill(mask & (which == k), outs, lses, marker, gen)
    return inputs


def scale_outs(inputs: dict[str, torch.Tensor], axes: Mapping[str, int], seed: int) -> dict[str, torch.Tensor]:
    """The ``large_outputs`` overlay (task.toml ``[domain.overlays.large_outputs]``): multiply each (chunk, row,
    head)'s partial output by its own 2^k, k uniform in :data:`LARGE_OUTS_LOG2`, in place (exact in fp32; 0,
    NaN and inf markers stay what they are). Live partial outputs may be any finite fp32 (task.toml
    ``[domain.inputs.outs]``); every regime draws them at a few units, so a kernel that clamped the merged
    row to +-4096 was accepted (session 27's red team).

    Args:
        inputs: ``outs`` (N, B, H, D) float32 and ``lses`` (N, B, H) float32.
        axes: the workload's axes N, B, H, D.
        seed: RNG seed of the overlay.

    Returns:
        ``inputs``, ``outs`` changed in place.
    """
    gen = torch.Generator().manual_seed(int(seed))
    outs = inputs["outs"]
    lo, hi = LARGE_OUTS_LOG2
    k = torch.randint(lo, hi + 1, (*outs.shape[:3], 1), generator=gen).float()
    outs.mul_(torch.exp2(k))
    return inputs


CASES: dict[str, Callable[[int, int, int, int, torch.Generator], _Draw]] = {
    "realistic": _realistic,
    "empty_chunks": _empty_chunks,
    "all_empty": _all_empty,
    "plus_inf_lse": _plus_inf_lse,
    "nan_lse": _nan_lse,
    "mixed_markers": _mixed_markers,
    "large_lse": _large_lse,
    "dominant_chunk": _dominant_chunk,
}
"""Case name -> generator ``(N, B, H, D, gen) -> (outs, lses)``."""


def make_inputs(axes: Mapping[str, int], seed: int, case: str = "realistic") -> dict[str, torch.Tensor]:
    """Draw the op's inputs for one workload.

    Args:
        axes: the workload's axes N (chunks), B (rows), H (heads), D (value width).
        seed: RNG seed; equal seeds give equal tensors.
        case: one of :data:`CASES`.

    Returns:
        ``outs`` (N, B, H, D) float32 and ``lses`` (N, B, H) float32, contiguous CPU tensors.

    Raises:
        ValueError: unknown case (the message lists the known ones) or an axis below 1.

    Source: task.toml workloads; kernel_targets.md §4.3 (dtypes), §4.4 (edge cases).
    """
    if case not in CASES:
        raise ValueError(f"Task 'k3_lse_merge' (tasks/k3_lse_merge/inputs.py): unknown input case {case!r}; "
                         f"known cases: {', '.join(CASES)}. Fix the workload's case in task.toml.")
    N, B, H, D = (int(axes[a]) for a in ("N", "B", "H", "D"))
    if min(N, B, H, D) < 1:
        raise ValueError(f"k3_lse_merge inputs: axes N, B, H, D must be >= 1; got N={N}, B={B}, H={H}, D={D}.")
    gen = torch.Generator().manual_seed(int(seed))
    outs, lses = CASES[case](N, B, H, D, gen)
    return {"outs": outs.float().contiguous(), "lses": lses.float().contiguous()}


def permute_chunks(inputs: Mapping[str, torch.Tensor], axes: Mapping[str, int], params: Mapping[str, object],
                   seed: int) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """The same chunks in another order (the merge is a sum over chunks: order-free up to rounding).

    Returns:
        ``(inputs with outs and lses permuted along N, {"perm": the permutation as a list})``.
    """
    N = int(axes["N"])
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(int(seed)))
    return ({"outs": inputs["outs"][perm].contiguous(), "lses": inputs["lses"][perm].contiguous()},
            {"perm": perm.tolist()})
