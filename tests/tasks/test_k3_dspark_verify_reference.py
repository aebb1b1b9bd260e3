"""tasks/k3_dspark_verify: the reference oracle, its checker (good and planted-bad outputs), the
standard path against it, and the input cases.

The task folder is not a package, so its modules are loaded by file path.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch

from k3_model.ops.dspark_verify import dspark_verify, dspark_verify_standard
from workbench.taskspec import eval_dim, load_task

REPO = Path(__file__).resolve().parents[2]
TASK_DIR = REPO / "tasks" / "k3_dspark_verify"
K3_VOCAB = 163840


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_k3_dspark_verify_{name}", TASK_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ref, inp = _load("reference"), _load("inputs")
SPEC = load_task(REPO, "k3_dspark_verify")
TOL = SPEC.correctness.tolerance
# Every workload except the big-vocabulary batches above 2 (their inputs alone take seconds to draw).
CHEAP = [w.name for w in SPEC.correctness.workloads if w.axes["V"] < K3_VOCAB or w.axes["B"] <= 2]


def _case(name: str, seed: int = 0):
    w = SPEC.workload(name)
    inputs = inp.make_inputs(w.axes, seed, w.case)
    params = {"max_draft_tokens": w.axes["D"]}
    return inputs, params, ref.reference(inputs, params)


def _standard(inputs: dict, params: dict, public: bool = False) -> dict:
    """The model's standard path, writing into outputs poisoned as the harness does."""
    B, D1, _ = inputs["target_logits"].shape
    outs = {"output_token_ids": torch.full((B, D1), -7777, dtype=torch.int32),
            "num_accepted_tokens": torch.full((B,), -7777, dtype=torch.int32)}
    fn = dspark_verify if public else dspark_verify_standard
    args = dict(inputs)
    if not public:
        args["draft_probs"] = inputs["draft_probs"] if inputs["draft_probs"].numel() else None
    fn(**args, **params, **outs)
    return outs


def _rows(out: dict) -> list[list[int]]:
    return out["output_token_ids"].tolist()


# ---------------------------------------------------------------- edge cases with values


def test_issue_mixed_batch_greedy_accepts_5_then_bonus_and_rejects_0_emitting_5() -> None:
    inputs, params, want = _case("edge_issue_mixed")
    logits = torch.tensor(inp.ISSUE_LOGITS, dtype=torch.float64)
    noise = inputs["exponential_noise"][1].double()
    # Row 1 (T=1, top-k 3): draft 0 lies outside {5, 7, 6}, so p(0) = 0 and it is rejected; the
    # recovered token is the race winner over p restricted to those ids (vocabulary ids).
    p = torch.zeros(8, dtype=torch.float64)
    p[[5, 6, 7]] = torch.softmax(logits[[5, 6, 7]], 0)
    recovered = int(torch.argmax(p / noise))
    assert recovered in (5, 6, 7)
    assert _rows(want) == [[5, 5], [recovered, -1], [5, -1], [5, 5]]
    assert want["num_accepted_tokens"].tolist() == [1, 0, 0, 1]
    got = _standard(inputs, params, public=True)
    assert _rows(got) == _rows(want) and got["num_accepted_tokens"].tolist() == [1, 0, 0, 1]


def test_greedy_temperature_zero_takes_the_argmax_path_without_dividing() -> None:
    inputs, params, want = _case("k3_b4_greedy")
    assert inputs["temperature"].tolist() == [0.0] * 4
    logits = inputs["target_logits"].float()
    for b in range(4):
        n = int(inputs["num_draft_tokens"][b])
        a = int(want["num_accepted_tokens"][b])
        argmax = logits[b].argmax(-1).tolist()
        drafts = inputs["draft_token_ids"][b].tolist()
        assert 0 <= a <= n <= 7
        assert drafts[:a] == argmax[:a] and (a == n or drafts[a] != argmax[a])
        assert _rows(want)[b] == argmax[:a + 1] + [-1] * (7 - a)
    got = _standard(inputs, params)
    assert torch.equal(got["output_token_ids"], want["output_token_ids"])


def test_zero_drafts_emit_only_the_bonus_at_column_0() -> None:
    inputs, params, want = _case("edge_zero_drafts")
    assert want["num_accepted_tokens"].tolist() == [0] * 8
    out = want["output_token_ids"]
    assert bool((out[:, 1:] == -1).all()) and bool((out[:, 0] >= 0).all())
    for b in range(8):
        if float(inputs["temperature"][b]) == 0.0:
            assert int(out[b, 0]) == int(inputs["target_logits"][b, 0].float().argmax())


