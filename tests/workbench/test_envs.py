"""workbench/envs.py: the one table of ``WORKBENCH_*`` variables, its typed reads and its errors."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from guards.model_eval import ModelEvalSettings
from tests.conftest import REPO_ROOT
from workbench import envs
from workbench.envs import EnvVar, EnvVarError

PRODUCT = ("workbench", "guards", "kernels", "k3_model", "bench", "tasks")
SKIP_PARTS = ("fixtures",)  # tasks/*/fixtures: candidate kernels, not the workbench's code
HOSTILE = ("tests/exploits/bad", "tests/exploits/honest", "tests/exploits/refused")
NAME = re.compile(r"WORKBENCH_[A-Z0-9_]*")


def _files(roots, suffixes=(".py", ".sh", ".md", ".toml")):
    for root in roots:
        for p in sorted((REPO_ROOT / root).rglob("*")):
            rel = p.relative_to(REPO_ROOT).as_posix()
            if (p.is_file() and p.suffix in suffixes and not any(part in SKIP_PARTS for part in p.parts)
                    and not rel.startswith(HOSTILE) and "__pycache__" not in p.parts):
                yield p


def _known(name: str) -> bool:
    if name in envs.VARIABLES or name in envs.AGENT_VARIABLES:
        return True
    # a prefix in prose, e.g. ``WORKBENCH_MODEL_EVAL_<FIELD>`` or ``WORKBENCH_*``: must lead to a listed name
    return name.endswith("_") and any(n.startswith(name) for n in [*envs.VARIABLES, *envs.AGENT_VARIABLES])


def test_every_workbench_variable_named_in_the_code_is_in_the_table():
    unknown = sorted({f"{p.relative_to(REPO_ROOT)}: {m}" for p in _files([*PRODUCT, "tests", "docs"])
                      for m in NAME.findall(p.read_text(errors="replace")) if not _known(m)})
    assert unknown == []


def test_no_workbench_variable_is_read_outside_envs_py():
    """Product code names a variable only through workbench/envs.py: no string constant that is a
    ``WORKBENCH_*`` name (``os.environ.get("WORKBENCH_DB")``, ``"WORKBENCH_" + x``) anywhere else."""
    offenders = []
    for p in _files(PRODUCT, suffixes=(".py",)):
        if p == REPO_ROOT / "workbench" / "envs.py":
            continue
        for node in ast.walk(ast.parse(p.read_text(), filename=str(p))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                offenders.append(f"{p.relative_to(REPO_ROOT)}:{node.lineno}: {node.value!r}")
    assert offenders == []


def test_the_scan_finds_a_direct_read():
    """The rule above on a planted file: a direct read is a string constant the walk reports."""
    tree = ast.parse('import os\nx = os.environ.get("WORKBENCH_DB", "")\n')
    found = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and NAME.fullmatch(n.value)]
    assert found == ["WORKBENCH_DB"]


def test_table_rows_are_complete_and_match_the_module_docstring():
    # + the model eval's dtypes and bfloat16 leg (issue 15 item 3); + the pool's 4 (issue 16); + the speculative leg's 2 (issue 21);
    # + the guard children's start (issue 17)
    assert len(envs.VARIABLES) == 28
    for name, var in envs.VARIABLES.items():
        assert name == var.name and name.startswith("WORKBENCH_")
        assert var.meaning and var.read_by and var.type in (int, float, str, Path)
        assert f"``{name}``" in envs.__doc__, name  # the table in the docstring lists it too
    assert set(envs.AGENT_VARIABLES) == {"WORKBENCH_TASK", "WORKBENCH_BRIEF", "WORKBENCH_PROMPT",
                                          "WORKBENCH_FEEDBACK", "WORKBENCH_WORKTREE", "WORKBENCH_BASE",
                                          "WORKBENCH_ATTEMPT", "WORKBENCH_ATTEMPTS"}


def test_model_eval_defaults_are_the_settings_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(ModelEvalSettings)}
    assert {k: v.default for k, v in envs.MODEL_EVAL.items()} == fields
    assert {k: v.type for k, v in envs.MODEL_EVAL.items()} == {k: type(v) for k, v in fields.items()}


def test_typed_reads_and_defaults():
    assert envs.DB.read({}) == ""
    assert envs.DB.read({"WORKBENCH_DB": "sqlite:///q.db"}) == "sqlite:///q.db"
    assert envs.BENCH_HANG_DUMP_S.read({}) == 600.0
    assert envs.BENCH_HANG_DUMP_S.read({"WORKBENCH_BENCH_HANG_DUMP_S": "100"}) == 100.0
    assert envs.BENCH_LOG_DIR.read({"WORKBENCH_BENCH_LOG_DIR": "/tmp/logs"}) == Path("/tmp/logs")
    assert envs.BENCH_LOG_DIR.read({"WORKBENCH_BENCH_LOG_DIR": ""}) is None  # empty: unset, as before
    assert envs.CORPUS_GUARD_LIMIT_S.read({"WORKBENCH_CORPUS_GUARD_LIMIT_S": "90"}) == 90
    assert envs.CORPUS_GUARD_LIMIT_S.read({"WORKBENCH_CORPUS_GUARD_LIMIT_S": ""}) is None
    assert envs.MODEL_EVAL["context_tokens"].read({"WORKBENCH_MODEL_EVAL_CONTEXT_TOKENS": "4096"}) == 4096
    assert envs.MODEL_EVAL["tie_margin"].read({"WORKBENCH_MODEL_EVAL_TIE_MARGIN": "1e-2"}) == 0.01


@pytest.mark.parametrize(("var", "raw", "expected"), [
    (envs.MODEL_EVAL["context_tokens"], "x", "expected an integer; got 'x'"),
    (envs.MODEL_EVAL["context_tokens"], "4096.0", "expected an integer; got '4096.0'"),
    (envs.MODEL_EVAL["context_tokens"], "", "expected an integer; got ''"),  # empty is malformed here
    (envs.MODEL_EVAL["max_logprob_drift"], "small", "expected a number; got 'small'"),
    (envs.BENCH_HANG_DUMP_S, "10m", "expected a number; got '10m'"),
    (envs.CORPUS_GUARD_LIMIT_S, "1.5", "expected an integer; got '1.5'"),
    (envs.MODEL_EVAL_VLLM, "yes", "expected one of off, on, only; got 'yes'"),
])
def test_malformed_value_says_what_expected_and_got(var: EnvVar, raw: str, expected: str):
    with pytest.raises(EnvVarError) as info:
        var.read({var.name: raw})
    msg = str(info.value)
    assert msg.startswith(f"Environment variable {var.name} (read by {var.read_by}: {var.meaning}): ")
    assert expected in msg and msg.endswith(".")
    assert isinstance(info.value, ValueError)  # callers that caught ValueError before still do


def test_model_eval_settings_from_env_raises_the_table_error():
    assert ModelEvalSettings.from_env({"WORKBENCH_MODEL_EVAL_CONTEXT_TOKENS": "4096"}).context_tokens == 4096
    assert ModelEvalSettings.from_env({}) == ModelEvalSettings()
    with pytest.raises(EnvVarError, match=r"WORKBENCH_MODEL_EVAL_BATCH .*expected an integer; got 'two'"):
        ModelEvalSettings.from_env({"WORKBENCH_MODEL_EVAL_BATCH": "two"})


def test_export_sets_a_valid_value_and_refuses_a_bad_one():
    env: dict[str, str] = {}
    envs.MODEL_EVAL_VLLM.export("on", env)
    assert env == {"WORKBENCH_MODEL_EVAL_VLLM": "on"}
    with pytest.raises(EnvVarError, match="expected one of off, on, only; got 'always'"):
        envs.MODEL_EVAL_VLLM.export("always", env)
    assert env == {"WORKBENCH_MODEL_EVAL_VLLM": "on"}


def test_model_eval_overrides_lists_every_prefixed_variable_sorted():
    env = {"WORKBENCH_MODEL_EVAL_VLLM": "on", "WORKBENCH_DB": "x", "WORKBENCH_MODEL_EVAL_BATCH": "4", "HOME": "/h"}
    assert envs.model_eval_overrides(env) == {"WORKBENCH_MODEL_EVAL_BATCH": "4", "WORKBENCH_MODEL_EVAL_VLLM": "on"}


def test_cli_flag_exports_the_variable(monkeypatch):
    from workbench.cli import _model_eval_vllm

    monkeypatch.setenv("WORKBENCH_MODEL_EVAL_VLLM", "off")  # restored (to unset) after the test
    _model_eval_vllm(False)
    assert envs.MODEL_EVAL_VLLM.read() == "off"
    _model_eval_vllm(True)
    assert envs.MODEL_EVAL_VLLM.raw() == "on" and envs.MODEL_EVAL_VLLM.read() == "on"


def test_review_store_reads_the_db_url_through_the_table(tmp_path, monkeypatch):
    from workbench.review.store import DB_ENV, default_db_url

    assert DB_ENV == "WORKBENCH_DB"
    monkeypatch.setenv("WORKBENCH_DB", "  sqlite:///elsewhere.db ")
    assert default_db_url(tmp_path) == "sqlite:///elsewhere.db"
    monkeypatch.setenv("WORKBENCH_DB", " ")
    assert default_db_url(tmp_path) == f"sqlite:///{tmp_path.resolve() / '.workbench' / 'queue.db'}"
