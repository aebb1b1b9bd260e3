"""Input generators for the small-M GEMM task, one per ``case`` in task.toml.

Every draw is deterministic for a seed (a private ``torch.Generator``, never the global RNG) and lives
on the CPU; the harness moves tensors to the device.

Realistic draws mimic a decode step's attention input projection: x rows are RMS-normalised hidden
states times the norm weight (N(0, 1) per element, a weight 1 + N(0, 0.1^2) per channel), W is drawn as
K3-mini's random checkpoints are (N(0, 0.02^2), initializer_range). Edge cases add a few massive
activation channels, rows of very different scales, and zero padding rows (CUDA-graph padding, the KDA
in_proj's pad).

Source: tasks/k3_small_m_gemm/task.toml (workloads and their ``case``); shared/reference/kernel_targets.md
§6.3 (shapes), §6.4 (edge cases); k3_model/model.py weight_specs (initializer_range 0.02).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

INIT_STD = 0.02
"""Weight scale (K3's initializer_range)."""

_Draw = dict[str, torch.Tensor]


def _u(gen: torch.Generator, shape: tuple[int, ...], lo: float, hi: float) -> torch.Tensor:
    return torch.rand(shape, generator=gen) * (hi - lo) + lo


def _realistic(M: int, N: int, K: int, gen: torch.Generator) -> _Draw:
    """RMS-normalised rows times a norm weight; a random nn.Linear weight."""
    norm_w = 1.0 + 0.1 * torch.randn((1, K), generator=gen)
    x = torch.randn((M, K), generator=gen)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w
    w = INIT_STD * torch.randn((N, K), generator=gen)
    return {"x": x, "weight": w}


def padding_counts(M: int) -> list[int]:
    """How many rows a padded draw zeroes: one, a few, all but one (never all: a step has a real row)."""
    return sorted({c for c in (1, min(3, M - 1), M // 2, M - 1) if 1 <= c <= M - 1}) or [0]


def _pad(d: _Draw, gen: torch.Generator) -> None:
    M = d["x"].shape[0]
    counts = padding_counts(M)
    n = counts[int(torch.randint(0, len(counts), (1,), generator=gen))]
    rows = torch.randperm(M, generator=gen)[:n]
    d["x"][rows] = 0.0


def pad_rows(inputs: dict[str, torch.Tensor], axes: Mapping[str, int], seed: int) -> dict[str, torch.Tensor]:
    """The ``padding_rows`` overlay (task.toml ``[domain.overlays.padding_rows]``): zero some rows of x of any
    regime's draw, in place (one, a few, half or all but one row, at random positions); their output rows
    must be exactly 0.

    Args:
        inputs: the op's inputs (``make_inputs``'s names, shapes and dtypes).
        axes: the workload's axes.
        seed: RNG seed of the overlay.

    Returns:
        ``inputs``, changed in place.
    """
    _pad(inputs, torch.Generator().manual_seed(int(seed)))
    return inputs


def zero_channels(inputs: dict[str, torch.Tensor], axes: Mapping[str, int], seed: int, *,
                  variant: str = "scattered") -> dict[str, torch.Tensor]:
    """The ``zero_channels`` overlay (task.toml ``[domain.overlays.zero_channels]``): exact zeros inside live rows,
    as a norm weight with zeroed channels makes. ``scattered``: 1 to 8 random channels are zeroed in every row;
    ``leading``: every channel but the last is zeroed in half the rows (at random), so a kernel that probes any
    prefix of a row to tell padding meets a live row that passes its probe. A row stays live (one channel at
    least keeps its value): its output is the dot product over the rest, never the padding row's exact 0. In place.

    Source: session 21's red team (a kernel that took a row whose first 4 channels are 0 for padding was
    accepted while the only zeros the draws held were whole padding rows).
    """
    x = inputs["x"]
    M, K = x.shape
    gen = torch.Generator().manual_seed(int(seed))
    if variant == "leading":
        rows = torch.randperm(M, generator=gen)[: max(1, M // 2)]
        x[rows.view(-1, 1), torch.arange(K - 1).view(1, -1)] = 0.0
    else:
        n = min(K - 1, int(torch.randint(1, 9, (1,), generator=gen)))
        x[:, torch.randperm(K, generator=gen)[:n]] = 0.0
    return inputs


def row_view(inputs: dict[str, torch.Tensor], axes: Mapping[str, int], seed: int) -> dict[str, torch.Tensor]:
    """The ``row_view`` overlay (task.toml ``[domain.overlays.row_view]``, ``layout = true``): x becomes a row view
    of a wider buffer, row stride K + 1 to K + 64, starting 0 to 64 features in, as the contract allows (unit
    inner stride, row stride >= K: a slice of a fused activation buffer). The features around x hold large
    values, so a kernel that reads x as packed rows, or past its K features, gets a wrong result. The values of x
    do not change.

    Source: task.toml description (x's layout); session 21's red team (a kernel that re-read x as packed rows
    was accepted while every draw was packed).
    """
    x = inputs["x"]
    M, K = x.shape
    gen = torch.Generator().manual_seed(seed)
    pad = int(torch.randint(1, 65, (1,), generator=gen))
    start = int(torch.randint(0, pad + 1, (1,), generator=gen))
    wide = 1e3 * torch.randn((M, K + pad), generator=gen, dtype=x.dtype)
    wide[:, start:start + K] = x
    return {**inputs, "x": wide[:, start:start + K]}


def _padding_rows(M: int, N: int, K: int, gen: torch.Generator) -> _Draw:
    """A realistic draw with zero padding rows."""
    d = _realistic(M, N, K, gen)
    _pad(d, gen)
    return d


def _outlier_channels(M: int, N: int, K: int, gen: torch.Generator) -> _Draw:
    """A realistic draw whose x has 1-4 channels 50-500x the others (massive activations)."""
    d = _realistic(M, N, K, gen)
    n = min(int(torch.randint(1, 5, (1,), generator=gen)), K)
    ch = torch.randperm(K, generator=gen)[:n]
    d["x"][:, ch] *= _u(gen, (1, n), 50.0, 500.0)
    return d


def _row_scales(M: int, N: int, K: int, gen: torch.Generator) -> _Draw:
    """A realistic draw whose rows are scaled by 10^U(-6, 6) each."""
    d = _realistic(M, N, K, gen)
    d["x"] *= torch.pow(10.0, _u(gen, (M, 1), -6.0, 6.0))
    return d


CASES: dict[str, Callable[[int, int, int, torch.Generator], _Draw]] = {
    "realistic": _realistic,
    "padding_rows": _padding_rows,
    "outlier_channels": _outlier_channels,
    "row_scales": _row_scales,
}
"""Case name -> generator ``(M, N, K, gen) -> {"x", "weight"}``."""


def make_inputs(axes: Mapping[str, int], seed: int, case: str = "realistic") -> dict[str, torch.Tensor]:
    """Draw the op's inputs for one workload.

    Args:
        axes: the workload's axes M (rows), N (output features), K (input features).
        seed: RNG seed; equal seeds give equal tensors.
        case: one of :data:`CASES`.

    Returns:
        ``x`` (M, K) float32 and ``weight`` (N, K) float32, contiguous CPU tensors.

    Raises:
        ValueError: unknown case (the message lists the known ones) or an axis below 1.

    Source: task.toml workloads; kernel_targets.md §6.3, §6.4.
    """
    if case not in CASES:
        raise ValueError(f"Task 'k3_small_m_gemm' (tasks/k3_small_m_gemm/inputs.py): unknown input case {case!r}; "
                         f"known cases: {', '.join(CASES)}. Fix the workload's case in task.toml.")
    M, N, K = (int(axes[a]) for a in ("M", "N", "K"))
    if min(M, N, K) < 1:
        raise ValueError(f"k3_small_m_gemm inputs: axes M, N, K must be >= 1; got M={M}, N={N}, K={K}.")
    gen = torch.Generator().manual_seed(int(seed))
    d = CASES[case](M, N, K, gen)
    return {"x": d["x"].float().contiguous(), "weight": d["weight"].float().contiguous()}


def permute_rows(inputs: Mapping[str, torch.Tensor], axes: Mapping[str, int], params: Mapping[str, object],
                 seed: int) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """The same rows of x in another order (rows are independent); the weight is unchanged.

    Returns:
        ``(inputs with x's rows permuted, {"perm": the permutation as a list})``: twin row ``i`` is original
        row ``perm[i]``.
    """
    M = int(axes["M"])
    perm = torch.randperm(M, generator=torch.Generator().manual_seed(int(seed)))
    return ({"x": inputs["x"][perm].contiguous(), "weight": inputs["weight"].clone()}, {"perm": perm.tolist()})
