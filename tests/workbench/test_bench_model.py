"""``workbench bench-model`` (workbench/bench_model.py) and the capturable decode step under it.

CPU tests keep every size tiny (batches 1 and 3, contexts of 8 and 16 tokens, a few steps): the whole
file runs in well under a minute on two cores. Batch 3 is the odd size; context 8 with chunk 8 makes a
mixed step whose prefilling sequence starts from nothing. The CUDA test (marked ``gpu``) checks the
graph capture on a real device.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench.bench_model import BenchModelError, BenchModelSpec, read_result

CPU_FIXTURE = "tasks/k3_moe_dispatch/fixtures/good/lean-torch-cpu"
"""The moe_dispatch good fixture whose SCOPE is the CPU (decode phase, batch 1-64, float32)."""
TINY = ["--batches", "1,3", "--contexts", "8,16", "--chunk", "8", "--steps", "3", "--mixed-steps", "2",
        "--profile-steps", "1"]


def _cli(repo: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench", "bench-model", *args], cwd=repo, capture_output=True,
                          text=True, timeout=timeout, env={**__import__("os").environ, "COLUMNS": "250"})


@pytest.fixture(scope="module")
def cpu_run(project_repo, tmp_path_factory):
    """One CPU run with the good CPU kernel on the latency-specialized side (the expensive part, shared)."""
    out = tmp_path_factory.mktemp("bench_model")
    p = _cli(project_repo, "-c", str(project_repo / CPU_FIXTURE), "--device", "cpu", *TINY, "--out-dir", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    return p, out / "k3_mini_bench_model.json"


@pytest.mark.slow
def test_result_schema_files_and_table(cpu_run, project_repo):
    p, path = cpu_run
    r = read_result(path)  # validates the whole schema
    assert r.format == "workbench-bench-model/1" and r.model == "k3_mini" and r.spec.device == "cpu"
    assert r.complete and r.configurations_planned == 4
    assert [(row.context, row.batch) for row in r.rows] == [(8, 1), (8, 3), (16, 1), (16, 3)]
    assert r.command.startswith(f"workbench bench-model --candidate {project_repo / CPU_FIXTURE} --task k3_moe_dispatch "
                                "--device cpu --dtype float32 --backends standard,latency_specialized --batches 1,3 "
                                "--contexts 8,16 --chunk 8 --steps 3 --mixed-steps 2 --profile-steps 1")
    assert r.environment["torch"] == torch.__version__.split("+")[0] or r.environment["torch"]
    assert r.environment["device"] == "cpu" and r.settings["torch_threads"] == 1
    assert ".workbench/worktrees/k3_moe_dispatch-" in r.worktree and len(r.worktree_commit or "") == 40
    assert r.prompts["source"] == "bench/prompts/k3_mini_prose.txt" and r.prompts["text_tokens"] > 1000
    assert r.build["tokens_per_sequence"] == 16 and r.build["sequences"] == 3
    assert any("mixed steps: eager" in n for n in r.notes)
    for suffix in (".png", ".log"):
        assert path.with_suffix(suffix).stat().st_size > 1000
    assert "B=3 context=16 decode: standard" in path.with_suffix(".log").read_text()
    assert str(path) in p.stdout and "decode speedup (99% CI)" in p.stdout
    assert "measuring 4 configurations" in p.stderr  # the progress facility's lines (piped: one per phase)


def test_every_latency_is_positive_and_the_numbers_are_consistent(cpu_run):
    r = read_result(cpu_run[1])
    for row in r.rows:
        assert row.capacity_tokens == r.spec.capacity(row.context) > row.context
        assert row.decode.tokens_per_step == row.batch and row.mixed.tokens_per_step == 8 + row.batch - 1
        for kind, n in ((row.decode, 3), (row.mixed, 2)):
            assert set(kind.sides) == {"standard", "latency_specialized"} and kind.mode == "eager"
            for s in kind.sides.values():
                assert len(s.samples_us) == n and all(x > 0 for x in s.samples_us)
                lo, hi = s.ci99_us
                assert min(s.samples_us) <= lo <= s.median_us <= hi <= max(s.samples_us)
                assert s.median_us == sorted(s.samples_us)[n // 2] if n % 2 else True
                assert math.isclose(s.tokens_per_s, kind.tokens_per_step / (s.median_us * 1e-6))
            std, ls = kind.sides["standard"].median_us, kind.sides["latency_specialized"].median_us
            assert kind.speedup == pytest.approx(std / ls, rel=1e-12)
            lo, hi = kind.speedup_ci99
            assert 0 < lo <= hi
        # the CPU kernel is contract-equivalent: the greedy tokens of the first step agree in fp32
        assert row.decode.first_tokens_agree is True


def test_traces_say_where_the_kernel_ran(cpu_run):
    """Standard side: never the kernel. Latency-specialized side with the CPU fixture: every decode step
    runs it, and the mixed (batch 3) and prefill (batch 1) steps fall back, for the reason the scope gives."""
    r = read_result(cpu_run[1])
    for row in r.rows:
        assert row.decode.phase == "decode"
        assert row.mixed.phase == ("prefill" if row.batch == 1 else "mixed")
        no_kda = "kda_decode -> standard: no latency-specialized kernel merged for kda_decode"
        no_gemm = "small_m_gemm -> standard: no latency-specialized kernel merged for small_m_gemm"
        for kind in (row.decode, row.mixed):
            # a step with decoding sequences runs the kda_decode op in each of K3-mini's 6 KDA layers (no
            # kernel merged for it here) and the small_m_gemm op for the 39 attention input projections (6 KDA x
            # 5, 3 MLA x 3); a prefill-only step (mixed at batch 1) keeps KDA's token loop and F.linear
            kda = kind is row.decode or row.batch > 1
            std = kind.sides["standard"].trace
            assert std.kernel_steps == 0 and std.kernel_steps_fraction == 0.0 and std.kernel_calls_fraction == 0.0
            # in order of first call: layer 0 is a KDA layer (its projections, then its decode), MoE later
            assert std.reasons == ["small_m_gemm -> standard: decode_backend is standard"] * kda + \
                ["kda_decode -> standard: decode_backend is standard"] * kda + \
                ["moe_dispatch -> standard: decode_backend is standard"]
            assert std.implementations == {"moe_dispatch:standard": 8 * std.steps,  # 8 MoE layers in K3-mini
                                           **({"kda_decode:standard": 6 * std.steps,
                                               "small_m_gemm:standard": 39 * std.steps} if kda else {})}
        dec = row.decode.sides["latency_specialized"].trace
        assert (dec.steps, dec.kernel_steps, dec.kernel_steps_fraction, dec.kernel_calls_fraction) == \
            (3, 3, 1.0, 24 / (24 + 18 + 117))
        assert dec.source == "per_call" and dec.implementations == {"moe_dispatch:latency_specialized": 24,
                                                                    "kda_decode:standard": 18,
                                                                    "small_m_gemm:standard": 117}
        assert dec.reasons == [no_gemm, no_kda, f"moe_dispatch -> latency_specialized: in scope (phase decode, requests "
                                                f"{row.batch}, query length 1, rows {row.batch}, cpu, float32, TP 1, E 32, "
                                                "K 4, G 1, TG 1, B 16)"]
        mix = row.mixed.sides["latency_specialized"].trace
        assert (mix.kernel_steps, mix.kernel_steps_fraction) == (0, 0.0)
        assert mix.reasons == [no_gemm, no_kda] * (row.batch > 1) + [
            f"moe_dispatch -> standard: out of declared scope: phase '{row.mixed.phase}' not in ['decode', 'spec_verify']"]


def test_speculative_steps_emit_the_synthetic_acceptance_length(cpu_run):
    """Issue 21 item 3: a verification step of D = 7 drafts per request at the synthetic AL = 6. Each request
    runs 8 tokens in one forward (the MoE routing sees B x 8 rows), dspark_verify keeps 5 drafts + 1 token, and
    tokens/s counts the B x 6 emitted tokens; with the moe_dispatch candidate its kernel runs on those rows."""
    r = read_result(cpu_run[1])
    assert (r.spec.draft_tokens, r.spec.acceptance_length) == (7, 6)
    assert "--draft-tokens 7 --acceptance-length 6" in r.command
    assert any("speculative steps (eager)" in n for n in r.notes)
    for row in r.rows:
        k = row.speculative
        assert k is not None and k.kind == "speculative" and k.phase == "spec_verify" and k.mode == "eager"
        assert k.tokens_per_step == 6 * row.batch
        for side, s in k.sides.items():
            assert len(s.samples_us) == 3 and all(x > 0 for x in s.samples_us)
            assert math.isclose(s.tokens_per_s, 6 * row.batch / (s.median_us * 1e-6))
            impl = s.trace.implementations
            assert impl[f"dspark_verify:{side}"] == 3  # main's merged CPU kernel reads the bf16 logits
            assert impl[f"moe_dispatch:{side}"] == 8 * 3  # 8 MoE layers; B x 8 rows <= rows_max 128: in its scope
            # KDA runs each request's 8 tokens as decode steps: 6 layers x 8 tokens x requests, each with its
            # 5 input projections; the MLA layers' 8-token projections keep F.linear
            assert impl["kda_decode:standard"] == 6 * 8 * row.batch * 3
            assert impl["small_m_gemm:standard"] == 5 * 6 * 8 * row.batch * 3
        assert k.speedup == pytest.approx(k.sides["standard"].median_us / k.sides["latency_specialized"].median_us)


def test_profile_breakdown_names_the_ops_that_hold_the_time(cpu_run):
    r = read_result(cpu_run[1])
    for row in r.rows:
        for s in row.decode.sides.values():
            prof = s.profile
            assert prof is not None and prof.error is None and prof.steps == 1 and prof.sort_by == "self_cpu_us"
            assert 0 < len(prof.top_ops) <= 12 and prof.step_wall_ms > 0
            names = [o.name for o in prof.top_ops]
            assert all(n.startswith("aten::") for n in names), names
            assert {"aten::mm", "aten::bmm"} & set(names[:5]), names  # the matmuls lead a K3-mini step on the CPU
            times = [o.self_cpu_us_per_step for o in prof.top_ops]
            assert times == sorted(times, reverse=True) and all(t > 0 for t in times)
            assert all(o.calls_per_step >= 1 and o.self_device_us_per_step is None for o in prof.top_ops)
            assert 0 < sum(o.share_pct for o in prof.top_ops) <= 100.0 + 1e-9
            assert prof.total_self_us_per_step == pytest.approx(prof.total_self_cpu_us_per_step)
        assert row.mixed.sides["standard"].profile is None  # profiled: decode steps only


def test_a_run_stopped_early_leaves_its_finished_configurations(cpu_run, tmp_path):
    """The child rewrites the result after every configuration (complete: false until the last), so a run
    killed at its time limit on a GPU still leaves what it measured; the error names the file."""
    from workbench.bench_model import _partial_note

    r = read_result(cpu_run[1])
    partial = r.model_copy(update={"rows": r.rows[:2], "complete": False})
    path = tmp_path / "k3_mini_bench_model.json"
    path.write_text(partial.model_dump_json())
    note = _partial_note(path)
    assert note == f" (partial result: 2 of 4 configurations in {path}, log in {path.with_suffix('.log')})"
    assert path.with_suffix(".png").stat().st_size > 1000
    assert _partial_note(tmp_path / "absent.json") == ""


def test_a_refused_measurement_is_one_clear_error(project_repo, tmp_path, monkeypatch, capsys):
    """A check that fails in the child (on CUDA: a capture that raises, a replay whose tokens differ) is a
    BenchModelError there: one marked line and exit 3, which the parent turns into a BenchModelError naming
    the configuration (the CLI prints it as one line, exit 2)."""
    import workbench.bench as bench
    import workbench.bench_model as bm

    why = "B=8 context=1024 standard: the CUDA graph replay's tokens differ from the eager step's at 1 of 8 sequences"

    def refuse(args):
        raise bm.BenchModelError(why)

    monkeypatch.setattr(bm, "_measure", refuse)
    assert bm.main([json.dumps({"worktree": str(tmp_path), "out": str(tmp_path / "r.json")})]) == 3
    line = capsys.readouterr().out.strip()
    assert line == bm.ERROR_PREFIX + why and not (tmp_path / "r.json").exists()

    def child(module, args, wt, *, timeout_s, what, on_line=None):
        on_line(line)
        raise RuntimeError(f"{what}: the measuring child failed (status 3): {line}")

    monkeypatch.setattr(bench, "run_measuring_child", child)
    with pytest.raises(BenchModelError) as info:
        bm.run_bench_model(project_repo, BenchModelSpec.resolve(device="cpu"), out_dir=tmp_path)
    assert str(info.value) == f"workbench bench-model: {why}"
    assert (tmp_path / "k3_mini_bench_model.log").read_text() == line + "\n"


# ---- bad input: one line, exit 2, no traceback ----------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--batches", "0,2"], "--batches: batch 0 is below 1"),
    (["--batches", "1,two"], "--batches '1,two': expected comma-separated integers"),
    (["--backends", "standard,fast"], "--backends: unknown decode backend 'fast'; expected standard and/or "
                                      "latency_specialized"),
    (["--backends", ""], "--backends: no decode backend given; expected standard and/or latency_specialized"),
    (["--contexts", "4,16", "--chunk", "8"], "--contexts: context 4 tokens is below the prompt chunk of 8 tokens"),
    (["--steps", "0"], "--steps 0 is below 1"),
    (["--dtype", "float16"], "--dtype 'float16' is not one of float32, bfloat16"),
    (["--device", "tpu"], "--device 'tpu' is not one of cuda, cpu"),
    (["--task", "k3_allreduce_rmsnorm", "-c", CPU_FIXTURE], "task 'k3_allreduce_rmsnorm' targets op "
                                                             "'allreduce_rmsnorm', which K3-mini never calls"),
    (["--task", "k3_dspark_verify", "-c", CPU_FIXTURE, "--draft-tokens", "0"],
     "op 'dspark_verify', which runs only in speculative steps, but --draft-tokens is 0"),
    (["--draft-tokens", "9"], "--draft-tokens 9 is outside 0-8"),
    (["--acceptance-length", "9"], "--acceptance-length 9 is outside 1-8"),
])
def test_bad_input_is_one_line_and_exit_2(project_repo, args, message):
    from typer.testing import CliRunner

    from workbench.cli import app

    base = ["--device", "cpu"] if "--device" not in args else []
    out = CliRunner().invoke(app, ["bench-model", *base, *args, "--repo", str(project_repo)], env={"COLUMNS": "250"})
    assert out.exit_code == 2, out.output
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: workbench bench-model") and message in lines[0], lines
    assert "Traceback" not in out.output


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error(project_repo):
    p = _cli(project_repo, "--device", "cuda", "--batches", "1", timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error: workbench bench-model: --device cuda, but torch ")
    assert "sees no CUDA device" in p.stderr and "pass --device cpu" in p.stderr


def test_spec_defaults_per_device_and_capacity():
    cuda = BenchModelSpec.resolve(device="cuda")
    assert (cuda.batches, cuda.contexts, cuda.chunk, cuda.dtype) == ((1, 2, 4, 8, 16, 32, 64), (128, 1024, 8192, 32768),
                                                                      128, "bfloat16")
    cpu = BenchModelSpec.resolve(device="cpu", batches=[4, 1, 4], backends=["latency_specialized", "standard"])
    assert cpu.batches == (1, 4) and cpu.backends == ("standard", "latency_specialized") and cpu.dtype == "float32"
    assert cpu.contexts[0] >= cpu.chunk
    # every step that advances a static cache fits: verified/first step, warm-up, timed, profiled
    assert cpu.capacity(100) == 100 + 1 + 5 + cpu.steps + cpu.profile_steps + 1
    with pytest.raises(BenchModelError, match="below the prompt chunk"):
        BenchModelSpec.resolve(device="cpu", contexts=[16], chunk=32)


# ---- the capturable decode step itself -----------------------------------------------------------------


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The in-process model tests run torch on one thread, as the bench's CPU child does: two threads on a
    loaded two-core machine ran them ten times slower (measured: 1.1 s against 0.1 s for five steps)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def mini():
    from k3_model.hf_config import k3_mini_hf_config, parse_hf_config
    from k3_model.model import K3Model, random_weights

    cfg = parse_hf_config(k3_mini_hf_config())
    w = random_weights(cfg, 11)
    return cfg, w, K3Model(cfg, w)


def _prefilled(model, B: int, L: int, chunk: int, capacity: int):
    from k3_model.dispatch import forward_context

    prompts = torch.randint(0, 3800, (B, L), generator=torch.Generator().manual_seed(B * 100 + L))
    cache = model.new_cache(B, page_tokens=capacity, max_tokens=capacity)
    with forward_context(decode_backend="standard", phase="prefill"):
        for s in range(0, L, chunk):
            logits = model.forward(prompts[:, s:s + chunk], cache)
    return cache, logits[:, -1].argmax(-1)


def test_static_step_computes_the_ordinary_decode(mini):
    """The step bench-model captures computes what K3Model.forward over an ordinary cache does (fp32, odd
    batch 3, a context of 13 cut in chunks of 5), step after step: the same greedy tokens, the logits equal
    up to rounding (MLA reduces over all capacity slots, the masked ones weighing exactly 0, so the sums
    split differently: ~1 ulp per MLA output), and the MoE's sync-free layout read exactly equal."""
    import copy

    from k3_model.decode import StaticDecodeStep
    from k3_model.dispatch import forward_context
    from k3_model.layers import latent_moe

    _, _, model = mini
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    for lw in model.layers[1:3]:
        kw = dict(beta=4.0, linear_beta=25.0, eps=1e-5)
        assert torch.equal(latent_moe(lw.ffn, x, model.routing, **kw),
                           latent_moe(lw.ffn, x, model.routing, capturable=True, **kw))
    cache, first = _prefilled(model, 3, 13, 5, capacity=24)
    step = StaticDecodeStep(model, copy.deepcopy(cache), first, decode_backend="standard", capacity=20)
    tok = first.view(-1, 1)
    for _ in range(5):
        step()
        with forward_context(decode_backend="standard", phase="decode"):
            ref = model.forward(tok, cache)[:, -1]
        tok = ref.argmax(-1).view(-1, 1)
        torch.testing.assert_close(step.logits, ref, rtol=1e-5, atol=2e-5)
        assert torch.equal(step.next_tokens, tok.view(-1))
        # 6 KDA, 8 MoE layers; 39 attention input projections (6 KDA x 5, 3 MLA x 3)
        assert step.last_trace == {"kda_decode:standard": 6, "moe_dispatch:standard": 8, "small_m_gemm:standard": 39}
    assert step.positions() == [18, 18, 18] and torch.equal(step.tokens, tok)
    snap = step.snapshot()
    step()
    once = step.logits.clone()
    step.restore(snap)  # same storage, same state: the next step repeats exactly
    step()
    assert torch.equal(step.logits, once) and step.positions() == [19, 19, 19]
    step()
    with pytest.raises((IndexError, RuntimeError)):  # past the planned capacity: an error, never a silent wrap
        step()


