"""k3_dspark_verify: the emitted tokens follow the target distribution (Leviathan et al. 2023, Thm 1).

N independent trials are N requests of one batch (rows never depend on their batch mates, tested in
test_k3_dspark_verify_reference.py): the same target logits, drafts drawn from q per trial, fresh
draws u and E per trial. Over V = 8 tokens, with temperature, top-k and top-p applied to the target:

* column 0 is distributed as p_0, whatever q is (with draft probabilities, and with one-hot drafts
  whose true draft distribution is hidden from the verifier);
* given that draft 0 was accepted, column 1 is distributed as p_1;
* the acceptance rate of draft 0 is sum_t min(p_0(t), q_0(t)) (one-hot: sum_t q_0(t) p_0(t)).

Bound on the total-variation distance TV = 1/2 sum_t |f_t - p_t| of an N-sample histogram f:
E[TV] <= 1/2 sum_t sqrt(p_t (1 - p_t) / N) <= 1/2 sqrt((V - 1) / N) (Cauchy-Schwarz with
sum_t p_t (1 - p_t) <= 1 - 1/V), and TV changes by at most 1/N when one sample changes, so by
McDiarmid's inequality P(TV >= E[TV] + t) <= exp(-2 N t^2); with t = sqrt(ln(1/delta) / (2 N)) and
delta = 1e-6 the test fails a correct sampler with probability below 1e-6:
``bound(N) = 1/2 sqrt((V - 1) / N) + sqrt(ln(1e6) / (2 N))`` (0.0069 at N = 400000, V = 8).
A sampler that resamples from p instead of the residual is off by more than 0.05 here (checked below:
the test has power).

Source: kernel_targets.md §2.6 (TV of the emitted histogram vs p over 1e5-1e6 trials, acceptance
rate within 3 sigma of sum min(p, q)); McDiarmid (1989), "On the method of bounded differences".
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from k3_model.ops.dspark_verify import dspark_verify_standard

TASK_DIR = Path(__file__).resolve().parents[2] / "tasks" / "k3_dspark_verify"
_spec = importlib.util.spec_from_file_location("_k3_dspark_verify_reference_stats", TASK_DIR / "reference.py")
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

V, D, N = 8, 2, 400_000
LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0],
                       [0.0, 2.5, -1.0, 1.0, 0.3, 0.2, -2.0, 1.4],
                       [1.0, 0.0, 0.5, -0.5, 2.0, 0.1, 0.2, 0.3]])
Q = torch.softmax(torch.tensor([[0.5, 2.0, 1.0, 1.2, -1.0, 0.0, 0.3, 0.5],
                                [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]), -1)
TEMPERATURE, TOP_K, TOP_P = 0.8, 6, 0.97


def tv_bound(n: int, v: int = V, delta: float = 1e-6) -> float:
    """Largest TV a correct sampler exceeds with probability < delta (module docstring)."""
    return 0.5 * math.sqrt((v - 1) / n) + math.sqrt(math.log(1 / delta) / (2 * n))


def _target(i: int) -> torch.Tensor:
    return ref.target_dist(LOGITS[i].to(torch.bfloat16), TEMPERATURE, TOP_K, TOP_P).p  # the op sees bf16 logits


def _trials(with_probs: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run N trials through the standard path; (output ids (N, D+1), accepted (N,), drafts (N, D))."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(Q[i], N, replacement=True, generator=g) for i in range(D)], 1).int()
    out = torch.empty(N, D + 1, dtype=torch.int32)
    acc = torch.empty(N, dtype=torch.int32)
    dspark_verify_standard(
        LOGITS.to(torch.bfloat16).expand(N, D + 1, V).contiguous(), drafts, torch.full((N,), D, dtype=torch.int32),
        Q.expand(N, D, V).contiguous() if with_probs else None,
        torch.full((N,), TEMPERATURE), torch.full((N,), TOP_K, dtype=torch.int32), torch.full((N,), TOP_P),
        torch.rand(N, D, generator=g), (-torch.log1p(-torch.rand(N, V, generator=g))).clamp_min(1e-30),
        max_draft_tokens=D, output_token_ids=out, num_accepted_tokens=acc)
    return out, acc, drafts


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    f = torch.bincount(samples.long(), minlength=V).double() / samples.numel()
    return 0.5 * float((f - p).abs().sum())


def test_bound_formula() -> None:
    assert tv_bound(400_000) == pytest.approx(0.5 * math.sqrt(7 / 4e5) + math.sqrt(math.log(1e6) / 8e5))
    assert tv_bound(400_000) < 0.007


@pytest.mark.slow
@pytest.mark.parametrize("with_probs", [True, False], ids=["draft_probs", "one_hot_drafts"])
def test_emitted_tokens_follow_the_target_distribution(with_probs: bool) -> None:
    out, acc, drafts = _trials(with_probs, seed=11)
    p0, p1 = _target(0), _target(1)
    assert float(p0[-2:].sum()) == 0.0  # top-k 6 removed the two least likely tokens: a real filter
    assert _tv(out[:, 0], p0) < tv_bound(N)
    first = acc >= 1
    n1 = int(first.sum())
    assert n1 > N // 10  # one-hot drafts from q: acceptance sum_t q(t) p(t) is about 0.17
    assert _tv(out[first, 1], p1) < tv_bound(n1)
    # acceptance rate of draft 0 vs its expectation, within 4 standard deviations
    q0 = Q[0].double()
    rate = float(torch.minimum(p0, q0).sum()) if with_probs else float((q0 * p0).sum())
    sigma = math.sqrt(rate * (1 - rate) / N)
    assert abs(float(first.double().mean()) - rate) < 4 * sigma


def test_the_tv_test_detects_resampling_from_p_instead_of_the_residual() -> None:
    """Power: the classic bug (recovered token drawn from p, not max(p - q, 0)) exceeds the bound."""
    g = torch.Generator().manual_seed(5)
    p0, q0 = _target(0), Q[0].double()
    d = torch.multinomial(q0, N, replacement=True, generator=g)
    u = torch.rand(N, generator=g, dtype=torch.float64)
    accept = u < p0[d] / q0[d]
    wrong = torch.where(accept, d, torch.multinomial(p0, N, replacement=True, generator=g))
    assert _tv(wrong, p0) > 0.05 > 5 * tv_bound(N)


def test_reference_sampler_matches_the_target_on_a_small_sample() -> None:
    """The float64 oracle itself, on 3000 trials (its per-request loop is slow): TV within the bound."""
    n = 3000
    g = torch.Generator().manual_seed(3)
    logits = LOGITS.to(torch.bfloat16).expand(n, D + 1, V).contiguous()
    inputs = {
        "target_logits": logits,
        "draft_token_ids": torch.multinomial(Q[0], n, replacement=True, generator=g).int().view(n, 1).expand(n, D).contiguous(),
        "num_draft_tokens": torch.ones(n, dtype=torch.int32), "draft_probs": Q[0].expand(n, D, V).contiguous(),
        "temperature": torch.full((n,), TEMPERATURE), "top_k": torch.full((n,), TOP_K, dtype=torch.int32),
        "top_p": torch.full((n,), TOP_P), "uniform_draws": torch.rand(n, D, generator=g),
        "exponential_noise": (-torch.log1p(-torch.rand(n, V, generator=g))).clamp_min(1e-30),
    }
    want = ref.reference(inputs, {"max_draft_tokens": D})
    assert _tv(want["output_token_ids"][:, 0], _target(0)) < tv_bound(n)
