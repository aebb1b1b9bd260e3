"""Fixture candidates of a task: ``fixtures/good/*`` must be accepted, ``fixtures/bad/<guard>-*``
must be rejected by the guard their name starts with.

A fixture is an overlay folder, a ``.patch``, or an **inject** file ``<name>.inject.toml``: another
fixture of the same task (its ``base``, an overlay folder) plus the bug, written as exact text
replacements. The file is the bug and nothing else, so a reviewer reads what is wrong in a few lines
instead of diffing two copies of a kernel; it is materialized into an overlay folder before it is
judged (:func:`materialize_inject`), byte for byte what a hand-made copy would hold.

Source: issue 17 item 4 ("fixtures derived from a base plus the bug (a small inject/overlay) instead
of copies").
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from workbench.errors import CandidateError
from workbench.taskspec import TaskSpec

INJECT_SUFFIX = ".inject.toml"


def fixture_name(file_name: str) -> str:
    """A fixture's name from its file or folder name: ``x.patch``, ``x.inject.toml`` and ``x/`` are ``x``."""
    return file_name.rstrip("/").removesuffix(".patch").removesuffix(INJECT_SUFFIX)
"""File name ending of an inject fixture (base fixture + replacements)."""


class InjectEdit(BaseModel):
    """One exact replacement: ``old`` occurs exactly once in ``file`` of the base and becomes ``new``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    file: str = Field(description="path inside the overlay, e.g. k3_model/kernels/moe_dispatch/__init__.py")
    old: str = Field(min_length=1)
    new: str


class InjectSpec(BaseModel):
    """``<name>.inject.toml``: ``base`` (a fixture folder of the same task, under ``good/`` or ``bad/``),
    ``what`` (the bug in one line) and one or more ``[[edit]]`` tables, applied in order."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    base: str
    what: str
    edit: list[InjectEdit] = Field(min_length=1)


def is_inject(path: Path) -> bool:
    """Whether ``path`` names an inject fixture file."""
    return Path(path).name.endswith(INJECT_SUFFIX)


def _base_folder(spec_path: Path, base: str) -> Path:
    fixtures = spec_path.parent.parent
    for kind in ("good", "bad"):
        d = fixtures / kind / base
        if d.is_dir():
            return d
    raise CandidateError(f"Inject fixture {spec_path}: base {base!r} is not a fixture folder under "
                         f"{fixtures}/good or {fixtures}/bad; name an overlay folder of the same task.")


def read_inject(spec_path: Path) -> InjectSpec:
    """Parse and validate an inject file.

    Raises:
        CandidateError: not TOML, or fields missing, unknown or of the wrong type (the message names them).
    """
    try:
        return InjectSpec.model_validate(tomllib.loads(Path(spec_path).read_text()))
    except tomllib.TOMLDecodeError as exc:
        raise CandidateError(f"Inject fixture {spec_path}: not valid TOML ({exc}).") from None
    except ValidationError as exc:
        errs = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise CandidateError(f"Inject fixture {spec_path}: {errs}. Expected base = \"<fixture folder>\", "
                             "what = \"<the bug>\" and [[edit]] tables with file, old, new.") from None