def test_static_step_has_no_host_sync_while_the_ordinary_forward_has(mini):
    """A CPU proxy for 'capturable': on the meta device every host synchronisation (.item(), bool(), int())
    and data-dependent shape (nonzero, boolean masks, unique) raises. The static step runs there; the
    ordinary forward does not, which shows the proxy has teeth."""
    from k3_model.decode import StaticDecodeStep
    from k3_model.dispatch import forward_context
    from k3_model.model import K3Model

    cfg, w, _ = mini
    meta = K3Model(cfg, w, device="meta")
    step = StaticDecodeStep.__new__(StaticDecodeStep)  # the constructor's one-time token check is a host read
    step.model, step.decode_backend, step.cache = meta, "standard", meta.new_static_cache(3, 16)
    step.tokens = torch.zeros(3, 1, dtype=torch.int64, device="meta")
    step.logits = torch.zeros(3, cfg.text_config.vocab_size, device="meta")
    step.next_tokens = torch.zeros(3, dtype=torch.int64, device="meta")
    step()
    assert step.last_trace == {"kda_decode:standard": 6, "moe_dispatch:standard": 8, "small_m_gemm:standard": 39}
    assert step.logits.device.type == "meta"
    with pytest.raises((RuntimeError, NotImplementedError)), forward_context(decode_backend="standard", phase="decode"):
        meta.forward(torch.zeros(3, 1, dtype=torch.int64, device="meta"), meta.new_cache(3))


