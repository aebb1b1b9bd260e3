"""Input generators for the KDA decode task, one per ``case`` in task.toml.

Every draw is deterministic for a seed (a private ``torch.Generator``, never the global RNG) and lives
on the CPU; the harness moves tensors to the device.

Realistic draws mimic one K3 decode step: q, k, v come out of the short conv and SiLU (``silu`` of
roughly unit-variance pre-activations, so mostly small positives with a tail), the decay logits and the
beta logits are projections of a normalised hidden state (N(0, 1) and N(0, 1.5^2)), ``A_log`` and
``dt_bias`` are drawn as K3-mini's weights are (N(0, 0.5^2), N(0, 1)). The state of a sequence that has
seen many tokens is a sum of decayed rank-one updates ``beta v k^T`` with unit keys: a low-rank matrix
of entries O(0.1-1) plus noise. Each row owns a distinct slot of a pool larger than the batch; every
slot no row names holds another sequence's state, which the op must leave bit for bit. Edge cases pad
rows (index 0 or -1, garbage in their inputs and in the null slot 0), push q/k norms against the L2
epsilon, saturate the gate and beta, and hold states of large magnitude.

Source: tasks/k3_kda_decode/task.toml (workloads and their ``case``); shared/reference/kernel_targets.md
§5.1 (algorithm, gate), §5.2 (slot pool, index <= 0), §5.4 (shapes, dtypes), §5.5 (edge cases);
k3_model/model.py ``weight_specs`` (A_log and dt_bias draws).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

NAMES = ("q", "k", "v", "raw_g", "raw_beta", "A_log", "dt_bias", "state", "state_indices")
STATE_RANK = 8
"""Rank of the low-rank part of a realistic state (the few dominant key directions of a long context)."""

_Draw = dict[str, torch.Tensor]


def _silu_acts(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Post conv + SiLU activations: silu(N(0, s^2)) with a per-(row, head) scale s in [0.3, 2]."""
    s = torch.rand((*shape[:-1], 1), generator=gen) * 1.7 + 0.3
    return torch.nn.functional.silu(torch.randn(shape, generator=gen) * s)