def materialize_inject(spec_path: Path) -> Path:
    """The overlay folder an inject fixture stands for, built once per content and reused.

    The folder lives under the system's temporary directory, named by the fixture and a digest of the
    inject file and every file of its base, so a changed base or bug gives a new folder; it is built in
    a private temporary folder and renamed into place (parallel test workers never see half of it).

    Returns:
        The folder (the base's files with the edits applied).

    Raises:
        CandidateError: the file is malformed, the base is missing, a file to edit is not in the base,
            or an ``old`` text occurs zero or several times in it (the message says which edit).
    """
    spec_path = Path(spec_path).resolve()
    spec = read_inject(spec_path)
    base = _base_folder(spec_path, spec.base)
    files = sorted(p for p in base.rglob("*") if p.is_file() or p.is_symlink())
    h = hashlib.sha256(spec_path.read_bytes())
    for p in files:
        h.update(str(p.relative_to(base)).encode() + b"\0" + (p.read_bytes() if p.is_file() else b"link"))
    name = spec_path.name.removesuffix(INJECT_SUFFIX)
    parent = Path(tempfile.gettempdir()) / "kernel-workbench-fixtures"
    final = parent / f"{name}-{h.hexdigest()[:16]}"
    if final.is_dir():
        return final
    texts: dict[str, str] = {}
    for i, e in enumerate(spec.edit, 1):
        src = base / e.file
        if e.file not in texts:
            if not src.is_file():
                raise CandidateError(f"Inject fixture {spec_path}: edit {i} names {e.file!r}, which base "
                                     f"{spec.base!r} does not have; give a path of a file in {base}.")
            texts[e.file] = src.read_text()
        n = texts[e.file].count(e.old)
        if n != 1:
            raise CandidateError(f"Inject fixture {spec_path}: edit {i}'s old text occurs {n} times in {e.file} of "
                                 f"base {spec.base!r}; it must occur exactly once (add surrounding lines).")
        texts[e.file] = texts[e.file].replace(e.old, e.new)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=parent))
    shutil.copytree(base, tmp, dirs_exist_ok=True, symlinks=True)
    for rel, text in texts.items():
        (tmp / rel).write_text(text)
    try:
        os.rename(tmp, final)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def overlay_source(path: Path) -> Path:
    """The folder to overlay for a candidate source: an inject file's materialized folder, else ``path``."""
    return materialize_inject(path) if is_inject(path) else Path(path)

GUARD_NAMES = ("isolation", "audit", "correctness", "activation", "model_eval", "perf")


@dataclasses.dataclass(frozen=True)
class Fixture:
    """One fixture candidate.

    Attributes:
        name: file or folder name without ``.patch`` or ``.inject.toml``.
        path: the patch file or overlay folder (an inject fixture's materialized folder).
        good: True under ``fixtures/good``.
        expected_guard: for bad fixtures, the guard that must reject it (prefix of the name).
        devices: devices the fixture can be judged on (``None``: any); from ``fixtures/requires.toml``
            (``[name] devices = ["cuda"]``), kept outside the overlay so it is never part of a candidate.
    """

    name: str
    path: Path
    good: bool
    expected_guard: str | None
    devices: tuple[str, ...] | None = None
    defined_in: Path | None = None
    """The inject file of an inject fixture (``path`` is then its materialized folder); ``None`` otherwise."""

    def runs_on(self, device: str) -> bool:
        """Whether the fixture can be judged on ``device``."""
        return self.devices is None or device in self.devices


def read_requires(folder: Path) -> dict[str, tuple[str, ...]]:
    """Devices per fixture name from ``folder/requires.toml`` (``[name] devices = [...]``); ``{}`` without one.

    The same file format serves ``tasks/<task>/fixtures/`` and the exploit corpus's ``tests/exploits/honest/``.
    """
    path = Path(folder) / "requires.toml"
    data = tomllib.loads(path.read_text()) if path.is_file() else {}
    return {name: tuple(v["devices"]) for name, v in data.items() if isinstance(v, dict) and "devices" in v}


def list_fixtures(task: TaskSpec) -> list[Fixture]:
    """Every fixture of the task, good first, sorted by name.

    Raises:
        ValueError: a bad fixture's name does not start with a known guard name.
        CandidateError: an inject fixture is malformed or does not apply to its base.
    """
    out = []
    requires = read_requires(Path(task.root) / "fixtures")
    for kind in ("good", "bad"):
        d = Path(task.root) / "fixtures" / kind
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            if p.name.startswith(".") or not (p.is_dir() or p.suffix == ".patch" or is_inject(p)):
                continue
            name = fixture_name(p.name)
            guard = None
            if kind == "bad":
                guard = next((g for g in GUARD_NAMES if name.startswith(g + "-")), None)
                if guard is None:
                    raise ValueError(
                        f"Task {task.task_id!r}: bad fixture {p.name!r} must start with the guard that rejects "
                        f"it ({', '.join(GUARD_NAMES)}) followed by '-'; rename it."
                    )
            if is_inject(p):
                out.append(Fixture(name, materialize_inject(p), kind == "good", guard, requires.get(name), p))
            else:
                out.append(Fixture(name, p, kind == "good", guard, requires.get(name)))
    return out


def fixture_outcome_ok(fx: Fixture, accepted: bool, rejecting_guard: str | None) -> bool:
    """Whether a judged fixture came out as its folder and name say."""
    return accepted if fx.good else (not accepted and rejecting_guard == fx.expected_guard)