def test_forward_groups_is_one_batch_of_separate_sequences(mini):
    """A mixed step (one sequence prefilling 5 tokens, two decoding) gives each group what its own forward
    gives, and the MoE op sees all 7 tokens in one call."""
    import copy

    from k3_model.dispatch import forward_context, record_trace

    _, _, model = mini
    pre, _ = _prefilled(model, 1, 6, 6, capacity=16)
    dec, first = _prefilled(model, 2, 9, 9, capacity=16)
    chunk = torch.randint(0, 3800, (1, 5), generator=torch.Generator().manual_seed(3))
    refs = []
    for tok, c in ((chunk, copy.deepcopy(pre)), (first.view(-1, 1), copy.deepcopy(dec))):
        with forward_context(decode_backend="standard", phase="prefill"):
            refs.append(model.forward(tok, c))
    with record_trace() as trace, forward_context(decode_backend="standard", phase="mixed"):
        got = model.forward_groups([(chunk, pre), (first.view(-1, 1), dec)])
    assert [tuple(g.shape) for g in got] == [(1, 5, 4096), (2, 1, 4096)] and (pre.length, dec.length) == (11, 10)
    for g, ref in zip(got, refs):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-4)
    # the MoE op sees all 7 tokens at once; the KDA decode op the decoding group's 2 sequences
    assert {(d.op, d.rows) for d in trace.decisions} == {("moe_dispatch", 7), ("kda_decode", 2), ("small_m_gemm", 2)}
    assert {d.phase for d in trace.decisions} == {"mixed"}


