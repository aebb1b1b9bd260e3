"""Input generators for the K3 MoE routing + dispatch task, one per ``case`` in task.toml.

Every draw is deterministic for a seed (a private ``torch.Generator``, never the global RNG) and
lives on the CPU; the harness moves tensors to the device.

Source: tasks/k3_moe_dispatch/task.toml (workloads and their ``case``); shared/reference/
kernel_targets.md §3.3 (fp32 logits and bias), §3.4 (edge cases).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

_Draw = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _realistic_logits(T: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """(T, E) float32 logits of a few units: Zipf-like expert popularity (a few hot experts), a
    component shared by the batch (correlated tokens) and per-token noise."""
    rank = torch.randperm(E, generator=gen).float()
    popularity = 4.0 * (rank + 1.0).rsqrt() - 1.0  # hottest +3, median about -0.8 at E=896
    shared = 0.5 * torch.randn(E, generator=gen)
    return popularity + shared + torch.randn(T, E, generator=gen)


REALISTIC_BIAS_SIGMA = (0.01, 0.1)
"""Range (log-uniform, one value per draw) of the standard deviation of the realistic correction bias.

Source: task.toml ``[domain.inputs.e_score_correction_bias]`` realistic O(0.01-0.1); K3-mini's bias is
N(0, 0.1^2) (k3_model/model.py ``weight_specs``). A spread fixed at 0.05 let the bad fixture
``correctness-drops-small-bias`` (drops the bias while max |bias| <= 0.1) pass correctness in session 26's
landing CI: at E = 32 only about one draw in five has so small a bias, and that run drew none; perf's
per-call check caught it instead. With the spread drawn, about half of the draws at E = 32 or 896 have
max |bias| <= 0.1."""


def _small_bias(E: int, gen: torch.Generator) -> torch.Tensor:
    """(E,) float32 noaux_tc-like correction bias: N(0, sigma^2), sigma log-uniform in :data:`REALISTIC_BIAS_SIGMA`."""
    lo, hi = (math.log(x) for x in REALISTIC_BIAS_SIGMA)
    sigma = math.exp(lo + (hi - lo) * float(torch.rand((), generator=gen)))
    return sigma * torch.randn(E, generator=gen)


def _realistic(T: int, E: int, gen: torch.Generator) -> _Draw:
    return _realistic_logits(T, E, gen), _small_bias(E, gen), torch.ones(T, dtype=torch.bool)


def _group_negative_bias(T: int, E: int, gen: torch.Generator) -> _Draw:
    if (T, E) != (1, 8):
        raise ValueError(f"inputs case 'group_negative_bias' needs T=1, E=8 (vLLM PR #13474 example); got T={T}, E={E}.")
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0, -1.0, -1.0, -2.0, -2.0]])
    return logits, torch.full((8,), -1.0), torch.ones(1, dtype=torch.bool)


def _one_expert(T: int, E: int, gen: torch.Generator) -> _Draw:
    if E != 1:
        raise ValueError(f"inputs case 'one_expert' needs E=1 (every token on expert 0); got E={E}.")
    return torch.randn(T, 1, generator=gen), _small_bias(1, gen), torch.ones(T, dtype=torch.bool)


PADDING_CONTENTS = ("garbage", "plausible", "mixed")
"""What a padded step's padding rows hold, one of these per step, uniformly: every padding row garbage
(:func:`padding_garbage`), every one the regime's own ordinary logits (vLLM runs dummy tokens through the
model, so a padding row may look valid), or each row one or the other."""


PADDING_VARIANTS = ("one", "few", "many", "all_but_one")
"""How many rows the ``padding_rows`` overlay pads (task.toml ``variants``, each a coverage cell): one row,
a few (2 .. max(2, T // 4), log-uniform: what padding a batch to the next CUDA-graph size mostly gives,
33 -> 40), many (T // 4 .. T - 2), all but one (clamped to [1, T - 1])."""


def _variant_count(variant: str, T: int, gen: torch.Generator) -> int:
    if variant == "one":
        n = 1
    elif variant == "few":
        hi = max(2, T // 4)
        n = int(round(math.exp(math.log(2) + float(torch.rand(1, generator=gen)) * (math.log(hi) - math.log(2)))))
    elif variant == "many":
        lo, hi = max(1, T // 4), max(1, T - 2)
        n = int(torch.randint(min(lo, hi), hi + 1, (1,), generator=gen))
    elif variant == "all_but_one":
        n = T - 1
    else:
        raise ValueError(f"overlay padding_rows: unknown variant {variant!r}; known: {', '.join(PADDING_VARIANTS)}.")
    return min(T - 1, max(1, n))


def _pad(logits: torch.Tensor, valid: torch.Tensor, gen: torch.Generator, variant: str | None = None) -> None:
    """Make some rows of a step padding, in place. The count: half the steps from :func:`padding_counts`
    (so one row, a quarter, a half and all but one come in every run), half log-uniform in [1, T - 1] (session
    14's red team: a kernel wrong only between the menu's counts, 1 < n < T // 4, what most CUDA-graph
    steps have, was accepted). The layout: half the steps the tail a CUDA graph pads (valid rows first),
    half random positions (session 14: a kernel wrong only on a padded tail was accepted). The content:
    :data:`PADDING_CONTENTS` (session 14: a kernel telling padding from the logits' garbage, not from
    ``token_valid``, was accepted)."""
    T, E = logits.shape
    if T < 2:
        raise ValueError(f"inputs case 'padding_rows' needs T >= 2 (some rows valid, some padding); got T={T}.")
    counts = padding_counts(T)
    if variant is not None:  # the overlay's coverage cell decides how many
        n = _variant_count(variant, T, gen)
    elif bool(torch.rand(1, generator=gen) < 0.5):
        n = counts[int(torch.randint(0, len(counts), (1,), generator=gen))]
    else:  # log-uniform in [1, T - 1]: the few padding rows most CUDA-graph steps have are as likely as many
        n = min(T - 1, max(1, int(math.exp(float(torch.rand(1, generator=gen)) * math.log(T)))))
    if bool(torch.rand(1, generator=gen) < 0.5):
        pad = torch.arange(T - n, T)
    else:
        pad = torch.randperm(T, generator=gen)[:n]
    valid[pad] = False
    content = PADDING_CONTENTS[int(torch.randint(0, len(PADDING_CONTENTS), (1,), generator=gen))]
    if content == "mixed":
        pad = pad[torch.rand(n, generator=gen) < 0.5]
    if content != "plausible" and len(pad):
        logits[pad] = padding_garbage(len(pad), E, gen)  # a kernel must ignore it (CUDA-graph padding rows)


def _padding_rows(T: int, E: int, gen: torch.Generator) -> _Draw:
    logits, bias, valid = _realistic(T, E, gen)
    _pad(logits, valid, gen)
    return logits, bias, valid


def pad_rows(inputs: dict[str, torch.Tensor], axes: Mapping[str, int], seed: int,
             variant: str | None = None) -> dict[str, torch.Tensor]:
    """The ``padding_rows`` overlay (task.toml ``[domain.overlays.padding_rows]``): make some rows of any
    regime's draw CUDA-graph padding, in place: :func:`padding_counts` rows at random positions get
    ``token_valid`` False and logits of :func:`padding_garbage`; the valid rows and the bias keep the
    regime's values, so padding meets every logits and bias regime (session 13's red team: a kernel
    wrong only when padding rows meet a wide or shifted bias was accepted while padding drew realistic
    data only).

    Args:
        inputs: ``router_logits`` (T, E) float32, ``e_score_correction_bias`` (E,), ``token_valid`` (T,) bool.
        axes: the workload's axes (T >= 2).
        seed: RNG seed of the overlay.
        variant: how many rows (:data:`PADDING_VARIANTS`); None: any count (the ``padding_rows`` case).

    Returns:
        ``inputs``, changed in place.

    Raises:
        ValueError: T < 2 (a step needs a valid row besides its padding), or an unknown variant.
    """
    _pad(inputs["router_logits"], inputs["token_valid"], torch.Generator().manual_seed(int(seed)), variant)
    return inputs


def padding_counts(T: int) -> list[int]:
    """The padding-row counts the ``padding_rows`` case draws from, uniformly, for a batch of ``T`` rows
    (``T >= 2``): one row, a quarter, a half and all rows but one, without repeats. A CUDA-graph step is
    padded up to the next captured batch (vLLM: 9 -> 16, 17 -> 24, 33 -> 48), so anywhere from one row to
    nearly half of a step is padding, and a kernel may treat "many padding rows" apart (session 12's red
    team: a kernel that compacts the valid rows when more than a quarter are padding, and dispatches the
    compacted indices, was accepted while this case padded at most a quarter).

    Source: vLLM's CUDA-graph capture sizes (batch padded to the next size); issue 19 (inputs leave the
    generators' old ranges)."""
    return sorted({1, max(1, T // 4), max(1, T // 2), T - 1})


def padding_garbage(n: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """(n, E) float32 of what a padding row may hold, element by element: +-1e30, NaN, +-inf or any bit
    pattern (NaNs with payloads, denormals, huge values). The contract says padding rows are ignored,
    whatever they hold (session 7's red team: a kernel that masked with ``w * token_valid`` was accepted
    while padding rows held only +-1e30; with NaN there its weights are NaN, not 0)."""
    bits = torch.randint(-2**31, 2**31 - 1, (n, E), generator=gen, dtype=torch.int32).view(torch.float32)
    pick = torch.randint(0, 6, (n, E), generator=gen)
    table = torch.tensor([1e30, -1e30, float("nan"), float("inf"), float("-inf"), 0.0])
    return torch.where(pick == 5, bits, table[pick])


def _ties(T: int, E: int, gen: torch.Generator) -> _Draw:
    logits = torch.randint(-1, 3, (T, E), generator=gen).float()  # 4 levels: many exact ties
    return logits, torch.zeros(E), torch.ones(T, dtype=torch.bool)


def _saturated(T: int, E: int, gen: torch.Generator) -> _Draw:
    magnitude = 20.0 + 20.0 * torch.rand(T, E, generator=gen)
    sign = torch.where(torch.rand(T, E, generator=gen) < 0.5, -1.0, 1.0)
    # x >= ~17 gives sigmoid == 1.0 exactly in fp32, so among those the bias alone decides.
    return sign * magnitude, _small_bias(E, gen), torch.ones(T, dtype=torch.bool)


BIAS_SHIFT_LOG2 = (9.0, 14.0)
"""Range of log2 |shift| of the ``bias_shift`` regime: shifts of 512 to 16384 (either sign)."""


def _bias_shift(T: int, E: int, gen: torch.Generator) -> _Draw:
    """Realistic draws with one large constant ``C`` added to every bias entry, ``|C|`` log-uniform in
    ``[2^9, 2^14]``, either sign. Selection is invariant to the shift (up to fp32 rounding of ``s + b``
    at that magnitude: near-ties); weights use the unbiased scores, so a formula that recovers the
    scores as ``(s + b) - b`` loses up to ``ulp(C) / 2`` and a negative shift puts every choice score far
    below any "invalid lane" floor of a few hundred."""
    logits, bias, valid = _realistic(T, E, gen)
    log2 = BIAS_SHIFT_LOG2[0] + (BIAS_SHIFT_LOG2[1] - BIAS_SHIFT_LOG2[0]) * float(torch.rand(1, generator=gen))
    sign = -1.0 if float(torch.rand(1, generator=gen)) < 0.5 else 1.0
    return logits, bias + sign * 2.0 ** log2, valid


def _tiny_scale(T: int, E: int, gen: torch.Generator) -> _Draw:
    """Realistic logits times 1e-3 and bias times 1e-4: every score within ~1e-3 of 0.5, distinct in
    fp32 (ulp 6e-8 there) but not in bf16/fp16 (ulp 2e-3 / 5e-4)."""
    logits, bias, valid = _realistic(T, E, gen)
    return logits * 1e-3, bias * 1e-4, valid


def _signed_zeros(T: int, E: int, gen: torch.Generator) -> _Draw:
    """Logits exactly +0.0 or -0.0 (every score 0.5): the bias alone decides, weights are all equal."""
    sign = torch.where(torch.rand(T, E, generator=gen) < 0.5, -1.0, 1.0)
    return sign * 0.0, _small_bias(E, gen), torch.ones(T, dtype=torch.bool)


FAR_NEGATIVE_SHIFT = (46.0, 80.0)
"""Range of the per-row shift (subtracted) of the ``far_negative`` regime: logits near -46 to -83, whose
sigmoid scores 1e-20 to 1e-36 are normal fp32 (the smallest normal, 1.2e-38, is sigmoid(-87.3))."""


def _far_negative(T: int, E: int, gen: torch.Generator) -> _Draw:
    """Realistic logits with each row shifted down by U(46, 80): every score is tiny but normal fp32, so the
    bias alone decides the selection and the weights are ratios of tiny scores. Legal (no top-K score
    underflows); a kernel that clamps logits (``clamp(min=-45)``) or floors scores gives equal weights
    (session 7's red team: accepted while no generator drew a valid row below -45)."""
    logits, bias, valid = _realistic(T, E, gen)
    lo, hi = FAR_NEGATIVE_SHIFT
    return logits - (lo + (hi - lo) * torch.rand(T, 1, generator=gen)), bias, valid


NEAR_SATURATED_SHIFT = (6.0, 14.0)
"""Range of the per-row shift (added) of the ``near_saturated`` regime: valid logits of about 2 to 23,
most in 8-17, where sigmoid is within 3e-4 of 1.0 yet still below it in fp32 (it rounds to 1.0 from
about 16.6 on)."""


def _near_saturated(T: int, E: int, gen: torch.Generator) -> _Draw:
    """Realistic logits with each row shifted up by U(6, 14): scores close to 1.0, distinct in fp32 up to
    about x = 16.6. A kernel that treats sigmoid as saturated early (``x > 10 -> 1.0``) ties experts the
    reference tells apart (session 10's red team: accepted while no generator drew valid rows between the
    realistic range, up to ~9, and the saturated one, from 20)."""
    logits, bias, valid = _realistic(T, E, gen)
    lo, hi = NEAR_SATURATED_SHIFT
    return logits + (lo + (hi - lo) * torch.rand(T, 1, generator=gen)), bias, valid


WIDE_BIAS_SIGMA = (0.5, 4.0)
"""Range (log-uniform) of the standard deviation of the ``wide_bias`` regime's correction bias."""


def _wide_bias(T: int, E: int, gen: torch.Generator, G: int = 1, TG: int = 1) -> _Draw:
    """Realistic logits with a correction bias spread wider than the scores' range: N(0, sigma^2), sigma
    log-uniform in [0.5, 4]. Then ``s + b`` of a dropped group's expert can exceed a kept one's by more than
    1, so a group mask that offsets instead of excluding (``g - 2.0`` for ``-inf``) picks dropped experts
    (session 10's red team: accepted while every generator's bias spread stayed below about 0.33).

    When the configuration drops groups (``TG < G``, at least two experts a group), ``G - TG`` random
    groups get a lone star: one expert at bias ``+WIDE_BIAS_STAR + sigma``, its group mates at
    ``-3 (WIDE_BIAS_STAR + sigma)``. Their top-2 group score falls below every other group's (those keep
    a bias of ``sigma / 8`` N(0, 1)), so exactly they are dropped, while each star's ``s + b`` exceeds
    every kept expert's by more than ``WIDE_BIAS_STAR - 1``: an offset mask of any size up to that picks
    a star. Session 11's CI: with the plain spread, four wide-bias draws of one run (two dropping groups)
    left that fixture accepted. Source: k3_model/ops/moe_dispatch.py (group score = top-2 sum).
    """
    logits, _, valid = _realistic(T, E, gen)
    lo, hi = WIDE_BIAS_SIGMA
    sigma = float(torch.exp(torch.empty(1).uniform_(float(torch.tensor(lo).log()), float(torch.tensor(hi).log()),
                                                    generator=gen)))
    per = E // G if G >= 1 and E % G == 0 else 0
    if not (TG < G and per >= 2):
        return logits, sigma * torch.randn(E, generator=gen), valid
    bias = (sigma / 8) * torch.randn(E, generator=gen)
    star = WIDE_BIAS_STAR + sigma
    for g in torch.randperm(G, generator=gen)[: G - TG].tolist():
        block = torch.full((per,), -3.0 * star)
        block[int(torch.randint(per, (1,), generator=gen))] = star
        bias[g * per:(g + 1) * per] = block
    return logits, bias, valid


WIDE_BIAS_STAR = 6.0
"""Bias of a lone star above the kept experts in ``wide_bias`` draws that drop groups (before adding
sigma): sigmoid scores lie in [0, 1], so a star beats every kept expert by more than 5 after any
offset mask up to 5. Source: the fixture correctness-offsets-dropped-groups (offset 2)."""


def _denormal_scores(T: int, E: int, K: int, gen: torch.Generator) -> _Draw:
    """Realistic draws in which up to ``E - K`` experts per row get logits in [-103, -88], so their
    sigmoid score is tiny or denormal (1e-45 to 6e-39); at least K experts stay normal, so the
    renormalising sum is never 0. A flush-to-zero kernel differs by far less than the tolerances."""
    logits, bias, valid = _realistic(T, E, gen)
    n = max(0, min(E - K, E // 2))
    if n:
        cols = torch.rand(T, E, generator=gen).argsort(-1)[:, :n]
        logits.scatter_(1, cols, -88.0 - 15.0 * torch.rand(T, n, generator=gen))
    return logits, bias, valid


CASES: dict[str, Callable[..., _Draw]] = {
    "realistic": _realistic,
    "group_negative_bias": _group_negative_bias,
    "one_expert": _one_expert,
    "padding_rows": _padding_rows,
    "ties": _ties,
    "saturated": _saturated,
    "bias_shift": _bias_shift,
    "tiny_scale": _tiny_scale,
    "signed_zeros": _signed_zeros,
    "denormal_scores": _denormal_scores,
    "far_negative": _far_negative,
    "near_saturated": _near_saturated,
    "wide_bias": _wide_bias,
}
"""Case name -> generator ``(T, E, gen) -> (logits, bias, token_valid)`` (``denormal_scores``: ``(T, E, K, gen)``)."""


def make_inputs(axes: Mapping[str, int], seed: int, case: str = "realistic") -> dict[str, torch.Tensor]:
    """Draw the op's inputs for one workload.

    Cases: ``realistic`` (skewed expert popularity, correlated tokens, small bias, all rows valid);
    ``group_negative_bias`` (logits [2,1,0,0,-1,-1,-2,-2], bias -1); ``one_expert`` (E=1);
    ``padding_rows`` (one row, a quarter, a half or all but one of the rows, at random positions, invalid
    with logits holding +-1e30, NaN, +-inf or any bit pattern: :func:`padding_counts`); ``far_negative`` (valid rows' logits shifted down by
    46-80: tiny normal scores, the bias decides); ``ties`` (logits on 4 levels, bias 0); ``saturated`` (|logits| in [20, 40], small
    nonzero bias decides); ``bias_shift`` (realistic plus one constant of +-2^9..2^14 on the bias);
    ``tiny_scale`` (scores within 1e-3 of 0.5); ``signed_zeros`` (logits +-0.0, the bias decides);
    ``denormal_scores`` (up to E - K experts per row with denormal scores; uses axis K).

    Args:
        axes: the workload's axes; T (tokens) and E (experts) are used, K by ``denormal_scores``, G
            and TG by ``wide_bias``.
        seed: RNG seed; equal seeds give equal tensors.
        case: one of :data:`CASES`.

    Returns:
        ``router_logits`` (T, E) float32, ``e_score_correction_bias`` (E,) float32,
        ``token_valid`` (T,) bool, all contiguous CPU tensors.

    Raises:
        ValueError: unknown case (the message lists the known ones), or axes the case cannot use.

    Source: task.toml workloads; kernel_targets.md §3.3 (dtypes), §3.4 (edge cases).
    """
    if case not in CASES:
        raise ValueError(f"Task 'k3_moe_dispatch' (tasks/k3_moe_dispatch/inputs.py): unknown input case {case!r}; "
                         f"known cases: {', '.join(CASES)}. Fix the workload's case in task.toml.")
    T, E = int(axes["T"]), int(axes["E"])
    if T < 1 or E < 1:
        raise ValueError(f"k3_moe_dispatch inputs: axes T and E must be >= 1; got T={T}, E={E}.")
    gen = torch.Generator().manual_seed(int(seed))
    if CASES[case] is _denormal_scores:
        logits, bias, valid = _denormal_scores(T, E, int(axes.get("K", 1)), gen)
    elif CASES[case] is _wide_bias:
        logits, bias, valid = _wide_bias(T, E, gen, int(axes.get("G", 1)), int(axes.get("TG", 1)))
    else:
        logits, bias, valid = CASES[case](T, E, gen)
    return {"router_logits": logits.float().contiguous(), "e_score_correction_bias": bias.float().contiguous(),
            "token_valid": valid.contiguous()}


# Metamorphic twins (task.toml [domain.invariances]; issue 19 item 2). Each returns the transformed
# inputs and the plain data the relation in reference.py needs.

TWIN_SHIFT_LOG2 = (-1, 6)
"""Inclusive range of the integer log2 |C| of the twin's bias shift: C = +-2^k, k in [-1, 6] (0.5 to 64)."""


def _twin_gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def permute_tokens(inputs: Mapping[str, torch.Tensor], axes: Mapping[str, int], params: Mapping[str, object],
                   seed: int) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """The batch with its tokens permuted: twin row ``i`` is original row ``perm[i]``.

    ``router_logits`` (T, E) and ``token_valid`` (T,) are permuted by rows; the bias (E,) is shared by
    the batch and stays. ``perm`` is uniform over the permutations of T tokens other than the identity
    (one is redrawn as a rotation by one), so every pair moves some token.

    Args:
        inputs: ``router_logits``, ``e_score_correction_bias``, ``token_valid`` as :func:`make_inputs` returns.
        axes: the workload's axes (T >= 2: task.toml ``requires``).
        params: the op's scalar arguments (unused).
        seed: RNG seed of the permutation.

    Returns:
        (twin inputs, ``{"perm": perm}``) with ``perm`` a list of T ints.

    Raises:
        ValueError: T < 2 (a permutation of one token is the identity).

    Source: task.toml [domain.invariances.token_permutation]; kernel_targets.md §3.1 (routing per token).
    """
    T = int(inputs["router_logits"].shape[0])
    if T < 2:
        raise ValueError(f"k3_moe_dispatch permute_tokens: needs T >= 2 tokens (task.toml requires 'T >= 2'); got T={T}.")
    perm = torch.randperm(T, generator=_twin_gen(seed))
    if bool((perm == torch.arange(T)).all()):
        perm = torch.roll(perm, 1)
    twin = {"router_logits": inputs["router_logits"][perm].contiguous(),
            "e_score_correction_bias": inputs["e_score_correction_bias"].clone(),
            "token_valid": inputs["token_valid"][perm].contiguous()}
    return twin, {"perm": perm.tolist()}


def shift_bias(inputs: Mapping[str, torch.Tensor], axes: Mapping[str, int], params: Mapping[str, object],
               seed: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The batch with one constant ``C = +-2^k`` (k uniform in :data:`TWIN_SHIFT_LOG2`) added to every bias entry.

    A power of two, so ``C`` is exact; large enough that ``s + b + C`` rounds differently from
    ``s + b`` (a formula that cancels the bias loses ulp(C)/2 on the scores), small enough that the
    checker's near-tie window (``NEAR_TIE_REL * max|c|``, 6.4e-5 at |C| = 64) stays narrow.

    Args:
        inputs: as :func:`make_inputs` returns.
        axes, params: the workload's axes and op arguments (unused: G == 1 is task.toml's ``requires``).
        seed: RNG seed of ``k`` and the sign.

    Returns:
        (twin inputs, ``{"shift": C}``) with ``C`` a float.

    Source: task.toml [domain.invariances.bias_shift]; kernel_targets.md §3.1 (selection on s + b,
    weights from s).
    """
    gen = _twin_gen(seed)
    lo, hi = TWIN_SHIFT_LOG2
    k = int(torch.randint(lo, hi + 1, (1,), generator=gen))
    shift = (-1.0 if float(torch.rand(1, generator=gen)) < 0.5 else 1.0) * 2.0 ** k
    twin = {"router_logits": inputs["router_logits"].clone(),
            "e_score_correction_bias": (inputs["e_score_correction_bias"] + shift).contiguous(),
            "token_valid": inputs["token_valid"].clone()}
    return twin, {"shift": shift}
