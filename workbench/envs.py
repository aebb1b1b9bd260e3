"""Every ``WORKBENCH_*`` environment variable, in one table, and the only code that reads them.

The table (:data:`VARIABLES`) gives each variable's name, type, default, meaning and the layer that reads
it, as vLLM's ``envs.py`` does. Code reads a variable through its :class:`EnvVar` (``envs.DB.read()``),
never through ``os.environ`` directly; ``tests/workbench/test_envs.py`` scans the product code and fails
when a ``WORKBENCH_*`` name appears outside this table or is read elsewhere.

Most variables carry a setting from one layer down to another in the same process, or into a child
that inherits the environment: ``workbench run --model-eval-vllm`` exports ``WORKBENCH_MODEL_EVAL_VLLM=on``
for the model-eval guard, and the reproduce command a result prints repeats every
``WORKBENCH_MODEL_EVAL_*`` setting in effect (:func:`model_eval_overrides`), so the variables stay the
interface a person can set by hand too.

| variable | type | default | read by | meaning |
|---|---|---|---|---|
| ``WORKBENCH_DB`` | str | ``""`` (SQLite ``.workbench/queue.db``) | workbench/review/store.py | SQLAlchemy URL of the review queue |
| ``WORKBENCH_BENCH_LOG_DIR`` | path | unset (temporary files) | workbench/bench_dist.py | folder keeping each rank's log (``bench --world-size``) |
| ``WORKBENCH_BENCH_HANG_DUMP_S`` | float | 600 | workbench/bench_dist.py (rank process) | seconds after which a rank dumps its stacks and exits |
| ``WORKBENCH_MODEL_EVAL_BATCH`` | int | 2 | guards/model_eval.py | sequences decoded together |
| ``WORKBENCH_MODEL_EVAL_CONTEXT_TOKENS`` | int | 2048 | guards/model_eval.py | prompt length per sequence (tokens) |
| ``WORKBENCH_MODEL_EVAL_GENERATE_TOKENS`` | int | 256 | guards/model_eval.py | tokens generated per sequence |
| ``WORKBENCH_MODEL_EVAL_PREFILL_CHUNK`` | int | 512 | guards/model_eval.py | declared KDA state hand-over interval (tokens) |
| ``WORKBENCH_MODEL_EVAL_PAGE_TOKENS`` | int | 256 | guards/model_eval.py | declared MLA cache page (tokens) |
| ``WORKBENCH_MODEL_EVAL_MAX_LOGPROB_DRIFT`` | float | 1e-3 | guards/model_eval.py | largest tolerated log-probability drift (nats) |
| ``WORKBENCH_MODEL_EVAL_TIE_MARGIN`` | float | 2e-3 | guards/model_eval.py | top-1/top-2 gap below which a greedy flip is excused (nats) |
| ``WORKBENCH_MODEL_EVAL_TIMEOUT_S`` | float | 900 | guards/model_eval.py | wall-clock limit of each model-eval child (seconds) |
| ``WORKBENCH_MODEL_EVAL_DTYPES`` | str | float32,bfloat16 | guards/model_eval.py | model dtypes judged, in order |
| ``WORKBENCH_MODEL_EVAL_BF16_CONTEXT_TOKENS`` | int | 192 | guards/model_eval.py | prompt length of the bfloat16 leg (tokens) |
| ``WORKBENCH_MODEL_EVAL_BF16_GENERATE_TOKENS`` | int | 64 | guards/model_eval.py | bf16 leg: tokens generated per sequence |
| ``WORKBENCH_MODEL_EVAL_BF16_TIE_MARGIN`` | float | 1.0 | guards/model_eval.py | bf16 first-divergence margin bound (nats) |
| ``WORKBENCH_MODEL_EVAL_BF16_LATER_TIE_MARGIN`` | float | 3.0625 | guards/model_eval.py | bf16 later-flip margin bound (nats) |
| ``WORKBENCH_MODEL_EVAL_BF16_MAX_FLIP_FRACTION`` | float | 0.40625 | guards/model_eval.py | bf16 flip-fraction bound per sequence |
| ``WORKBENCH_MODEL_EVAL_SPEC_CONTEXT_TOKENS`` | int | 192 | guards/model_eval.py | prompt length of the speculative leg (tokens) |
| ``WORKBENCH_MODEL_EVAL_SPEC_GENERATE_TOKENS`` | int | 64 | guards/model_eval.py | speculative leg: tokens emitted per request |
| ``WORKBENCH_MODEL_EVAL_VLLM`` | str: off, on, only | off | guards/model_eval.py (set by ``--model-eval-vllm``) | the vLLM leg |
| ``WORKBENCH_CORPUS_SUMMARY`` | path | unset | tests/exploits/test_honest.py | JSON-lines file each GPU corpus case appends to |
| ``WORKBENCH_CORPUS_GUARD_LIMIT_S`` | int | unset | tests/exploits/test_honest.py | cap on the corpus's correctness and perf children (seconds) |
| ``WORKBENCH_JUDGINGS`` | path | unset (``.workbench/judgings.jsonl``) | workbench/retries.py | ledger of judgings, pooled per candidate content |
| ``WORKBENCH_POOL`` | str | ``local`` | workbench/cli.py | default of ``--pool``: ``local`` or ``ray://HOST:PORT`` |
| ``WORKBENCH_CHILD_START`` | str: fork, exec | fork | guards/sandbox.py | CPU guard children forked (torch imported once) or exec'd |
| ``WORKBENCH_POOL_MAX_RETRIES`` | int | 1 | workbench/pool/ray_pool.py | Ray re-runs of a verdict whose worker died (count) |
| ``WORKBENCH_TEST_RAY_ADDRESS`` | str | unset | tests/pool/ | the Ray cluster of the pool tests (``.ci/install-services.sh``) |
| ``WORKBENCH_TEST_POSTGRES_URL`` | str | unset | tests/review/ | the PostgreSQL server of the store tests |

The workbench also *sets* variables that only the agent command reads (:data:`AGENT_VARIABLES`,
written by workbench/agents/command_backend.py); it never reads them back.

Exception: the sandboxed guard child (``guards/_child_main.py``, started with ``python -I`` and loading
its siblings by path) reads no ``WORKBENCH_*`` variable, so it does not import this module; a setting it
needs travels in its JSON request.

Source: vLLM ``vllm/envs.py`` (one table of variables with defaults and meanings); issue 17 item 4.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", Path: "a path"}


class EnvVarError(ValueError):
    """A ``WORKBENCH_*`` variable holds a value that its type (or its list of choices) does not accept."""


@dataclasses.dataclass(frozen=True)
class EnvVar:
    """One ``WORKBENCH_*`` variable.

    Attributes:
        name: the variable's name (``WORKBENCH_...``).
        type: ``int``, ``float``, ``str`` or ``Path``: what :meth:`read` returns when it is set.
        default: what :meth:`read` returns when it is unset (``None``: no value).
        meaning: one line: what it sets, with units.
        read_by: the module (layer) that reads it.
        choices: the accepted values of a ``str`` variable (empty: any string).
        empty_is_unset: an empty value counts as unset (the readers of these treated ``""`` as "not
            given" before this module existed; the others reject it as malformed).
    """

    name: str
    type: type
    default: Any
    meaning: str
    read_by: str
    choices: tuple[str, ...] = ()
    empty_is_unset: bool = False

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's text in ``environ`` (default ``os.environ``), ``None`` when unset."""
        raw = (os.environ if environ is None else environ).get(self.name)
        return None if raw == "" and self.empty_is_unset else raw

    def parse(self, raw: str) -> Any:
        """``raw`` converted to :attr:`type`.

        Raises:
            EnvVarError: ``raw`` is not a value of :attr:`type`, or not one of :attr:`choices`.
        """
        expected = _TYPE_WORDS.get(self.type, self.type.__name__)
        if self.choices:
            expected = "one of " + ", ".join(self.choices)
        try:
            value = self.type(raw)
        except ValueError:
            value = None
        if value is None or (self.choices and value not in self.choices):
            raise EnvVarError(f"Environment variable {self.name} (read by {self.read_by}: {self.meaning}): "
                              f"expected {expected}; got {raw!r}. Unset it or set it to {expected}.")
        return value

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The variable's value in ``environ`` (default ``os.environ``), or :attr:`default` when unset.

        Raises:
            EnvVarError: the variable is set to a malformed value (see :meth:`parse`).
        """
        raw = self.raw(environ)
        return self.default if raw is None else self.parse(raw)

    def export(self, value: Any, environ: MutableMapping[str, str] | None = None) -> None:
        """Set the variable in ``environ`` (default ``os.environ``) for this process and its children.

        Raises:
            EnvVarError: ``value`` is not a value this variable accepts.
        """
        text = str(value)
        self.parse(text)
        (os.environ if environ is None else environ)[self.name] = text


DB = EnvVar("WORKBENCH_DB", str, "", "SQLAlchemy URL of the review queue (empty: SQLite .workbench/queue.db)",
            "workbench/review/store.py")
BENCH_LOG_DIR = EnvVar("WORKBENCH_BENCH_LOG_DIR", Path, None,
                       "folder that keeps each rank's log of a distributed benchmark (unset: temporary files)",
                       "workbench/bench_dist.py", empty_is_unset=True)
BENCH_HANG_DUMP_S = EnvVar("WORKBENCH_BENCH_HANG_DUMP_S", float, 600.0,
                           "seconds after which a benchmark rank dumps its stacks and exits",
                           "workbench/bench_dist.py (rank process)")

MODEL_EVAL_PREFIX = "WORKBENCH_MODEL_EVAL_"
BF16_TIE_MARGIN_DEFAULT = 1.0
"""The bfloat16 leg's bound on a sequence's first divergence (nats): 2 x the largest A/A first-flip margin,
0.5, of bench/results/cpu/model_eval_bf16_calibration.json (guards/model_eval.py, "bfloat16")."""
BF16_LATER_TIE_MARGIN_DEFAULT = 3.0625
"""The bfloat16 leg's bound on later teacher-forced flips (nats): 2 x the largest A/A flip margin, 1.53125,
of the same file."""
BF16_MAX_FLIP_FRACTION_DEFAULT = 0.40625
"""The bfloat16 leg's bound on the fraction of one sequence's teacher-forced steps that flip (ratio): 2 x the
largest A/A fraction, 13 of 64 steps, of the same file."""
_ME = "guards/model_eval.py"
MODEL_EVAL: dict[str, EnvVar] = {v.name.removeprefix(MODEL_EVAL_PREFIX).lower(): v for v in (
    EnvVar("WORKBENCH_MODEL_EVAL_BATCH", int, 2, "sequences decoded together", _ME),
    EnvVar("WORKBENCH_MODEL_EVAL_CONTEXT_TOKENS", int, 2048, "prompt length per sequence (tokens)", _ME),
    EnvVar("WORKBENCH_MODEL_EVAL_GENERATE_TOKENS", int, 256, "tokens generated per sequence", _ME),
    EnvVar("WORKBENCH_MODEL_EVAL_PREFILL_CHUNK", int, 512, "declared KDA state hand-over interval (tokens)", _ME),
    EnvVar("WORKBENCH_MODEL_EVAL_PAGE_TOKENS", int, 256, "declared MLA cache page (tokens)", _ME),
    EnvVar("WORKBENCH_MODEL_EVAL_MAX_LOGPROB_DRIFT", float, 1e-3,
           "largest tolerated |log p_candidate - log p_standard| (nats)", _ME),
    EnvVar("WORKBENCH_MODEL_EVAL_TIE_MARGIN", float, 2e-3,
           "standard top-1/top-2 logit gap below which a greedy flip is excused (nats)", _ME),
    EnvVar("WORKBENCH_MODEL_EVAL_TIMEOUT_S", float, 900.0, "wall-clock limit of each model-eval child (seconds)", _ME),
    EnvVar("WORKBENCH_MODEL_EVAL_DTYPES", str, "float32,bfloat16",
           "model dtypes the standalone leg judges (comma-separated, in order)", _ME),
    EnvVar("WORKBENCH_MODEL_EVAL_BF16_CONTEXT_TOKENS", int, 192, "prompt length of the bfloat16 leg (tokens)", _ME),
    EnvVar("WORKBENCH_MODEL_EVAL_BF16_GENERATE_TOKENS", int, 64, "tokens generated per sequence in the bfloat16 leg",
           _ME),
    EnvVar("WORKBENCH_MODEL_EVAL_BF16_TIE_MARGIN", float, BF16_TIE_MARGIN_DEFAULT,
           "standard top-1/top-2 gap above which a bfloat16 first divergence FAILs (nats, A/A-calibrated)", _ME),
    EnvVar("WORKBENCH_MODEL_EVAL_BF16_LATER_TIE_MARGIN", float, BF16_LATER_TIE_MARGIN_DEFAULT,
           "the same for later teacher-forced bfloat16 flips (nats, A/A-calibrated)", _ME),
    EnvVar("WORKBENCH_MODEL_EVAL_BF16_MAX_FLIP_FRACTION", float, BF16_MAX_FLIP_FRACTION_DEFAULT,
           "largest fraction of a sequence's bfloat16 steps that may flip (A/A-calibrated)", _ME),
    EnvVar("WORKBENCH_MODEL_EVAL_SPEC_CONTEXT_TOKENS", int, 192, "prompt length of the speculative leg (tokens)", _ME),
    EnvVar("WORKBENCH_MODEL_EVAL_SPEC_GENERATE_TOKENS", int, 64, "tokens emitted per request in the speculative leg",
           _ME),
    EnvVar("WORKBENCH_MODEL_EVAL_VLLM", str, "off", "the model eval's vLLM leg (set by --model-eval-vllm)", _ME,
           choices=("off", "on", "only")),
)}
"""The model-eval guard's settings by :class:`guards.model_eval.ModelEvalSettings` field name."""
MODEL_EVAL_VLLM = MODEL_EVAL["vllm"]

_CORPUS = "tests/exploits/test_honest.py"
CORPUS_SUMMARY = EnvVar("WORKBENCH_CORPUS_SUMMARY", Path, None,
                        "JSON-lines file each GPU exploit-corpus case appends its outcome to", _CORPUS,
                        empty_is_unset=True)
CORPUS_GUARD_LIMIT_S = EnvVar("WORKBENCH_CORPUS_GUARD_LIMIT_S", int, None,
                              "cap on the corpus's correctness and perf children (seconds)", _CORPUS,
                              empty_is_unset=True)

JUDGINGS = EnvVar("WORKBENCH_JUDGINGS", Path, None,
                  "ledger of judgings pooled per candidate content (unset: .workbench/judgings.jsonl)",
                  "workbench/retries.py", empty_is_unset=True)

POOL = EnvVar("WORKBENCH_POOL", str, "local",
              "where verdicts are judged when --pool is not given: local (this process) or ray://HOST:PORT",
              "workbench/cli.py", empty_is_unset=True)
CHILD_START = EnvVar("WORKBENCH_CHILD_START", str, "fork",
                     "how CPU guard children start: fork (from a fork server that imported torch once) or exec",
                     "guards/sandbox.py", choices=("fork", "exec"), empty_is_unset=True)
POOL_MAX_RETRIES = EnvVar("WORKBENCH_POOL_MAX_RETRIES", int, 1,
                          "times Ray re-runs a verdict whose worker died before an ERROR verdict (count)",
                          "workbench/pool/ray_pool.py")
_POOL_TESTS = "tests/pool/"
TEST_RAY_ADDRESS = EnvVar("WORKBENCH_TEST_RAY_ADDRESS", str, None,
                          "ray://HOST:PORT of the Ray cluster the pool tests use (.ci/install-services.sh)", _POOL_TESTS,
                          empty_is_unset=True)
TEST_POSTGRES_URL = EnvVar("WORKBENCH_TEST_POSTGRES_URL", str, None,
                           "postgresql+psycopg:// URL of a server whose role may create databases (the store tests)",
                           "tests/review/", empty_is_unset=True)

VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    DB, BENCH_LOG_DIR, BENCH_HANG_DUMP_S, *MODEL_EVAL.values(), CORPUS_SUMMARY, CORPUS_GUARD_LIMIT_S, JUDGINGS,
    POOL, POOL_MAX_RETRIES, CHILD_START, TEST_RAY_ADDRESS, TEST_POSTGRES_URL)}
