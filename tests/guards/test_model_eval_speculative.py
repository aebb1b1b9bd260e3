"""The model eval's speculative leg (issue 21 item 3): dspark_verify judged inside K3-mini's speculative
decode loop; PASS on the good fixture at the synthetic acceptance length, FAIL on a kernel that miscounts
accepted drafts while emitting the right tokens, SKIP without a kernel that runs, and the comparison itself."""

import dataclasses
import textwrap

import pytest
import torch

from guards.model_eval import SPEC_ACCEPTANCE_LENGTH, ModelEvalGuard, first_speculative_difference
from guards.verdict import Status
from tests.conftest import REPO_ROOT
from tests.guards.test_model_eval import SMALL, _ctx, _worktree
from workbench.taskspec import load_task

SPEC = dataclasses.replace(SMALL, spec_context_tokens=72, spec_generate_tokens=30)
GOOD = REPO_ROOT / "tasks/k3_dspark_verify/fixtures/good/lazy-torch-cpu"
TASK = load_task(REPO_ROOT, "k3_dspark_verify")


@pytest.mark.slow
def test_good_fixture_passes_at_the_synthetic_acceptance_length(tmp_path):
    v = ModelEvalGuard(SPEC).check(_ctx(tmp_path, _worktree(tmp_path, GOOD), TASK))
    assert v.status is Status.PASS, v.summary
    ev = {e.name: e.value for e in v.evidence}
    # the drafter's promise, on the model: request 0 (greedy, 7 drafts) at AL 6, request 2 (greedy, 3 drafts,
    # all right) at 3 + 1
    assert ev["acceptance_lengths"][0] == SPEC_ACCEPTANCE_LENGTH and ev["acceptance_lengths"][2] == 4.0
    assert ev["candidate_verify_calls"] == ev["verification_steps"] > 0
    assert ev["draft_tokens"] == 7 and ev["speculative_requests"] == 4
    kinds = ev["decisions_judged"]  # every kind of decision was made and compared
    assert min(kinds.values()) > 0, kinds
    assert "emits the standard path's tokens exactly" in v.summary


MISCOUNT = textwrap.dedent('''
    """A verification that emits the right tokens but reports one accepted draft fewer whenever it accepted
    two or more: the last accepted draft is written as the target's token (it is that token, for greedy
    requests), so the tokens agree and only the accepted count, which the engine uses to roll back and to
    count acceptance, is wrong."""
    import torch

    from k3_model.dispatch import OpScope
    from k3_model.ops.dspark_verify import dspark_verify_standard

    SCOPE = OpScope(devices=("cpu",), phases=("spec_verify",), tp_sizes=(1,), dtypes=("bfloat16",), requests_min=1,
                    requests_max=64, query_len_min=2, query_len_max=9)


    def dspark_verify(*args, output_token_ids, num_accepted_tokens, **kw):
        dspark_verify_standard(*args, output_token_ids=output_token_ids, num_accepted_tokens=num_accepted_tokens, **kw)
        many = num_accepted_tokens >= 2
        num_accepted_tokens.sub_(many.to(num_accepted_tokens.dtype))
        for b in many.nonzero().flatten().tolist():
            a = int(num_accepted_tokens[b])
            output_token_ids[b, a + 1] = -1
''')


@pytest.mark.slow
def test_kernel_that_miscounts_accepted_drafts_fails_naming_the_step(tmp_path):
    overlay = tmp_path / "overlay"
    (overlay / "k3_model/kernels/dspark_verify").mkdir(parents=True)
    (overlay / "k3_model/kernels/dspark_verify/__init__.py").write_text(MISCOUNT)
    v = ModelEvalGuard(SPEC).check(_ctx(tmp_path, _worktree(tmp_path, overlay), TASK))
    assert v.status is Status.FAIL, v.summary
    assert "at verification step 0, request 0 accepted 4 draft(s) where the standard path accepts 5" in v.summary


@pytest.mark.slow
def test_no_kernel_that_runs_is_skip(tmp_path):
    v = ModelEvalGuard(SPEC).check(_ctx(tmp_path, _worktree(tmp_path), TASK))
    assert v.status is Status.SKIP
    assert ('never ran in speculative decoding on cpu: the dispatcher said "no latency-specialized kernel merged for '
            'dspark_verify" (the leg\'s calls: batches of 1-4 requests, D = 7, V = 4096, bfloat16 logits, one-hot '
            'drafts)') in v.summary


def test_first_speculative_difference_names_counts_then_tokens():
    std = {"accepted": torch.tensor([[5, 0], [5, 1]]), "tokens": torch.tensor([[1, 2, 3], [4, 5, 6]])}
    same = {k: v.clone() for k, v in std.items()}
    assert first_speculative_difference(std, same) is None
    cand = {**same, "accepted": torch.tensor([[5, 0], [5, 2]])}
    assert first_speculative_difference(std, cand) == ("at verification step 1, request 1 accepted 2 draft(s) where "
                                                       "the standard path accepts 1")
    cand = {**same, "tokens": torch.tensor([[1, 2, 3], [4, 9, 6]])}
    assert first_speculative_difference(std, cand) == ("request 1 emits token 9 at generated token 1 where the "
                                                       "standard path emits 5")
    cand = {**same, "accepted": torch.tensor([[5, 0], [5, 1], [0, 0]])}
    assert "took 3 verification steps, the standard path's 2" in first_speculative_difference(std, cand)


def test_vllm_leg_is_said_not_run_for_speculative_ops(tmp_path, monkeypatch):
    from guards.verdict import Verdict

    monkeypatch.setattr(ModelEvalGuard, "_speculative",
                        lambda self, ctx, s: Verdict(guard="model_eval", status=Status.PASS, summary="Agrees."))
    v = ModelEvalGuard(dataclasses.replace(SPEC, vllm="on")).check(_ctx(tmp_path, tmp_path, TASK))
    assert v.status is Status.PASS
    assert v.summary == ("Agrees. The vLLM leg was asked for but not run: the vLLM leg decodes without drafts, so it "
                         "never calls this op.")
    assert [e.value for e in v.evidence if e.name == "vllm_leg"] == [
        "not run: the vLLM leg decodes without drafts, so it never calls this op"]
    off = ModelEvalGuard(SPEC).check(_ctx(tmp_path, tmp_path, TASK))
    assert off.summary == "Agrees." and not off.evidence
