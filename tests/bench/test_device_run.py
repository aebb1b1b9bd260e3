"""bench/device_run.py: step parsing, the presets' command lines (dry run) and a run of plain commands."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from typer.testing import CliRunner

from tests.conftest import REPO_ROOT

_spec = importlib.util.spec_from_file_location("device_run", REPO_ROOT / "bench" / "device_run.py")
dr = importlib.util.module_from_spec(_spec)
sys.modules["device_run"] = dr
_spec.loader.exec_module(dr)


def _dry(*args: str) -> list[str]:
    out = CliRunner().invoke(dr.app, [*args, "--dry-run", "--out", "/o"])
    assert out.exit_code == 0, out.output
    return out.output.splitlines()


def test_parse_step_kind_target_options_and_flags():
    s = dr.parse_step("bench:k3_moe_dispatch,reps=60,no-compile,world=2+4")
    assert (s.kind, s.target, s.opts) == ("bench", "k3_moe_dispatch", {"reps": "60", "no-compile": "1", "world": "2+4"})
    assert dr.parse_step("git,fresh") == dr.Step("git", None, {"fresh": "1"})


@pytest.mark.parametrize(("args", "message"), [
    (["bogus"], "step 'bogus': unknown kind 'bogus'; known: no-multicast, git,"),
    (["run:k3_moe_dispatch,sede=3"], "run takes no option 'sede'; it takes: candidate, seed, timeout, no-queue, save."),
    (["run"], "step run: needs a task, as run:TASK."),
    (["--preset", "h200_run99"], "--preset 'h200_run99': unknown; known: h200_run, h200_run2,"),
    ([], "give either steps or --preset (one of them)."),
    (["git", "--preset", "h200_run"], "give either steps or --preset (one of them)."),
])
def test_bad_arguments_exit_2_with_one_line(args, message):
    out = CliRunner().invoke(dr.app, [*args, "--dry-run"])
    assert out.exit_code == 2
    assert message in out.output and out.output.startswith("device_run: ")


def test_preset_h200_run6_is_the_former_script():
    lines = [x for x in _dry("--preset", "h200_run6") if not x.startswith("#")]
    assert lines == [
        "python3 -I -c \"import pydantic, torch, triton; print('python -I sees pydantic', pydantic.VERSION, 'torch', "
        "torch.__version__)\"",
        "[ -d .git ] || { git init -q && git add -A && git -c user.name=wb -c user.email=wb@local commit -qm base; }",
        "python3 -c \"import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, "
        "torch.cuda.get_device_name())\"",
        "nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.limit,temperature.gpu "
        "--format=csv",
        "timeout 60 python3 bench/dspark_micro.py /o/micro.json 30",
        "timeout 120 python3 -m workbench run k3_dspark_verify --candidate "
        "tasks/k3_dspark_verify/fixtures/good/triton-cuda --device cuda --seed 6 --no-queue",
        "timeout 100 python3 -m workbench bench k3_dspark_verify --candidate "
        "tasks/k3_dspark_verify/fixtures/good/triton-cuda --out /o --repetitions 60 --no-compile",
        "timeout 110 python3 -m workbench run k3_moe_dispatch --candidate "
        "tasks/k3_moe_dispatch/fixtures/good/triton-cuda --device cuda --seed 6 --no-queue",
        "timeout 60 python3 -m workbench bench k3_moe_dispatch --candidate "
        "tasks/k3_moe_dispatch/fixtures/good/triton-cuda --out /o --repetitions 100 --no-compile",
    ]
    notes = [x for x in _dry("--preset", "h200_run6") if x.startswith("#   (copy")]
    assert notes == ["#   (copy the newest .workbench/results/*.json to dspark_run.json)",
                     "#   (copy the newest .workbench/results/*.json to moe_run.json)"]


def test_preset_h200x2_run_narrows_the_scope_and_keeps_rank_logs():
    lines = _dry("--preset", "h200x2_run")
    assert "sed -i 's/tp_sizes=(1, 2, 4)/tp_sizes=(1, 2)/' /tmp/cands/triton-nccl-cuda-tp2/k3_model/kernels/" \
           "allreduce_rmsnorm/__init__.py" in lines
    assert ("WORKBENCH_BENCH_LOG_DIR=/tmp/benchlogs WORKBENCH_BENCH_HANG_DUMP_S=100 timeout 200 python3 -m workbench "
            "bench k3_allreduce_rmsnorm --candidate /tmp/cands/triton-nccl-cuda-tp2 --out /o --world-size 2 "
            "--repetitions 100") in lines
    assert "rm -rf .git .workbench && git init -q && git add -A && git -c user.name=wb -c user.email=wb@local " \
           "commit -qm base" in lines
    assert "nvidia-smi topo -m" in lines
    assert lines[1] == "#   (export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1)"


@pytest.mark.parametrize(("preset", "expected"), [
    ("h200_run", "timeout 150 python3 -m guards.perf_calibration collect k3_moe_dispatch /o/cal_raw.json --aa 80 "
                 "--planted 30"),
    ("h200_run3", "timeout 150 python3 -m guards.perf_calibration collect k3_moe_dispatch /o/cal_raw2.json --aa 60 "
                  "--planted 0"),
    ("h200_run5", "timeout 150 python3 -m pytest -q -m gpu tests/tasks/test_k3_dspark_verify_triton.py "
                  "-p no:cacheprovider > /o/pytest_gpu.txt 2>&1"),
    ("h200_run7", "timeout 150 python3 -m workbench bench k3_allreduce_rmsnorm --candidate "
                  "tasks/k3_allreduce_rmsnorm/fixtures/good/triton-nccl-cuda --out /o --world-size 1 --batch 1 "
                  "--batch 8 --batch 64 --repetitions 50"),
    ("h200_run7", "timeout 120 python3 -m pytest -q -m gpu tests/tasks/test_k3_allreduce_rmsnorm.py "
                  "-p no:cacheprovider 2>&1 | tail -5"),
    ("h200_run9", "timeout 150 python3 -m guards.perf_calibration collect-judged k3_moe_dispatch "
                  "/o/perf_calibration_judged_raw.json --device cuda --aa 40 --planted 20 --workload k3_t8"),
    ("h200_run9", "python3 -m guards.perf_calibration evaluate /o/perf_calibration_judged_raw.json "
                  "/o/perf_calibration_judged.json"),
    ("h200_run10", "timeout 120 python3 bench/judge_overhead.py /o/judge_overhead_cuda.json cuda"),
    ("h200x4_run", "timeout 300 python3 -m workbench bench k3_allreduce_rmsnorm --candidate "
                   "tasks/k3_allreduce_rmsnorm/fixtures/good/triton-nccl-cuda --out /o --world-size 2 "
                   "--world-size 4 --repetitions 100"),
])
def test_preset_lines(preset, expected):
    assert expected in _dry("--preset", preset)


def test_exploits_step_names_its_limits_and_environment():
    (note,) = [x for x in _dry("exploits,budget=300,case-timeout=120,guard-limit=60,gpu=0") if x.startswith("#   (")]
    assert "budget 300 s, each case at most 120 s" in note
    assert ("WORKBENCH_CORPUS_GUARD_LIMIT_S=60 WORKBENCH_MODEL_EVAL_TIMEOUT_S=60 CUDA_VISIBLE_DEVICES=0 "
            "WORKBENCH_CORPUS_SUMMARY=/tmp/wb-h200-exploits.XXXXXX/cases.jsonl timeout -k 10 LIMIT python3 -m pytest "
            "-q -m gpu CASE_ID -p no:cacheprovider") in note


def test_every_preset_plans_and_every_old_script_has_one():
    for name, (log, steps) in dr.PRESETS.items():
        assert log.endswith(".txt") and dr.Runner(REPO_ROOT, None).plan(steps), name
    assert set(dr.PRESETS) == {"h200_run", *(f"h200_run{i}" for i in range(2, 11)), "h200x2_run", "h200x4_run",
                               "h200_exploits", "h200_bench_model"}


def test_a_real_run_tees_saves_and_tails(tmp_path, monkeypatch):
    """Steps that need no GPU: a saved command's tail, a failing command logged (the call goes on)."""
    monkeypatch.setattr(dr.Runner, "dry", False)
    r = dr.Runner(tmp_path, tmp_path / "log.txt")
    r._cmd(dr.Cmd("printf 'a\\nb\\nc\\n'", save="x.txt", tail=2))
    r._cmd(dr.Cmd("echo out; exit 3"))
    assert (tmp_path / "x.txt").read_text() == "a\nb\nc\n"
    assert (tmp_path / "log.txt").read_text().splitlines() == [
        f"$ printf 'a\\nb\\nc\\n' > {tmp_path}/x.txt 2>&1", "b", "c",
        "$ echo out; exit 3", "out", "(exit 3)"]


def test_a_bad_step_makes_no_output_folder(tmp_path):
    out = CliRunner().invoke(dr.app, ["git", "bogus", "--out", str(tmp_path / "o")])
    assert out.exit_code == 2 and not (tmp_path / "o").exists()


def test_preset_h200_bench_model_runs_bench_model_on_cuda_within_the_call():
    lines = [x for x in _dry("--preset", "h200_bench_model") if not x.startswith("#")]
    assert lines[-1] == ("timeout 420 python3 -m workbench bench-model --candidate tasks/k3_moe_dispatch/fixtures/good/"
                         "triton-cuda --task k3_moe_dispatch --device cuda --out-dir /o --timeout-s 400 --steps 50 "
                         "--mixed-steps 4 --profile-steps 2")
    small = _dry("bench-model:k3_moe_dispatch,timeout=200,batches=1+64,contexts=128+32768")[-1]
    assert small.endswith("--timeout-s 180 --batches 1,64 --contexts 128,32768"), small