def test_a_failing_measuring_child_reports_its_output(tmp_path):
    """workbench.bench.run_measuring_child (shared by bench and bench-model): a non-zero exit is a
    RuntimeError naming the command, with the child's own output."""
    from workbench.bench import run_measuring_child

    lines = []
    with pytest.raises(RuntimeError, match=r"workbench x: the measuring child failed \(status [1-9]") as info:
        run_measuring_child("json.tool", {"a": 1}, tmp_path, timeout_s=60, what="workbench x", on_line=lines.append)
    assert lines and lines[-1] in str(info.value)


# ---- CUDA ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_graphs_on_both_sides_with_the_triton_kernel(project_repo, tmp_path):
    """On a GPU: both sides captured and verified, replays timed, the Triton kernel in every decode step."""
    p = _cli(project_repo, "-c", str(project_repo / "tasks/k3_moe_dispatch/fixtures/good/triton-cuda"), "--device",
             "cuda", "--batches", "1,3", "--contexts", "32,64", "--chunk", "16", "--steps", "10", "--mixed-steps", "2",
             "--profile-steps", "1", "--out-dir", str(tmp_path), timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    r = read_result(tmp_path / "k3_mini_bench_model.json")
    assert r.environment.get("gpu_name") and r.spec.dtype == "bfloat16"
    for row in r.rows:
        assert row.decode.mode == "cuda_graph" and row.mixed.mode == "eager"
        for s in row.decode.sides.values():
            g = s.graph
            assert g and g.logits_rewritten and g.tokens_equal_eager and g.trace_equal_eager and g.capture_ms > 0
            assert all(x > 0 for x in s.samples_us) and s.trace.source == "capture"
            assert s.profile and s.profile.error is None and s.profile.sort_by == "self_device_us"
            assert s.profile.top_ops and all(o.self_device_us_per_step > 0 for o in s.profile.top_ops)
        assert row.decode.sides["latency_specialized"].trace.kernel_steps_fraction == 1.0
        assert row.decode.sides["standard"].trace.kernel_steps_fraction == 0.0
        k = row.speculative  # D = 7, AL = 6: the verification forward replayed as a graph on both sides
        assert k is not None and k.mode == "cuda_graph" and k.eager_reason is None, k and k.eager_reason
        assert k.tokens_per_step == 6 * row.batch
        for s in k.sides.values():
            assert s.graph and s.graph.logits_rewritten and s.graph.tokens_equal_eager and s.graph.trace_equal_eager
            assert all(x > 0 for x in s.samples_us)
        assert k.sides["latency_specialized"].trace.implementations.get("moe_dispatch:latency_specialized", 0) > 0
    log = (tmp_path / "k3_mini_bench_model.log").read_text()
    assert "captured one decode step" in log and "replay verified" in log
    assert "verification forward captured" in log
    assert json.loads((tmp_path / "k3_mini_bench_model.json").read_text())["format"] == "workbench-bench-model/1"


def test_speculative_drafts_follow_the_verification_forward_not_the_decode_loop(monkeypatch):
    """H200, session 21 (bench/results/h200/session21/): on bf16 logits the decode loop's greedy tokens and the
    verification forward's choices disagreed at a near tie, so B = 1 emitted 3 tokens a step where AL = 6 was
    asked. Here the decode loop is made to choose wrong tokens outright (its logits rolled by one vocabulary
    entry): the drafts must still be the verification forward's own choices, so every request emits AL."""
    from k3_model.hf_config import k3_mini_hf_config, parse_hf_config
    from k3_model.model import K3Model, random_weights
    from workbench import bench_model as bm

    cfg = parse_hf_config(k3_mini_hf_config())
    model = K3Model(cfg, random_weights(cfg, 0), dtype=torch.float32, device="cpu")
    spec = BenchModelSpec.resolve(device="cpu", batches=[2], contexts=[16], chunk=8, steps=1, mixed_steps=1,
                                  profile_steps=0, draft_tokens=7, acceptance_length=6)
    prompts = torch.randint(1, model.text.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    store, _ = bm._build_contexts(model, prompts, spec)
    real_forward = model.forward
    monkeypatch.setattr(model, "forward", lambda tokens, cache, **kw: real_forward(tokens, cache, **kw).roll(1, -1))
    k = bm._speculative(model, store, spec, 2, 16)
    assert k.tokens_per_step == 2 * 6