def test_all_accepted_puts_the_bonus_at_column_n_and_none_accepted_stops_at_0() -> None:
    inputs, _, want = _case("edge_all_accepted_dp")
    n = inputs["num_draft_tokens"].tolist()
    assert want["num_accepted_tokens"].tolist() == n
    for b, nb in enumerate(n):
        row = _rows(want)[b]
        assert row[:nb] == inputs["draft_token_ids"][b, :nb].tolist() and row[nb] >= 0 and row[nb + 1:] == [-1] * (7 - nb)
    inputs, _, want = _case("edge_none_accepted")
    assert want["num_accepted_tokens"].tolist() == [0] * 8
    assert all(r[0] != d and r[1:] == [-1] * 7 for r, d in zip(_rows(want), inputs["draft_token_ids"][:, 0].tolist()))


def test_zero_draft_probability_rejects_and_may_recover_the_draft_itself() -> None:
    inputs, _, want = _case("edge_q_zero")
    q, drafts = inputs["draft_probs"], inputs["draft_token_ids"]
    hits = 0
    for b in range(8):
        a = int(want["num_accepted_tokens"][b])
        if a < int(inputs["num_draft_tokens"][b]) and float(q[b, a, drafts[b, a]]) == 0.0:
            hits += 1
        assert all(float(q[b, i, drafts[b, i]]) > 0 for i in range(a))  # q(d) = 0 never accepted
    assert hits >= 3
    recovered_draft = [b for b in range(8) if int(want["num_accepted_tokens"][b]) < 7
                       and _rows(want)[b][int(want["num_accepted_tokens"][b])] == int(drafts[b, int(want["num_accepted_tokens"][b])])]
    assert recovered_draft, "with q(d) = 0 the residual keeps p(d): the draft itself should be recovered somewhere"


def test_greedy_ties_accept_only_the_lowest_tied_id() -> None:
    inputs, _, want = _case("edge_greedy_ties")
    logits = inputs["target_logits"].float()
    for b in range(8):
        a = int(want["num_accepted_tokens"][b])
        for i in range(a + 1):
            top = torch.nonzero(logits[b, i] == logits[b, i].max()).flatten().tolist()
            assert _rows(want)[b][i] == top[0]
    assert any(int(want["num_accepted_tokens"][b]) < int(inputs["num_draft_tokens"][b]) for b in range(8))


def test_target_dist_top_k_keeps_ties_and_top_p_keeps_tie_groups() -> None:
    d = ref.target_dist(torch.tensor([0.0, 1.0, 2.0, 2.0, 3.0]), 1.0, 2, 1.0)
    e = math.exp
    z = e(2) + e(2) + e(3)  # the 2nd largest logit (2.0) is tied: both kept
    assert d.p.tolist() == pytest.approx([0, 0, e(2) / z, e(2) / z, e(3) / z], rel=1e-12)
    logits = torch.log(torch.tensor([0.4, 0.3, 0.3], dtype=torch.float64))
    assert ref.target_dist(logits, 1.0, 0, 0.45).p.tolist() == pytest.approx([0.4, 0.3, 0.3])  # 0.4 < 0.45: tie group kept
    assert ref.target_dist(logits, 1.0, 0, 0.35).p.tolist() == pytest.approx([1.0, 0.0, 0.0])  # 0.4 >= 0.35: both dropped
    half = ref.target_dist(torch.tensor([0.0, 1.0]), 0.5, 0, 1.0).p
    assert half.tolist() == pytest.approx([1 / (1 + e(2)), e(2) / (1 + e(2))])


def test_params_sweep_extremes() -> None:
    inputs, _, want = _case("edge_params_sweep")
    logits = inputs["target_logits"].float()
    for b in (0, 3):  # top-k 1 and top-p 0.01: only the favourite survives, every emitted token is it
        a = int(want["num_accepted_tokens"][b])
        assert _rows(want)[b][: a + 1] == logits[b, : a + 1].argmax(-1).tolist()


# ---------------------------------------------------------------- reference == standard path


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if SPEC.workload(n).axes["V"] == K3_VOCAB else n
                                  for n in CHEAP])
def test_standard_path_matches_reference_exactly(name: str) -> None:
    inputs, params, want = _case(name)
    got = _standard(inputs, params, public=True)
    assert torch.equal(got["output_token_ids"], want["output_token_ids"]), name
    assert torch.equal(got["num_accepted_tokens"], want["num_accepted_tokens"]), name
    assert ref.check(inputs, params, got, want, TOL) == []