"""Every ``WORKBENCH_*`` variable the code reads, by name."""

AGENT_VARIABLES: dict[str, str] = {
    "WORKBENCH_TASK": "the task id",
    "WORKBENCH_BRIEF": "path of the brief file",
    "WORKBENCH_PROMPT": "path of the prompt file",
    "WORKBENCH_FEEDBACK": "path of the previous attempt's feedback file (empty on the first attempt)",
    "WORKBENCH_WORKTREE": "path of the candidate's worktree",
    "WORKBENCH_BASE": "the base commit",
    "WORKBENCH_ATTEMPT": "this attempt's number (from 1)",
    "WORKBENCH_ATTEMPTS": "how many attempts the run allows",
}
"""Variables the workbench sets for an agent command (workbench/agents/command_backend.py) and never reads."""


def model_eval_overrides(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every ``WORKBENCH_MODEL_EVAL_*`` variable set in ``environ`` (default ``os.environ``), sorted by name,
    as text: what a reproduce command must repeat. Unknown names under the prefix are included (they are
    passed on as they were)."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if k.startswith(MODEL_EVAL_PREFIX)}


__all__ = ["AGENT_VARIABLES", "BENCH_HANG_DUMP_S", "BENCH_LOG_DIR", "CORPUS_GUARD_LIMIT_S", "CORPUS_SUMMARY", "DB",
           "CHILD_START", "EnvVar", "EnvVarError", "MODEL_EVAL", "MODEL_EVAL_PREFIX", "MODEL_EVAL_VLLM", "POOL", "POOL_MAX_RETRIES",
           "TEST_POSTGRES_URL", "TEST_RAY_ADDRESS", "VARIABLES",
           "model_eval_overrides"]