def _states(n: int, H: int, V: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """(n, H, V, K) float32 states of long contexts: rank-``STATE_RANK`` part of entries ~0.3 plus N(0, 0.02^2)."""
    left = torch.randn((n, H, V, STATE_RANK), generator=gen) * 0.3
    right = torch.nn.functional.normalize(torch.randn((n, H, STATE_RANK, K), generator=gen), dim=-1)
    return left @ right + 0.02 * torch.randn((n, H, V, K), generator=gen)


def _realistic(B: int, H: int, K: int, V: int, S: int, gen: torch.Generator) -> _Draw:
    """Every row active in its own slot of a pool of S > B slots; slot 0 (null) zeros."""
    if S < B + 1:
        raise ValueError(f"k3_kda_decode inputs: S = {S} slots cannot give B = {B} rows distinct slots >= 1; "
                         "need S >= B + 1.")
    state = torch.zeros((S, H, V, K))
    if S > 1:
        state[1:] = _states(S - 1, H, V, K, gen)
    slots = torch.randperm(S - 1, generator=gen)[:B] + 1
    return {
        "q": _silu_acts((B, H, K), gen),
        "k": _silu_acts((B, H, K), gen),
        "v": _silu_acts((B, H, V), gen),
        "raw_g": torch.randn((B, H, K), generator=gen),
        "raw_beta": 1.5 * torch.randn((B, H), generator=gen),
        "A_log": 0.5 * torch.randn((H,), generator=gen),
        "dt_bias": torch.randn((H * K,), generator=gen),
        "state": state,
        "state_indices": slots.to(torch.int32),
    }


def padding_counts(B: int) -> list[int]:
    """Padding rows a ``padding_rows`` draw picks from, uniformly: one, a quarter, a half, all but one
    (B >= 2), or the one row (B = 1). A CUDA-graph step is padded up to the next captured batch size, so
    anything from one row to nearly half of a step is padding.

    Source: vLLM's CUDA-graph capture sizes (9 -> 16, 17 -> 24, 33 -> 48); tasks/k3_moe_dispatch/inputs.py."""
    return [1] if B == 1 else sorted({1, max(1, B // 4), max(1, B // 2), B - 1})


def _garbage(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """What a padding row or the null slot may hold, element by element: any bit pattern (NaN with
    payloads, +-inf, denormals, huge values)."""
    return torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int32).view(torch.float32)


def _pad(d: _Draw, gen: torch.Generator) -> None:
    B = int(d["state_indices"].shape[0])
    H, V, K = (int(x) for x in d["state"].shape[1:])
    counts = padding_counts(B)
    n = counts[int(torch.randint(0, len(counts), (1,), generator=gen))]
    pad = torch.randperm(B, generator=gen)[:n]
    d["state_indices"][pad] = torch.randint(-1, 1, (n,), generator=gen, dtype=torch.int32)
    for name in ("q", "k", "v", "raw_g", "raw_beta"):
        d[name][pad] = _garbage(tuple(d[name][pad].shape), gen)
    d["state"][0] = _garbage((H, V, K), gen)


def _padding_rows(B: int, H: int, K: int, V: int, S: int, gen: torch.Generator) -> _Draw:
    """Some rows padding (slot index 0 or -1, as vLLM's null slot and CUDA-graph filler), their inputs
    and the null slot 0 garbage: padding rows output 0 and touch no slot."""
    d = _realistic(B, H, K, V, S, gen)
    _pad(d, gen)
    return d


def pad_rows(inputs: dict[str, torch.Tensor], axes: Mapping[str, int], seed: int) -> dict[str, torch.Tensor]:
    """The ``padding_rows`` overlay (task.toml ``[domain.overlays.padding_rows]``): make some rows of any
    regime's draw padding, in place (:func:`padding_counts` rows get slot index 0 or -1 and garbage inputs,
    the null slot 0 garbage state); the other rows keep the regime's values, so padding meets tiny norms,
    extreme gates and betas and large states (padding as a regime of its own met realistic rows only: the
    class of session 13's and 14's red-team escapes on the MoE and LSE tasks).

    Args:
        inputs: the op's inputs (``make_inputs``'s names, shapes and dtypes).
        axes: the workload's axes.
        seed: RNG seed of the overlay.

    Returns:
        ``inputs``, changed in place.
    """
    _pad(inputs, torch.Generator().manual_seed(int(seed)))
    return inputs


def _tiny_norms(B: int, H: int, K: int, V: int, S: int, gen: torch.Generator) -> _Draw:
    """q and k rows rescaled to norms 10^U(-5, 4) (|x|^2 from 1e-10, far below the L2 epsilon 1e-6, to
    1e8), a quarter of them exactly zero: the normalised vector is x / sqrt(|x|^2 + 1e-6), never NaN."""
    d = _realistic(B, H, K, V, S, gen)
    for name in ("q", "k"):
        x = torch.nn.functional.normalize(torch.randn((B, H, K), generator=gen), dim=-1)
        norm = 10.0 ** (torch.rand((B, H, 1), generator=gen) * 9.0 - 5.0)
        zero = torch.rand((B, H, 1), generator=gen) < 0.25
        d[name] = torch.where(zero, torch.zeros(()), x * norm)
    return d


def _gate_extremes(B: int, H: int, K: int, V: int, S: int, gen: torch.Generator) -> _Draw:
    """Saturated gates: exp(A_log) up to e^3 times decay logits of +-U(5, 40), so g sits at 0 (no decay)
    or at the lower bound (each step scales the channel by e^lower_bound)."""
    d = _realistic(B, H, K, V, S, gen)
    sign = torch.where(torch.rand((B, H, K), generator=gen) < 0.5, -1.0, 1.0)
    d["raw_g"] = sign * (torch.rand((B, H, K), generator=gen) * 35.0 + 5.0)
    d["A_log"] = torch.rand((H,), generator=gen) * 6.0 - 3.0
    return d


def _beta_extremes(B: int, H: int, K: int, V: int, S: int, gen: torch.Generator) -> _Draw:
    """Beta logits +-U(10, 40): beta rounds to 1 in float32 (a full overwrite of the value along k) or
    lies within 5e-5 of 0 (the state only decays)."""
    d = _realistic(B, H, K, V, S, gen)
    sign = torch.where(torch.rand((B, H), generator=gen) < 0.5, -1.0, 1.0)
    d["raw_beta"] = sign * (torch.rand((B, H), generator=gen) * 30.0 + 10.0)
    return d


def _large_state(B: int, H: int, K: int, V: int, S: int, gen: torch.Generator) -> _Draw:
    """States of magnitude 10^U(1, 4) per slot and values up to 1e3 (a long context with beta near 0 and
    little decay; large activations): the update must stay relative, in float32, without overflow."""
    d = _realistic(B, H, K, V, S, gen)
    d["state"] = d["state"] * 10.0 ** (torch.rand((S, 1, 1, 1), generator=gen) * 3.0 + 1.0)
    d["v"] = d["v"] * 10.0 ** (torch.rand((B, H, 1), generator=gen) * 3.0)
    return d


CASES: dict[str, Callable[[int, int, int, int, int, torch.Generator], _Draw]] = {
    "realistic": _realistic,
    "padding_rows": _padding_rows,
    "tiny_norms": _tiny_norms,
    "gate_extremes": _gate_extremes,
    "beta_extremes": _beta_extremes,
    "large_state": _large_state,
}
"""Case name -> generator ``(B, H, K, V, S, gen) -> inputs``."""


def make_inputs(axes: Mapping[str, int], seed: int, case: str = "realistic") -> dict[str, torch.Tensor]:
    """Draw the op's inputs for one workload.

    Args:
        axes: the workload's axes B (sequences), H (heads), K (key width), V (value width), S (slots).
        seed: RNG seed; equal seeds give equal tensors.
        case: one of :data:`CASES`.

    Returns:
        ``q``, ``k`` (B, H, K), ``v`` (B, H, V), ``raw_g`` (B, H, K), ``raw_beta`` (B, H), ``A_log`` (H,),
        ``dt_bias`` (H*K,), ``state`` (S, H, V, K), all float32, and ``state_indices`` (B,) int32;
        contiguous CPU tensors.

    Raises:
        ValueError: unknown case (the message lists the known ones), an axis below 1, or S <= B.

    Source: task.toml workloads; kernel_targets.md §5.4 (dtypes), §5.5 (edge cases).
    """
    if case not in CASES:
        raise ValueError(f"Task 'k3_kda_decode' (tasks/k3_kda_decode/inputs.py): unknown input case {case!r}; "
                         f"known cases: {', '.join(CASES)}. Fix the workload's case in task.toml.")
    B, H, K, V, S = (int(axes[a]) for a in ("B", "H", "K", "V", "S"))
    if min(B, H, K, V, S) < 1:
        raise ValueError(f"k3_kda_decode inputs: axes B, H, K, V, S must be >= 1; got B={B}, H={H}, K={K}, V={V}, S={S}.")
    gen = torch.Generator().manual_seed(int(seed))
    d = CASES[case](B, H, K, V, S, gen)
    return {n: (d[n].to(torch.int32) if n == "state_indices" else d[n].float()).contiguous() for n in NAMES}


def permute_rows(inputs: Mapping[str, torch.Tensor], axes: Mapping[str, int], params: Mapping[str, object],
                 seed: int) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """The same sequences in another batch order, each keeping its slot (rows are independent).

    Returns:
        ``(inputs with the per-row tensors permuted along B, {"perm": the permutation as a list})``:
        twin row ``i`` is original row ``perm[i]``; the pool, ``A_log`` and ``dt_bias`` are unchanged.
    """
    B = int(axes["B"])
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(int(seed)))
    twin = {n: (inputs[n][perm].contiguous() if n in ("q", "k", "v", "raw_g", "raw_beta", "state_indices")
                else inputs[n].clone()) for n in NAMES}
    return twin, {"perm": perm.tolist()}
