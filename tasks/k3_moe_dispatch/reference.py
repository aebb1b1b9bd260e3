"""Independent fp32 oracle and output checker for the K3 MoE routing + dispatch task.

Written from the math in kernel_targets.md, not from the model's code: routing one token at a time
(stable descending sorts, so equal scores keep ascending group and expert order; the checker accepts
any other valid choice among ties), alignment one expert at a time with Python lists. Clear rather than fast (a few ms at T=64, E=896, K=16).
The checker walks row by row and expert by expert only where the outputs differ from the reference's
(vectorized comparisons find the rows and the layout that equal it, up to the orders the contract leaves free).

Source: shared/reference/kernel_targets.md §3.1 (grouped_topk torch semantics, moe_align_block_size
contract), §3.4 (edge cases), §3.5 (tolerances); tasks/k3_moe_dispatch/task.toml.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from itertools import accumulate, combinations
from typing import Any

import torch

OUTPUTS = ("topk_weights", "topk_ids", "sorted_token_ids", "expert_ids", "num_tokens_post_padded")
NEAR_TIE_REL = 1e-6
"""K-th vs (K+1)-th biased score gap, relative to max|c|, below which a swap is allowed (§3.5)."""
MAX_MESSAGES = 20
_PER_OUTPUT = 3  # element mismatches listed per output before a count line


def _descending(values: torch.Tensor) -> list[int]:
    """Indices of ``values`` from largest to smallest; ties keep ascending index order."""
    return torch.sort(values, descending=True, stable=True).indices.tolist()


def group_scores(choice: torch.Tensor, n_group: int) -> torch.Tensor:
    """Score of each expert group: the sum of its top-2 biased scores (top-1 when it has one expert).

    Args:
        choice: (E,) float32 biased selection scores ``sigmoid(logits) + bias`` of one token.
        n_group: expert groups G (E % G == 0).

    Returns:
        (G,) float32 group scores, each the larger score plus the smaller (the order torch's
        ``topk(2).values.sum()`` adds them in).

    Source: kernel_targets.md §3.1 (grouped_topk), §3.4 (vLLM PR #13474: top-2 sum).
    """
    per_group = choice.numel() // n_group
    return torch.stack([
        choice[g * per_group:(g + 1) * per_group][_descending(choice[g * per_group:(g + 1) * per_group])[:2]].sum()
        for g in range(n_group)
    ])


def keep_groups(choice: torch.Tensor, n_group: int, groups: Iterable[int]) -> torch.Tensor:
    """``choice`` with the experts of every group not in ``groups`` set to -inf (never 0).

    Args:
        choice: (E,) float32 biased selection scores of one token.
        n_group: expert groups G.
        groups: the kept group indices.

    Returns:
        (E,) float32.

    Source: kernel_targets.md §3.4 (vLLM PR #13474: -inf mask, so negative kept scores still win).
    """
    per_group = choice.numel() // n_group
    masked = torch.full_like(choice, float("-inf"))
    for g in groups:
        masked[g * per_group:(g + 1) * per_group] = choice[g * per_group:(g + 1) * per_group]
    return masked


def masked_choice(logits_row: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Biased selection scores of one token, experts of non-kept groups set to -inf.

    Args:
        logits_row: (E,) float32 router logits of one token.
        bias: (E,) float32 e_score_correction_bias.
        n_group: expert groups G (E % G == 0).
        topk_group: groups kept TG (the largest :func:`group_scores`; equal scores keep ascending
            group order).

    Returns:
        (E,) float32 ``c = sigmoid(logits) + bias``, -inf (never 0) outside the kept groups.

    Source: kernel_targets.md §3.1 (torch semantics), §3.4 (vLLM PR #13474: top-2 sum, -inf mask).
    """
    choice = torch.sigmoid(logits_row.float()) + bias.float()
    if n_group == 1:
        return choice
    return keep_groups(choice, n_group, _descending(group_scores(choice, n_group))[:topk_group])


def group_choices(choice: torch.Tensor, n_group: int, topk_group: int,
                  must_include: Iterable[int] = ()) -> tuple[list[list[int]], list[int]]:
    """Every set of kept groups a correct kernel may pick, the reference's first.

    Groups whose scores tie (exactly, or within ``NEAR_TIE_REL * max|group score|``, the rule §3.5
    sets for experts) across the topk_group boundary are interchangeable: a kernel may keep any of
    them, and which one ``torch.topk`` keeps is unspecified. Groups scoring above the window are
    always kept; the rest of the TG slots are filled from the tied ones.

    Args:
        choice: (E,) float32 biased selection scores of one token.
        n_group: expert groups G.
        topk_group: groups kept TG.
        must_include: groups the alternatives must contain (those the candidate's experts lie in);
            alternatives that cannot contain them all are left out.

    Returns:
        (sets, tied): ``sets`` the reference's kept groups (ascending order among equals) followed by
        every other valid set that contains ``must_include``; ``tied`` the groups inside the tie
        window at the boundary, ``[]`` when the boundary is not a tie.

    Source: kernel_targets.md §3.5 (near-tie swaps), applied to group scores; issue 12 (exact ties
    between group scores rejected every choice but the lowest index).
    """
    if n_group == 1:
        return [[0]], []
    gs = group_scores(choice, n_group)
    order = _descending(gs)
    reference = order[:topk_group]
    if topk_group == n_group:
        return [reference], []
    v_tg, v_tg1 = float(gs[order[topk_group - 1]]), float(gs[order[topk_group]])
    finite = gs[torch.isfinite(gs)]
    window = NEAR_TIE_REL * float(finite.abs().max()) if finite.numel() else 0.0
    if not v_tg - v_tg1 < window and not v_tg == v_tg1:
        return [reference], []
    above = [g for g in order if float(gs[g]) > v_tg + window]
    tied = [g for g in order if g not in above and v_tg1 - window <= float(gs[g]) <= v_tg + window]
    need = set(must_include)
    if not need <= set(above) | set(tied):
        return [reference], sorted(tied)
    forced = sorted(need & set(tied))
    free = sorted(set(tied) - need)
    slots = topk_group - len(above) - len(forced)
    sets = [reference]
    if slots >= 0:
        for extra in combinations(free, slots):
            kept = sorted([*above, *forced, *extra])
            if kept != sorted(reference):
                sets.append(kept)
    return sets, sorted(tied)


def expert_weights(logits_row: torch.Tensor, ids: list[int], renormalize: bool, scale: float) -> torch.Tensor:
    """Routing weights of the chosen experts: UNBIASED sigmoid scores, renormalized, scaled.

    Args:
        logits_row: (E,) float32 router logits of one token.
        ids: the K chosen expert ids.
        renormalize: divide by the sum of the chosen scores.
        scale: routed_scaling_factor (dimensionless).

    Returns:
        (K,) float32 weights in the order of ``ids``.

    Source: kernel_targets.md §3.1 (``w = s.gather(ids); w /= w.sum(); w *= rsf``).
    """
    w = torch.sigmoid(logits_row.float())[ids]
    if renormalize:
        w = w / w.sum()
    return w * scale


def align(topk_ids: torch.Tensor, num_experts: int, block_size: int) -> dict[str, torch.Tensor]:
    """Group flat (token, slot) indices by expert and pad each expert's segment to ``block_size``.

    Args:
        topk_ids: (T, K) integer expert ids; ids outside [0, E) (padding rows' -1) are skipped.
        num_experts: E.
        block_size: B (rows of the expert GEMM tile).

    Returns:
        ``sorted_token_ids`` (T*K + E*(B-1),) int32: per expert in ascending order, its flat indices
        ``t*K + k`` ascending, then the sentinel T*K up to a multiple of B; sentinel after the
        padded total. ``expert_ids`` (cdiv(T*K + E*(B-1), B),) int32: expert of each block, -1 past
        the padded total. ``num_tokens_post_padded`` (1,) int32: sum of ceil(count_e / B) * B.

    Source: kernel_targets.md §3.1 (moe_align_block_size), §3.4 (-1 tail blocks, vLLM PR #35161).
    """
    T, K = topk_ids.shape
    numel, E, B = T * K, num_experts, block_size
    members: list[list[int]] = [[] for _ in range(E)]
    for i, e in enumerate(topk_ids.reshape(-1).tolist()):
        if 0 <= e < E:
            members[e].append(i)
    cap = numel + E * (B - 1)
    sorted_ids, block_experts = [numel] * cap, [-1] * (-(-cap // B))
    pos = 0
    for e in range(E):
        padded = -(-len(members[e]) // B) * B
        sorted_ids[pos:pos + len(members[e])] = members[e]
        block_experts[pos // B:(pos + padded) // B] = [e] * (padded // B)
        pos += padded
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return {"sorted_token_ids": as_i32(sorted_ids), "expert_ids": as_i32(block_experts),
            "num_tokens_post_padded": as_i32([pos])}


def reference(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Route every valid token to its top-k experts, then lay out the block-aligned dispatch.

    Args:
        inputs: ``router_logits`` (T, E) float32; ``e_score_correction_bias`` (E,) float32 (selection
            only); ``token_valid`` (T,) bool (False = padding row).
        params: ``top_k`` K, ``n_group`` G, ``topk_group`` TG, ``block_size`` B (ints);
            ``renormalize`` (bool); ``routed_scaling_factor`` (float, dimensionless).

    Returns:
        ``topk_weights`` (T, K) float32 (0 on padding rows), ``topk_ids`` (T, K) int32 (-1 on padding
        rows), and the three outputs of :func:`align` computed over ``topk_ids``; all on the CPU.

    Raises:
        ValueError: E, G, TG and K are inconsistent (E % G != 0, TG > G or K > TG * E / G).

    Source: kernel_targets.md §3.1, §3.4 (padding rows get id -1).
    """
    logits, bias, valid = (inputs[k].detach().cpu() for k in ("router_logits", "e_score_correction_bias", "token_valid"))
    T, E = logits.shape
    K, G, TG = int(params["top_k"]), int(params["n_group"]), int(params["topk_group"])
    if E % G or TG > G or K > TG * (E // G):
        raise ValueError(f"k3_moe_dispatch reference: E={E}, n_group={G}, topk_group={TG}, top_k={K} are "
                         "inconsistent; need E % n_group == 0, topk_group <= n_group, top_k <= topk_group*E/n_group.")
    weights = torch.zeros(T, K, dtype=torch.float32)
    ids = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):
        if bool(valid[t]):
            row_ids = _descending(masked_choice(logits[t], bias, G, TG))[:K]
            ids[t] = torch.tensor(row_ids, dtype=torch.int32)
            weights[t] = expert_weights(logits[t], row_ids, bool(params["renormalize"]),
                                        float(params["routed_scaling_factor"]))
    return {"topk_weights": weights, "topk_ids": ids, **align(ids, E, int(params["block_size"]))}


def _short(xs: list[int], n: int = 8) -> str:
    return "[" + ", ".join(map(str, xs[:n])) + (f", ... ({len(xs)} in all)]" if len(xs) > n else "]")


def _add(msgs: list[str], name: str, items: list[str]) -> None:
    """Append up to ``_PER_OUTPUT`` element mismatches of one output, then a count line."""
    msgs.extend(items[:_PER_OUTPUT])
    if len(items) > _PER_OUTPUT:
        msgs.append(f"{name}: {len(items) - _PER_OUTPUT} more mismatching elements not listed")


def _not_a_top_k(c: torch.Tensor, got_ids: list[int], want_ids: list[int]) -> str | None:
    """Why ``got_ids`` is not a valid top-K of the masked scores ``c`` (``None`` when it is).

    Valid: the same set as ``want_ids`` (a top-K of ``c``), or a near-tie swap: the K-th and (K+1)-th
    scores closer than ``NEAR_TIE_REL * max|c|`` and every swapped expert inside
    ``[c_(K+1) - w, c_(K) + w]``.

    Source: kernel_targets.md §3.5.
    """
    if set(got_ids) == set(want_ids):
        return None
    K, E = len(want_ids), c.numel()
    vals = torch.sort(c, descending=True).values
    v_k = float(vals[K - 1])
    v_k1 = float(vals[K]) if K < E else float("-inf")
    finite = c[torch.isfinite(c)]
    window = NEAR_TIE_REL * float(finite.abs().max())
    outside = sorted(e for e in set(got_ids) ^ set(want_ids) if not v_k1 - window <= float(c[e]) <= v_k + window)
    if v_k - v_k1 < window and not outside:
        return None
    return (f"experts {outside} lie outside the tie window [{v_k1 - window:.9g}, {v_k + window:.9g}]"
            if v_k - v_k1 < window else f"not a near-tie: K-th/(K+1)-th biased gap {v_k - v_k1:.3g} >= {window:.3g}")


def _check_row(t: int, inputs, params, got_ids: list[int], got_w: torch.Tensor, want_ids: list[int],
               want_w: torch.Tensor, tol) -> tuple[list[str], list[str]]:
    """(topk_ids mismatches, topk_weights mismatches) of one valid row; no ids mismatch = row accepted."""
    logits, bias = inputs["router_logits"][t], inputs["e_score_correction_bias"]
    E, K = logits.numel(), len(want_ids)
    bad = sorted({e for e in got_ids if not 0 <= e < E})
    dupes = sorted(e for e, n in Counter(got_ids).items() if n > 1)
    if bad or dupes:
        nonfinite = [f"topk_weights[{t},{k}]: expected a finite weight, got {float(x)}"
                     for k, x in enumerate(got_w.tolist()) if not torch.isfinite(torch.tensor(x))]
        return [f"topk_ids[{t}]: expected {K} distinct experts in [0, {E}) (want {_short(sorted(want_ids))}), "
                f"got {got_ids}" + (f"; out of range {bad}" if bad else "") + (f"; duplicated {dupes}" if dupes else "")], nonfinite
    expected = dict(zip(want_ids, want_w.tolist()))
    if set(got_ids) != set(want_ids):
        G, TG = int(params["n_group"]), int(params["topk_group"])
        choice = torch.sigmoid(logits.float()) + bias.float()
        per_group = E // G
        sets, tied = group_choices(choice, G, TG, {e // per_group for e in got_ids})
        problems = []
        for kept in sets:  # the reference's groups first
            c = keep_groups(choice, G, kept) if G > 1 else choice
            problem = _not_a_top_k(c, got_ids, _descending(c)[:K])
            if problem is None:
                break
            problems.append(problem)
        else:
            got_groups = sorted({e // per_group for e in got_ids})
            ties = ""
            if len(sets) > 1:
                ties = (f"; nor with groups {sets[1]} kept (groups {tied} tie at the topk_group boundary): "
                        f"{problems[1]}" + (f" ({len(sets) - 2} other choices fail too)" if len(sets) > 2 else ""))
            elif tied:
                ties = f"; groups {tied} tie at the topk_group boundary, but the candidate's experts lie in groups {got_groups}"
            # whole lists (top-k <= 32): cut to 8, a difference past the 8th expert left both reading the same
            k = max(len(want_ids), len(got_ids))
            return [f"topk_ids[{t}]: missing experts {sorted(set(want_ids) - set(got_ids))}, extra "
                    f"{sorted(set(got_ids) - set(want_ids))} (expected {_short(sorted(want_ids), k)} in any order, got "
                    f"{_short(sorted(got_ids), k)}); {problems[0]}{ties}"], []
        # A legit tie swap (of experts or of groups): the weights of got's set are recomputed from the inputs.
        recomputed = expert_weights(logits, got_ids, bool(params["renormalize"]), float(params["routed_scaling_factor"]))
        expected = dict(zip(got_ids, recomputed.tolist()))
    exp_w = torch.tensor([expected[e] for e in got_ids], dtype=torch.float32)
    close = torch.isclose(got_w, exp_w, rtol=tol.rtol, atol=tol.atol)
    return [], [f"topk_weights[{t},{k}] (expert {got_ids[k]}): expected {float(exp_w[k]):.9g}, got {float(got_w[k]):.9g} "
                f"(rtol {tol.rtol:g}, atol {tol.atol:g})" for k in range(len(got_ids)) if not bool(close[k])]


def _rows_equal_to_want(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], valid: torch.Tensor,
                        E: int, weights_ok: bool, tol) -> torch.Tensor:
    """(T,) bool: the valid rows whose ids are want's set (each id once, in [0, E)) with every weight
    ``torch.isclose`` to want's for the same expert. For such a row :func:`_check_row` has nothing to say
    (the same set passes its id checks; its weight check compares the same pairs), so :func:`check` accepts
    it without the per-row walk; every other row takes the walk. Vectorized over rows: with
    :func:`_alignment_equal`, a correct candidate's 62 configurations x 3 calls are checked in 0.20 s
    instead of 1.74 s (``bench/results/cpu/moe_check_speed_session26.json``, 2-core CPU, loaded)."""
    g_ids, w_ids = got["topk_ids"].long(), want["topk_ids"].long()
    g_sorted, g_order = torch.sort(g_ids, dim=1, stable=True)
    w_sorted, w_order = torch.sort(w_ids, dim=1, stable=True)
    rows = valid.bool() & (g_sorted == w_sorted).all(dim=1) & ((w_sorted >= 0) & (w_sorted < E)).all(dim=1)
    if w_sorted.shape[1] > 1:
        rows &= (w_sorted[:, 1:] != w_sorted[:, :-1]).all(dim=1)  # distinct ids
    if weights_ok:
        g_w = torch.gather(got["topk_weights"], 1, g_order)
        w_w = torch.gather(want["topk_weights"], 1, w_order)
        rows &= torch.isclose(g_w, w_w, rtol=tol.rtol, atol=tol.atol).all(dim=1)
    return rows


def _alignment_equal(ids: torch.Tensor, valid: torch.Tensor, E: int, B: int, got: Mapping[str, torch.Tensor]) -> bool:
    """Whether got's three alignment outputs are :func:`align`'s over the routing ``ids`` of the valid rows up
    to the order inside each expert's segment (the order the contract leaves free): then
    :func:`_check_alignment` has nothing to say (every segment holds its members and sentinels, the tail
    only sentinels, so each valid flat index appears once) and :func:`check` skips its per-expert walk;
    ``False`` sends it there to say what differs. Vectorized; source as :func:`_check_alignment`."""
    T, K = ids.shape
    numel = T * K
    flat = ids.reshape(-1).long()
    routed = valid.bool().repeat_interleave(K) & (flat >= 0) & (flat < E)
    counts = torch.bincount(flat[routed], minlength=E)
    padded = (counts + B - 1) // B * B
    total = int(padded.sum())
    sti, eids, n = (got[k].reshape(-1).long() for k in ("sorted_token_ids", "expert_ids", "num_tokens_post_padded"))
    if n.numel() != 1 or int(n[0]) != total or total > sti.numel() or total // B > eids.numel():
        return False
    want_blocks = torch.full_like(eids, -1)
    want_blocks[:total // B] = torch.repeat_interleave(torch.arange(E), padded // B)
    if not torch.equal(eids, want_blocks) or not bool((sti[total:] == numel).all()):
        return False
    head = sti[:total]
    if bool(((head < 0) | (head > numel)).any()):
        return False
    # align()'s layout: members of each expert ascending (flat index order), then sentinels; got's segments
    # sorted by (expert, value) must equal it
    index = torch.arange(numel)[routed]
    seg_of_member = flat[routed]
    order = torch.sort(seg_of_member * (numel + 1) + index, stable=True).indices
    want_head = torch.full((total,), numel, dtype=torch.long)
    starts = torch.cumsum(padded, 0) - padded
    members_sorted = index[order]
    experts_sorted = seg_of_member[order]
    rank_in_segment = torch.arange(members_sorted.numel()) - (torch.cumsum(counts, 0) - counts)[experts_sorted]
    want_head[starts[experts_sorted] + rank_in_segment] = members_sorted
    segment = torch.repeat_interleave(torch.arange(E), padded)
    got_head = torch.sort(segment * (numel + 1) + head, stable=True).values - segment * (numel + 1)
    return torch.equal(got_head, want_head)


def _check_alignment(msgs: list[str], ids: torch.Tensor, valid: torch.Tensor, E: int, B: int,
                     got: Mapping[str, torch.Tensor], ok: Mapping[str, bool]) -> None:
    """Alignment invariants against the routing ``ids`` (got's own, so a legit swap does not cascade)."""
    if ok["num_tokens_post_padded"] and ok["expert_ids"] and ok["sorted_token_ids"] and _alignment_equal(ids, valid, E, B, got):
        return
    T, K = ids.shape
    numel = T * K
    members: list[list[int]] = [[] for _ in range(E)]
    for i, e in enumerate(ids.reshape(-1).tolist()):
        if bool(valid[i // K]) and 0 <= e < E:
            members[e].append(i)
    padded = [-(-len(m) // B) * B for m in members]
    starts = [0, *accumulate(padded)][:E]  # segments in ascending expert order
    total = sum(padded)
    if ok["num_tokens_post_padded"]:
        n = int(got["num_tokens_post_padded"][0])
        if n != total:
            msgs.append(f"num_tokens_post_padded[0]: expected {total} (sum of ceil(count_e/{B})*{B}), got {n}")
    if ok["expert_ids"]:
        exp_blocks = [-1] * got["expert_ids"].numel()
        for e in range(E):
            exp_blocks[starts[e] // B:(starts[e] + padded[e]) // B] = [e] * (padded[e] // B)
        items = [f"expert_ids[{b}]: expected {x}, got {y}" + (f" (block past the padded total {total})" if x == -1 else "")
                 for b, (x, y) in enumerate(zip(exp_blocks, got["expert_ids"].tolist())) if x != y]
        _add(msgs, "expert_ids", items)
    if not ok["sorted_token_ids"]:
        return
    s = got["sorted_token_ids"].tolist()
    items = []
    for e in range(E):
        if not members[e]:
            continue
        end = starts[e] + padded[e]
        want_c = Counter(members[e]) + Counter({numel: end - starts[e] - len(members[e])})
        got_c = Counter(s[starts[e]:end])
        if got_c != want_c:
            items.append(f"sorted_token_ids[{starts[e]}:{end}] (expert {e} segment): expected flat indices "
                         f"{_short(members[e])} + {end - starts[e] - len(members[e])} x sentinel {numel} (order free); "
                         f"missing {_short(sorted((want_c - got_c).elements()))}, unexpected {_short(sorted((got_c - want_c).elements()))}")
    items += [f"sorted_token_ids[{p}]: expected sentinel {numel} (past the padded total {total}), got {x}"
              for p, x in enumerate(s[total:], start=total) if x != numel]
    _add(msgs, "sorted_token_ids", items)
    seen = Counter(s)
    flat = [i for e in range(E) for i in members[e]]
    missing, twice = sorted(i for i in flat if seen[i] == 0), sorted(i for i in flat if seen[i] > 1)
    if missing or twice:
        msgs.append(f"sorted_token_ids: every valid flat index must appear exactly once; missing {_short(missing)}, "
                    f"more than once {_short(twice)}")


def check(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any], got: Mapping[str, torch.Tensor],
          want: Mapping[str, torch.Tensor], tolerance: Mapping[str, Any]) -> list[str]:
    """Compare a candidate's outputs with :func:`reference`'s under the §3.5 rules.

    ids are compared as sets per row (order free, no duplicates, -1 on padding rows); a swap is
    allowed only in near-tie rows (K-th and (K+1)-th masked biased scores closer than
    ``NEAR_TIE_REL * max|c|``) and only for experts inside ``[c_(K+1) - w, c_(K) + w]``; with
    grouping, groups whose scores tie at the topk_group boundary may be kept in any valid
    combination (:func:`group_choices`), and got's set must then be such a top-K of the experts of
    some valid combination; weights are matched per expert id with ``torch.isclose`` (recomputed for
    got's set after a legit swap of experts or groups); the
    alignment is checked as invariants over got's own ids (the reference's in rows whose ids are
    rejected, so one wrong row is not reported twice), segments located from the counts.

    Args:
        inputs: as for :func:`reference`.
        params: as for :func:`reference`.
        got: the candidate's five outputs (name -> tensor).
        want: :func:`reference`'s outputs for the same inputs.
        tolerance: output name -> object with ``rtol``, ``atol``, ``exact``, ``source``.

    Returns:
        One-line mismatch descriptions (output, index, expected, got), at most ``MAX_MESSAGES`` + 1;
        empty when the candidate is correct.

    Source: kernel_targets.md §3.5; task.toml [correctness.tolerance]; issue 12 (group-score ties).
    """
    cpu = lambda d: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in d.items()}  # noqa: E731
    inputs, got, want = cpu(inputs), cpu(got), cpu(want)  # the candidate may have run on a GPU
    msgs: list[str] = []
    ok = {}
    for name in OUTPUTS:
        g, w = got.get(name), want[name]
        ok[name] = isinstance(g, torch.Tensor) and g.shape == w.shape and g.dtype == w.dtype
        if not ok[name]:
            desc = "missing" if g is None else f"{tuple(g.shape)} {g.dtype}" if isinstance(g, torch.Tensor) else type(g).__name__
            msgs.append(f"{name}: expected shape {tuple(w.shape)} dtype {w.dtype}, got {desc}")
    valid = inputs["token_valid"]
    E = inputs["router_logits"].shape[1]
    accepted: list[int] = []
    if ok["topk_ids"]:
        id_items, w_items = [], []
        equal_rows = _rows_equal_to_want(got, want, valid, E, ok["topk_weights"], tolerance["topk_weights"]).tolist()
        for t in range(valid.numel()):
            if equal_rows[t]:
                accepted.append(t)
                continue
            g_ids, g_w = got["topk_ids"][t].tolist(), got["topk_weights"][t] if ok["topk_weights"] else None
            if not bool(valid[t]):
                id_items += [f"topk_ids[{t},{k}]: padding row (token_valid False): expected -1, got {e}"
                             for k, e in enumerate(g_ids) if e != -1]
                if g_w is not None:
                    w_items += [f"topk_weights[{t},{k}]: padding row: expected 0, got {float(x):.9g}"
                                for k, x in enumerate(g_w) if not float(x) == 0.0]
                continue
            if g_w is None:
                g_w = torch.zeros(len(g_ids))
            ids_m, w_m = _check_row(t, inputs, params, g_ids, g_w, want["topk_ids"][t].tolist(),
                                    want["topk_weights"][t], tolerance["topk_weights"])
            id_items += ids_m
            accepted += [] if ids_m else [t]
            w_items += w_m if ok["topk_weights"] else []
        _add(msgs, "topk_ids", id_items)
        _add(msgs, "topk_weights", w_items)
    # Alignment follows got's ids in accepted rows (a legit swap must not cascade), want's elsewhere.
    ids_for_align = want["topk_ids"].clone()
    for t in accepted:
        ids_for_align[t] = got["topk_ids"][t]
    _check_alignment(msgs, ids_for_align, valid, E, int(params["block_size"]), got, ok)
    if len(msgs) > MAX_MESSAGES:
        msgs = msgs[:MAX_MESSAGES] + [f"... and {len(msgs) - MAX_MESSAGES} more mismatch lines"]
    return msgs


def canonical(outputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The outputs with every order the contract leaves free put in one order (for exact comparison).

    Rows of ``topk_ids`` are sorted (``topk_weights`` permuted with them). Each ``sorted_token_ids`` entry
    that names a slot (flat ``t*K+k``, whose position in the row is free) becomes the pair (token ``t``,
    the expert ``topk_ids`` holds in that slot): two layouts are the same answer only when every segment
    dispatches the same tokens *for the same experts* (session 26's red team: with token indices alone, a
    kernel naming the wrong slot of the right token, so the expert GEMM reads another expert's weight, was
    taken for the baseline's answer). Entries that name no slot (the sentinel, anything out of range) keep
    their value, marked apart. Within each expert's block segment the entries are sorted (a token meets an
    expert at most once). Two output sets with equal canonical forms, bit for bit, are the same answer; the
    perf guard uses this to accept a timed call whose outputs equal the baseline's for the same inputs
    without recomputing the reference (different forms get the full :func:`check`).

    Args:
        outputs: the five outputs (name -> tensor), as :func:`reference` returns them.
        params: as for :func:`reference` (``block_size`` is used).

    Returns:
        Tensors (name -> tensor) on the CPU; ``sorted_token_ids`` as (n, 3) int64 rows (names a slot: 1 or
        0, token or raw value, expert or -1), sorted within each segment.

    Source: kernel_targets.md §3.5 (order within a row and within a segment is free), §3.1 (the dispatch
    names (token, slot) pairs: ``sorted_token_ids // top_k`` is the token, the slot selects the expert).
    """
    ids, w = outputs["topk_ids"].cpu(), outputs["topk_weights"].cpu()
    ids_s, order = torch.sort(ids.long(), dim=1, stable=True)
    B = int(params["block_size"])
    K = ids.shape[1]
    sti, eids = outputs["sorted_token_ids"].cpu().long(), outputs["expert_ids"].cpu().long()
    sentinel = ids.numel()
    slot = (sti >= 0) & (sti < sentinel)
    token = torch.where(slot, sti // max(K, 1), sti)
    expert = (torch.where(slot, ids.reshape(-1).long()[sti.clamp(0, max(sentinel - 1, 0))], -1) if sentinel
              else torch.full_like(sti, -1))
    owner = eids.repeat_interleave(B)[: sti.numel()]
    if owner.numel() < sti.numel():
        owner = torch.cat([owner, torch.full((sti.numel() - owner.numel(),), -1, dtype=torch.long)])
    rows = torch.stack([slot.long(), token, expert], dim=1)
    perm = torch.arange(sti.numel())
    for key in (expert, token, slot.long(), owner):  # lexicographic (owner, slot, token, expert): stable passes
        perm = perm[torch.argsort(key[perm], stable=True)]
    return {"topk_ids": ids_s, "topk_weights": torch.gather(w, 1, order), "sorted_token_ids": rows[perm],
            "expert_ids": eids, "num_tokens_post_padded": outputs["num_tokens_post_padded"].cpu()}


# Metamorphic relations (task.toml [domain.invariances]; issue 19 item 2): the candidate's outputs on a
# transformed twin against its own outputs on the original, not against this reference.

PAIR_W_RTOL = 2e-6
"""Relative gap allowed between one token's weights on the original and on the twin (about 34 fp32 ulp).

Five times tighter than the reference's rtol 1e-5: a correct kernel computes the same token's weights
with the same arithmetic wherever it sits in the batch, except that vectorised code may round the last
elements of a buffer on a scalar path: torch 2.13's CPU sigmoid at T=33, E=60 differs by 1 ulp in the
last row's tail once the rows are permuted (measured for issue 19), which moves a weight by a few ulp;
a renormalising sum of K <= 32 weights added in another order moves it by at most K ulp (2e-6)."""
PAIR_W_ATOL = 1e-9
"""Absolute gap allowed on top (weights of experts with denormal scores, whose ulp is coarse relative)."""
PAIR_MAX_LINES = 6


def _tie_row(logits_row: torch.Tensor, bias: torch.Tensor, params: Mapping[str, Any]) -> bool:
    """Whether the checker lets a correct kernel choose among tied experts in this row: the K-th and
    (K+1)-th masked biased scores closer than ``NEAR_TIE_REL * max|c|`` (exact ties included), or groups
    tied at the topk_group boundary. Such rows may differ between the pair (a 1-ulp rounding that
    depends on the position in the buffer breaks a tie either way)."""
    G, TG, K = int(params["n_group"]), int(params["topk_group"]), int(params["top_k"])
    choice = torch.sigmoid(logits_row.float()) + bias.float()
    if G > 1 and group_choices(choice, G, TG)[1]:
        return True
    c = masked_choice(logits_row, bias, G, TG)
    if K >= c.numel():
        return False
    vals = torch.sort(c, descending=True).values
    finite = c[torch.isfinite(c)]
    window = NEAR_TIE_REL * float(finite.abs().max()) if finite.numel() else 0.0
    return float(vals[K - 1]) - float(vals[K]) < window or float(vals[K - 1]) == float(vals[K])


def _segments(out: Mapping[str, torch.Tensor], K: int, B: int, numel: int) -> dict[int, list[int]]:
    """Expert -> sorted token indices of its segment (flat ``t*K+k`` entries as tokens, sentinels left out)."""
    sti, eids = out["sorted_token_ids"].tolist(), out["expert_ids"].tolist()
    seg: dict[int, list[int]] = {}
    for b, e in enumerate(eids):
        if e < 0:
            continue
        seg.setdefault(e, []).extend(x // K for x in sti[b * B:(b + 1) * B] if 0 <= x < numel)
    return {e: sorted(ts) for e, ts in seg.items()}


def _pair_lines(inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor],
                twin_inputs: Mapping[str, torch.Tensor], twin_outputs: Mapping[str, torch.Tensor],
                perm: list[int], params: Mapping[str, Any], what: str) -> list[str]:
    """Twin row ``i`` is original token ``perm[i]``: its experts must be the same set (outside tie
    rows), its weights per expert within ``PAIR_W_RTOL``/``PAIR_W_ATOL``, padding rows -1 and 0, and,
    when every row's set matched, each expert's segment must hold the same tokens (mapped through
    ``perm``), ``expert_ids`` and ``num_tokens_post_padded`` equal."""
    cpu = lambda d: {k: v.detach().cpu() for k, v in d.items() if isinstance(v, torch.Tensor)}  # noqa: E731
    inputs, outputs, twin_inputs, twin_outputs = cpu(inputs), cpu(outputs), cpu(twin_inputs), cpu(twin_outputs)
    T, E = inputs["router_logits"].shape
    K, B = int(params["top_k"]), int(params["block_size"])
    for name in OUTPUTS:
        a, t = outputs.get(name), twin_outputs.get(name)
        if a is None or t is None or a.shape != t.shape:
            return []  # a missing or misshapen output is the reference check's to report
    msgs: list[str] = []
    all_same = True
    for i, j in enumerate(perm):
        a_ids, t_ids = outputs["topk_ids"][j].tolist(), twin_outputs["topk_ids"][i].tolist()
        where = f"twin row {i} (token {j} of the original{what})"
        if sorted(a_ids) != sorted(t_ids):
            all_same = False
            valid = bool(inputs["token_valid"][j])
            if valid and (_tie_row(inputs["router_logits"][j], inputs["e_score_correction_bias"], params)
                          or _tie_row(twin_inputs["router_logits"][i], twin_inputs["e_score_correction_bias"], params)):
                continue  # a choice among ties: each call is checked against the reference on its own
            msgs.append(f"topk_ids[{i}] of the twin, {where}: expected experts {sorted(a_ids)} (the candidate's own "
                        f"choice for this token on the original), got {sorted(t_ids)}")
            continue
        a_w = dict(zip(a_ids, outputs["topk_weights"][j].tolist()))
        for e, wt in zip(t_ids, twin_outputs["topk_weights"][i].tolist()):
            wa = a_w[e]
            if not abs(wt - wa) <= PAIR_W_RTOL * max(abs(wa), abs(wt)) + PAIR_W_ATOL:
                msgs.append(f"topk_weights[{i}] of the twin, expert {e}, {where}: expected {wa:.9g} (the candidate's "
                            f"own weight on the original), got {wt:.9g}; the pair allows rtol {PAIR_W_RTOL:g} + atol "
                            f"{PAIR_W_ATOL:g} (the reference check alone allows rtol 1e-5)")
                break
    if all_same and not msgs:
        numel = T * K
        seg_a, seg_t = _segments(outputs, K, B, numel), _segments(twin_outputs, K, B, numel)
        seg_t = {e: sorted(perm[i] for i in ts) for e, ts in seg_t.items()}
        for e in sorted(set(seg_a) | set(seg_t)):
            if seg_a.get(e, []) != seg_t.get(e, []):
                msgs.append(f"sorted_token_ids: expert {e}'s segment holds tokens {_short(seg_t.get(e, []))} on the "
                            f"twin (as original tokens{what}), expected {_short(seg_a.get(e, []))} (the candidate's own "
                            "segment on the original)")
                break
        for name in ("expert_ids", "num_tokens_post_padded"):
            if not torch.equal(outputs[name], twin_outputs[name]):
                diff = (outputs[name] != twin_outputs[name]).nonzero().flatten().tolist()
                msgs.append(f"{name}[{diff[0]}] of the twin: expected {int(outputs[name][diff[0]])} (the candidate's "
                            f"own value on the original; the routing is the same), got {int(twin_outputs[name][diff[0]])}")
    if len(msgs) > PAIR_MAX_LINES:
        msgs = msgs[:PAIR_MAX_LINES] + [f"... and {len(msgs) - PAIR_MAX_LINES} more broken expectations"]
    return msgs


def token_permutation_relation(inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor],
                               twin_inputs: Mapping[str, torch.Tensor], twin_outputs: Mapping[str, torch.Tensor],
                               info: Mapping[str, Any], params: Mapping[str, Any], tolerance: Mapping[str, Any]) -> list[str]:
    """Routing is per token: the candidate's output for a token must not depend on where it sits in the batch.

    With ``twin_inputs`` the original's rows in the order ``info["perm"]`` (twin row ``i`` = token
    ``perm[i]``): ``topk_ids`` rows equal as sets except in tie rows (:func:`_tie_row`, either input),
    ``topk_weights`` per expert within :data:`PAIR_W_RTOL` / :data:`PAIR_W_ATOL`, padding rows
    unchanged, and when every row matched the alignment the same up to the permutation: each expert's
    segment holds the same tokens, ``expert_ids`` and ``num_tokens_post_padded`` are equal. Flat
    indices ``t*K+k`` are compared as tokens (the slot order inside a row is free).

    Args:
        inputs, outputs: the original inputs and the candidate's five outputs on them.
        twin_inputs, twin_outputs: the permuted inputs and the candidate's outputs on them.
        info: ``{"perm": list of T ints}`` from ``inputs.permute_tokens``.
        params: as for :func:`reference`.
        tolerance: unused (the pair has its own, tighter bounds).

    Returns:
        One line per broken expectation (at most ``PAIR_MAX_LINES`` + 1); empty when consistent.

    Source: kernel_targets.md §3.1 (routing per token), §3.5 (tie rule); task.toml
    [domain.invariances.token_permutation]; :data:`PAIR_W_RTOL`.
    """
    return _pair_lines(inputs, outputs, twin_inputs, twin_outputs, list(info["perm"]), params, "")


def bias_shift_relation(inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor],
                        twin_inputs: Mapping[str, torch.Tensor], twin_outputs: Mapping[str, torch.Tensor],
                        info: Mapping[str, Any], params: Mapping[str, Any], tolerance: Mapping[str, Any]) -> list[str]:
    """Selection is invariant to one constant added to every bias, and weights use the unbiased scores.

    With ``twin_inputs`` the original with ``info["shift"]`` added to the bias: every row's
    ``topk_ids`` the same set except in tie rows (fp32 rounding of ``s + b + C`` may reorder near-ties:
    :func:`_tie_row` on either input), ``topk_weights`` per expert within :data:`PAIR_W_RTOL` /
    :data:`PAIR_W_ATOL`, and the alignment unchanged (same segments, ``expert_ids``,
    ``num_tokens_post_padded``).

    Args:
        inputs, outputs, twin_inputs, twin_outputs, params, tolerance: as for
            :func:`token_permutation_relation`.
        info: ``{"shift": C}`` from ``inputs.shift_bias``.

    Returns:
        One line per broken expectation; empty when consistent.

    Source: kernel_targets.md §3.1 (selection on s + b, weights from s); task.toml
    [domain.invariances.bias_shift].
    """
    T = int(inputs["router_logits"].shape[0])
    return _pair_lines(inputs, outputs, twin_inputs, twin_outputs, list(range(T)), params,
                       f", bias shifted by {float(info['shift']):g}")