def test_batch_mates_rows_are_identical() -> None:
    for name in ("edge_batch_mates", "edge_batch_mates_dp"):
        inputs, params, want = _case(name)
        B = inputs["target_logits"].shape[0]
        rows = _rows(want)
        assert rows[0] == rows[B // 2] == rows[B - 1]
        assert _rows(_standard(inputs, params)) == rows


def _select(inputs: dict, idx: list[int]) -> dict:
    out = {}
    for k, v in inputs.items():
        out[k] = v if (k == "draft_probs" and v.numel() == 0) else v[idx].contiguous()
    return out


@pytest.mark.parametrize("name", ["v4k_b16_dp", "v4k_b32", "edge_params_sweep"])
def test_a_request_never_depends_on_its_batch_mates(name: str) -> None:
    """Each request run alone, and in the batch in reverse order, gives its row of the full batch."""
    inputs, params, _ = _case(name)
    B = inputs["target_logits"].shape[0]
    full = _standard(inputs, params)
    rev = _standard(_select(inputs, list(range(B))[::-1]), params)
    assert torch.equal(rev["output_token_ids"].flip(0), full["output_token_ids"])
    for b in range(B):
        alone = _standard(_select(inputs, [b]), params)
        assert _rows(alone)[0] == _rows(full)[b], f"request {b} alone differs from its row in the batch"
        assert int(alone["num_accepted_tokens"][0]) == int(full["num_accepted_tokens"][b])


def test_reference_rejects_out_of_contract_values() -> None:
    inputs, params, _ = _case("v4k_b4")
    for key, value, what in (("temperature", -1.0, "temperature"), ("num_draft_tokens", 8, "num_draft_tokens"),
                             ("top_p", 0.0, "top_p")):
        bad = {k: v.clone() for k, v in inputs.items()}
        bad[key][0] = value
        with pytest.raises(ValueError, match=what):
            ref.reference(bad, params)


def test_every_spelling_of_top_k_off_is_legal_and_means_off() -> None:
    """The contract: ``0 < k < V`` keeps the k largest, any other int32 is off (vLLM's old -1 too). Session
    12's red team: a kernel cutting ``top_k = -1`` rows to their top-1 passed, since the reference refused -1
    and no draw held it; now the reference computes it and the draws hold every spelling."""
    inputs, params, _ = _case("v4k_b4")
    V = inputs["target_logits"].shape[-1]
    outs = []
    for off in inp.off_top_ks(V):
        x = {k: v.clone() for k, v in inputs.items()}
        x["top_k"][:] = off
        outs.append(ref.reference(x, params))
    for o in outs[1:]:
        assert all(torch.equal(o[k], outs[0][k]) for k in o)
    drawn = {int(k) for s in range(30) for k in inp.make_inputs({"B": 8, "D": 7, "V": 1024, "Q": 1}, s, "realistic")["top_k"]}
    assert {0, -1, 1024, 2**31 - 1} <= drawn


def test_public_op_rejects_inconsistent_shapes() -> None:
    inputs, params, _ = _case("v4k_b4")
    outs = {"output_token_ids": torch.empty(4, 8, dtype=torch.int32), "num_accepted_tokens": torch.empty(4, dtype=torch.int32)}
    with pytest.raises(ValueError, match="max_draft_tokens"):
        dspark_verify(**inputs, max_draft_tokens=6, **outs)
    with pytest.raises(ValueError, match="uniform_draws"):
        dspark_verify(**{**inputs, "uniform_draws": inputs["uniform_draws"].double()}, **params, **outs)


# ---------------------------------------------------------------- the checker


def _sampled_row_with_reject(inputs, want) -> int:
    for b in range(inputs["target_logits"].shape[0]):
        a = int(want["num_accepted_tokens"][b])
        if float(inputs["temperature"][b]) > 0 and a < int(inputs["num_draft_tokens"][b]):
            return b
    raise AssertionError("no sampled row with a rejection in this case")


def _greedy_row(inputs) -> int:
    return int(torch.nonzero(inputs["temperature"] == 0.0)[0])


def _plant(kind: str, inputs: dict, want: dict) -> dict:
    got = {k: v.clone() for k, v in want.items()}
    out, acc = got["output_token_ids"], got["num_accepted_tokens"]
    V = inputs["target_logits"].shape[-1]
    if kind == "greedy_wrong_token":
        b = _greedy_row(inputs)
        a = int(acc[b])
        out[b, a] = (out[b, a] + 1) % V
    elif kind == "recovered_wrong_token":
        b = _sampled_row_with_reject(inputs, want)
        a = int(acc[b])
        out[b, a] = (out[b, a] + 1) % V
    elif kind == "accepts_past_rejection":
        b = _sampled_row_with_reject(inputs, want)
        a = int(acc[b])
        out[b, a] = inputs["draft_token_ids"][b, a]
        acc[b] = a + 1
    elif kind == "wrong_accepted_count":
        acc[0] += 1
    elif kind == "padding_not_minus_one":
        b = int(torch.nonzero(acc < 6)[0])
        out[b, 7] = 0
    elif kind == "rows_swapped":
        b0, b1 = _greedy_row(inputs), _sampled_row_with_reject(inputs, want)
        out[[b0, b1]] = out[[b1, b0]]
        acc[[b0, b1]] = acc[[b1, b0]]
    elif kind == "poison":
        out.fill_(-7777)
        acc.fill_(-7777)
    elif kind == "wrong_dtype":
        got["output_token_ids"] = out.long()
    return got


PLANTED = ["greedy_wrong_token", "recovered_wrong_token", "accepts_past_rejection", "wrong_accepted_count",
           "padding_not_minus_one", "rows_swapped", "poison", "wrong_dtype"]


@pytest.mark.parametrize("kind", PLANTED)
def test_check_catches_planted_error(kind: str) -> None:
    inputs, params, want = _case("v4k_b32", seed=1)
    msgs = ref.check(inputs, params, _plant(kind, inputs, want), want, TOL)
    assert msgs, kind
    assert all(isinstance(m, str) and m for m in msgs) and len(msgs) <= ref.MAX_MESSAGES + 1


def test_check_catches_position_instead_of_vocab_id() -> None:
    inputs, params, want = _case("edge_issue_mixed")
    got = {k: v.clone() for k, v in want.items()}
    got["output_token_ids"][1, 0] = 0  # position 0 of the top-3 list instead of its id
    msgs = ref.check(inputs, params, got, want, TOL)
    assert msgs and "output_token_ids[1]" in msgs[0] and "expected the residual race winner" in msgs[0]


def test_check_accepts_either_outcome_only_at_the_rounding_boundary() -> None:
    """u placed exactly at p(d) (one-hot draft): accept and reject are both right; far from it, not."""
    inputs, params, _ = _case("edge_issue_mixed")
    inputs = {k: v.clone() for k, v in inputs.items()}
    inputs["top_k"][1] = 0
    inputs["draft_token_ids"][1, 0] = 7
    p7 = float(ref.target_dist(inputs["target_logits"][1, 0], 1.0, 0, 1.0).p[7])
    inputs["uniform_draws"][1, 0] = p7 * (1 + 1e-6)  # just above: the reference rejects
    want = ref.reference(inputs, params)
    assert int(want["num_accepted_tokens"][1]) == 0
    accepted = {k: v.clone() for k, v in want.items()}
    accepted["output_token_ids"][1] = torch.tensor([7, int(ref.race_winner(
        ref.target_dist(inputs["target_logits"][1, 1], 1.0, 0, 1.0).p, inputs["exponential_noise"][1]))])
    accepted["num_accepted_tokens"][1] = 1
    assert ref.check(inputs, params, accepted, want, TOL) == []
    inputs["uniform_draws"][1, 0] = p7 * 1.01  # 1% away: accepting is wrong
    want = ref.reference(inputs, params)
    assert ref.check(inputs, params, accepted, want, TOL)


def test_check_reports_the_expected_row() -> None:
    inputs, params, want = _case("edge_issue_mixed")
    got = {k: v.clone() for k, v in want.items()}
    got["output_token_ids"][0] = torch.tensor([0, -1], dtype=torch.int32)
    got["num_accepted_tokens"][0] = 0
    msgs = ref.check(inputs, params, got, want, TOL)
    assert msgs == ["output_token_ids[0] (greedy, n_b=1): column 0 (greedy): draft 5 is the target argmax and must "
                    "be accepted, got 0; expected row [5, 5], got [0, -1]"]


# ---------------------------------------------------------------- inputs


@pytest.mark.parametrize("name", [n for n in CHEAP if SPEC.workload(n).axes["V"] < K3_VOCAB])
def test_make_inputs_deterministic_and_well_formed(name: str) -> None:
    w = SPEC.workload(name)
    a, b, c = (inp.make_inputs(w.axes, s, w.case) for s in (5, 5, 6))
    assert set(a) == set(SPEC.inputs)
    for k, spec in SPEC.inputs.items():
        assert tuple(a[k].shape) == tuple(eval_dim(d, w.axes) for d in spec.shape) and a[k].dtype == getattr(torch, spec.dtype)
        assert torch.equal(a[k], b[k]), k
    assert any(not torch.equal(a[k], c[k]) for k in a)
    n = a["num_draft_tokens"]
    assert bool(((n >= 0) & (n <= w.axes["D"])).all())
    cols = torch.arange(w.axes["D"]).view(1, -1)
    assert bool((a["draft_token_ids"][cols >= n.view(-1, 1)] == -1).all())
    live = a["draft_token_ids"][cols < n.view(-1, 1)]
    assert bool(((live >= 0) & (live < w.axes["V"])).all())
    assert bool((a["exponential_noise"] > 0).all()) and bool(((a["uniform_draws"] >= 0) & (a["uniform_draws"] < 1)).all())


@pytest.mark.slow
def test_realistic_inputs_are_peaked_long_tailed_and_drafts_agree_often() -> None:
    x = inp.make_inputs({"B": 64, "D": 7, "V": 32768, "Q": 2}, 3, "realistic")
    logits = x["target_logits"].float()[:, :7]
    p = logits.softmax(-1)
    top = p.amax(-1)
    assert 0.45 < float(top.median()) < 0.95  # peaked, not one-hot
    assert float((top < 0.3).float().mean()) > 0.05  # some flat positions
    tail = 1 - p.topk(100, dim=-1).values.sum(-1)
    assert float(tail.median()) > 1e-4  # a long tail carries real mass
    temp = x["temperature"]
    assert 0.2 < float((temp == 0).float().mean()) < 0.6
    listed = {round(t, 6) for t in temp[temp > 0].tolist()} & set(inp.TEMPERATURES)
    smooth = [t for t in temp[temp > 0].tolist() if round(t, 6) not in inp.TEMPERATURES]
    lo, hi = inp.TEMPERATURE_RANGE  # the continuous half (session 20: low temperatures were never drawn)
    assert listed and smooth and all(lo <= t <= hi for t in smooth) and min(smooth) < 0.3
    k = x["top_k"][(x["top_k"] > 0) & (x["top_k"] < 32768)]
    assert int(k.max()) > 256 and set(k.tolist()) - set(inp.TOP_KS)  # top-k over the whole range, not just listed
    q = x["draft_probs"]
    overlap = torch.minimum(p, q).sum(-1)  # per-position acceptance probability of a sampled draft
    assert 0.4 < float(overlap.mean()) < 0.9
    y = inp.make_inputs({"B": 64, "D": 7, "V": 32768, "Q": 1}, 3, "greedy")
    agree = (y["draft_token_ids"] == y["target_logits"].float()[:, :7].argmax(-1)).float()
    live = torch.arange(7).view(1, -1) < y["num_draft_tokens"].view(-1, 1)
    assert 0.7 < float(agree[live].mean()) < 0.97


def test_sampling_knobs_reach_low_temperatures_and_deep_top_k_on_logits_where_they_matter() -> None:
    x = inp.make_inputs({"B": 64, "D": 7, "V": 4096, "Q": 1}, 5, "sampling_knobs")
    t, k = x["temperature"], x["top_k"]
    assert (t > 0).all() and float(t.min()) < 0.1 and float(t.max()) > 1.0
    assert int(((k > 512) & (k < 4096)).sum()) >= 8 and int((k == 0).sum()) >= 8
    p = x["target_logits"].float()[:, :7].softmax(-1)
    assert float((1 - p.topk(256, dim=-1).values.sum(-1)).median()) > 0.5  # the tail past rank 256 holds mass
    top2 = x["target_logits"].float()[:, :7].topk(2, dim=-1).values
    assert float((top2[..., 0] - top2[..., 1]).median()) < 0.5  # close favourites: low T is not greedy


@pytest.mark.parametrize(("case", "axes"), [("nope", {"B": 4, "D": 7, "V": 64, "Q": 1}),
                                            ("issue_mixed", {"B": 4, "D": 7, "V": 8, "Q": 1}),
                                            ("q_zero", {"B": 4, "D": 7, "V": 64, "Q": 1}),
                                            ("batch_mates", {"B": 4, "D": 7, "V": 64, "Q": 1})])
def test_make_inputs_rejects_unknown_or_unusable_case(case: str, axes: dict) -> None:
    with pytest.raises(ValueError, match=case if case != "nope" else "unknown input case"):
        inp.make_inputs(axes, 0, case)
