"""The one result type every guard returns.

Source: DESIGN.md "Contracts" (Guard, Verdict) and STYLE.md (inspect_ai's split: a guard's own
failure raises and becomes ERROR; a bad candidate comes back as FAIL data).
"""

from __future__ import annotations

import enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Status(str, enum.Enum):
    """Outcome of one guard: PASS, FAIL (the candidate is bad), ERROR (the guard broke), SKIP."""

    PASS = "PASS"
    FAIL = "FAIL"
    ERROR = "ERROR"
    SKIP = "SKIP"


class Evidence(BaseModel):
    """One measured or observed fact behind a verdict.

    Attributes:
        name: what was measured, e.g. ``"max_abs_err"`` or ``"changed_path"``.
        value: the value (number, string or bool).
        unit: unit of ``value`` (``"us"``, ``"ratio"``, ``"count"``, ``""`` for text).
        path: file or configuration the fact is about, when there is one.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    value: Any
    unit: str = ""
    path: str | None = None


class Verdict(BaseModel):
    """A guard's judgement of one candidate (frozen).

    FAIL must carry at least one evidence item; SKIP must say why in ``summary``.

    Attributes:
        guard: the guard's name (``isolation``, ``correctness``, ...).
        status: PASS, FAIL, ERROR or SKIP.
        summary: one sentence a reviewer reads first.
        evidence: facts with units that support the status.
        duration_s: wall time the guard took (seconds).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    guard: str
    status: Status
    summary: str = Field(min_length=1)
    evidence: tuple[Evidence, ...] = ()
    duration_s: float = 0.0

    @model_validator(mode="after")
    def _status_needs(self) -> Verdict:
        if self.status is Status.FAIL and not self.evidence:
            raise ValueError(
                f"Verdict of guard '{self.guard}': status FAIL needs at least one evidence item; "
                "got none. Add the failing configuration and the measured value."
            )
        return self

    def with_duration(self, duration_s: float) -> Verdict:
        """Return a copy carrying the measured duration (seconds)."""
        return self.model_copy(update={"duration_s": round(duration_s, 4)})

    def one_line(self) -> str:
        """``GUARD STATUS: summary`` for terminal output."""
        return f"{self.guard:<12} {self.status.value:<5} {self.summary}"
