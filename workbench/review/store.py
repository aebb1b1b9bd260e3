"""The review queue's store: one row per submitted candidate plus an append-only transition log.

SQLAlchemy 2.x. The default is SQLite in WAL mode under ``.workbench/queue.db``; a team shares one on
PostgreSQL (``postgresql+psycopg://USER@HOST:PORT/DB``, the ``pool`` extra installs psycopg). The schema
comes from Alembic migrations (:mod:`workbench.review.migrate`), applied when a store is opened. Every state change is a compare-and-set
(``UPDATE ... WHERE state = <expected>``) in the same transaction as its log row, so two reviewers
racing on one candidate produce exactly one transition and a killed process leaves either both
or neither.

Source: DESIGN.md "The flow of one candidate" (review queue), issue 5.
"""

from __future__ import annotations

import datetime as _dt
import enum
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import ForeignKey, Integer, String, Text, create_engine, event, func, select, update
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship, sessionmaker

from workbench import envs
from workbench.errors import WorkbenchError

DB_ENV = envs.DB.name
SQLITE_BUSY_TIMEOUT_S = 60.0


class ReviewError(WorkbenchError):
    """A review operation cannot proceed (unknown id, wrong state, refused merge, bad store URL)."""


class ReviewInputError(ReviewError):
    """The request itself is wrong (unknown id, empty reason, a store that cannot be opened), as opposed
    to a review refused on its merits (wrong state, stale, a verdict not PASS): the CLI exits 2, not 1."""


class State(str, enum.Enum):
    """Review states: queued -> approved -> merged; rejected (with a reason); stale (base moved)."""

    QUEUED = "queued"
    APPROVED = "approved"
    MERGED = "merged"
    REJECTED = "rejected"
    STALE = "stale"


#: Allowed transitions. ``approved -> stale`` happens when the target moved between the check and
#: the merge; ``approved -> queued`` never happens (a failed merge leaves the item approved or stale).
TRANSITIONS: dict[State, frozenset[State]] = {
    State.QUEUED: frozenset({State.APPROVED, State.REJECTED, State.STALE}),
    State.APPROVED: frozenset({State.MERGED, State.STALE, State.REJECTED}),
    State.STALE: frozenset({State.REJECTED}),
    State.MERGED: frozenset(),
    State.REJECTED: frozenset(),
}


class _Base(DeclarativeBase):
    pass


metadata = _Base.metadata
"""The tables as the ORM sees them (the migrations' ``target_metadata``; they create the tables)."""


class ReviewItem(_Base):
    """One accepted candidate waiting for (or past) a human decision.

    Attributes:
        id: queue id shown to reviewers.
        result_id: the result file's id (unique: submitting the same result twice is a no-op).
        result_path: absolute path of the result file.
        result_sha256: hash of the result file's bytes at submission (checked again at approval).
        task_id, branch, base_commit, candidate_commit: copied from the result file.
        target_branch: branch the candidate merges into.
        state: a :class:`State` value.
        reason: why it was rejected or went stale.
        merge_commit: SHA of the merge commit once merged.
        created_at, updated_at: UTC ISO 8601 timestamps.
    """

    __tablename__ = "review_items"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    result_id: Mapped[str] = mapped_column(String(200), unique=True, nullable=False)
    result_path: Mapped[str] = mapped_column(Text, nullable=False)
    result_sha256: Mapped[str] = mapped_column(String(64), nullable=False)
    task_id: Mapped[str] = mapped_column(String(200), nullable=False)
    branch: Mapped[str] = mapped_column(String(300), nullable=False)
    base_commit: Mapped[str] = mapped_column(String(64), nullable=False)
    candidate_commit: Mapped[str] = mapped_column(String(64), nullable=False)
    target_branch: Mapped[str] = mapped_column(String(300), nullable=False)
    state: Mapped[str] = mapped_column(String(16), nullable=False, index=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    merge_commit: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[str] = mapped_column(String(40), nullable=False)
    updated_at: Mapped[str] = mapped_column(String(40), nullable=False)

    transitions: Mapped[list[Transition]] = relationship(
        back_populates="item", order_by="Transition.id", lazy="selectin")


class Transition(_Base):
    """One timestamped state change and who made it (append-only).

    Attributes:
        from_state: ``None`` for the submission itself.
        to_state: the new state.
        who: reviewer name (or the submitting process).
        at: UTC ISO 8601 timestamp (microseconds).
        note: reason, merge commit, or other detail.
    """

    __tablename__ = "review_transitions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    item_id: Mapped[int] = mapped_column(ForeignKey("review_items.id"), nullable=False, index=True)
    from_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    to_state: Mapped[str] = mapped_column(String(16), nullable=False)
    who: Mapped[str] = mapped_column(String(200), nullable=False)
    at: Mapped[str] = mapped_column(String(40), nullable=False)
    note: Mapped[str | None] = mapped_column(Text, nullable=True)

    item: Mapped[ReviewItem] = relationship(back_populates="transitions")


def now_utc_us() -> str:
    """Current UTC time, ISO 8601 with microseconds."""
    return _dt.datetime.now(_dt.UTC).isoformat()


def default_db_url(repo_root: Path) -> str:
    """``$WORKBENCH_DB`` when set, else SQLite at ``<repo_root>/.workbench/queue.db``."""
    env = envs.DB.read().strip()
    if env:
        return env
    return f"sqlite:///{Path(repo_root).resolve() / '.workbench' / 'queue.db'}"


def _sqlite_pragmas(engine: Engine) -> None:
    """WAL, full fsync, a busy timeout, and BEGIN IMMEDIATE so writers queue instead of failing.

    pysqlite's own transaction handling is switched off (``isolation_level=None``) and SQLAlchemy's
    ``begin`` event emits ``BEGIN IMMEDIATE``: a deferred transaction that reads and then writes can
    fail with SQLITE_BUSY under WAL without waiting. Source: SQLAlchemy docs, "Serializable isolation /
    Savepoints / Transactional DDL" for the pysqlite driver.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):  # pragma: no cover - exercised through every test
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = FULL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):  # pragma: no cover - exercised through every test
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _check_sqlite_path(url: str, *, create: bool) -> None:
    """Refuse a SQLite file URL whose folder is missing, or whose file is missing when ``create`` is False.

    Raises:
        ReviewInputError: as above; the message names the path and how to fix it.
        sqlalchemy.exc.ArgumentError: the URL is malformed.
    """
    parsed = make_url(url)
    path = parsed.database
    if not parsed.get_backend_name() == "sqlite" or not path or path == ":memory:" or path.startswith("file:"):
        return
    p = Path(path).expanduser()
    if not p.parent.is_dir():
        raise ReviewInputError(
            f"Review store {url!r}: folder {p.parent} does not exist; check the --db path (or ${DB_ENV}), "
            "or create the folder first.")
    if not create and not p.exists():
        raise ReviewInputError(
            f"Review store {url!r}: {p} does not exist and this command only works on an existing queue; "
            f"check the --db path (or ${DB_ENV}); `workbench review submit` or an accepted run creates a queue.")


def _shown(url: str) -> str:
    """``url`` without its password (error messages)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


class ReviewStore:
    """The queue: submit, list, get, and compare-and-set transitions.

    Args:
        url: SQLAlchemy database URL. A SQLite file's folder must exist (it is never created here).
        create: whether a SQLite file that does not exist yet may be created (False: it must exist).

    Raises:
        ReviewInputError: the URL is malformed, the database cannot be opened, a SQLite file's folder does
            not exist, or ``create`` is False and the SQLite file does not exist.
    """

    def __init__(self, url: str, *, create: bool = True) -> None:
        self.url = url
        try:
            _check_sqlite_path(url, create=create)
            is_sqlite = url.startswith("sqlite")
            self.engine = create_engine(
                url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S} if is_sqlite else {})
            if is_sqlite:
                _sqlite_pragmas(self.engine)
            from workbench.review.migrate import upgrade

            upgrade(self.engine)
        except (ArgumentError, OperationalError, ImportError) as exc:
            raise ReviewInputError(
                f"Review store {_shown(url)!r}: cannot open it ({type(exc).__name__}: "
                f"{(str(exc).strip().splitlines() or [''])[0]}); give a SQLAlchemy URL such as "
                f"sqlite:///path/queue.db or postgresql+psycopg://USER@HOST:PORT/DB (pip install -e '.[pool]' for "
                f"psycopg) via --db or ${DB_ENV}, and check that its server is up."
            ) from None
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session in one transaction, committed on success and rolled back on error."""
        with self._sessions.begin() as s:
            yield s

    def close(self) -> None:
        """Dispose of the connection pool."""
        self.engine.dispose()

    # ---- reads -------------------------------------------------------------------------------

    def get(self, item_id: int) -> ReviewItem:
        """The item with this id, transitions loaded.

        Raises:
            ReviewInputError: no such id.
        """
        with self.session() as s:
            item = s.get(ReviewItem, item_id)
            if item is None:
                raise ReviewInputError(
                    f"Review item {item_id} does not exist in {self.url}; `workbench review list` shows the ids.")
            _ = list(item.transitions)
            return item

    def items(self, states: Sequence[State] | None = None) -> list[ReviewItem]:
        """Items, oldest first, optionally only in the given states."""
        with self.session() as s:
            q = select(ReviewItem).order_by(ReviewItem.id)
            if states:
                q = q.where(ReviewItem.state.in_([st.value for st in states]))
            return list(s.scalars(q).all())

    def counts(self) -> dict[str, int]:
        """Number of items per state."""
        with self.session() as s:
            rows = s.execute(select(ReviewItem.state, func.count()).group_by(ReviewItem.state)).all()
        return {state: n for state, n in rows}

    # ---- writes ------------------------------------------------------------------------------

    def add(self, *, result_id: str, result_path: str, result_sha256: str, task_id: str, branch: str,
            base_commit: str, candidate_commit: str, target_branch: str, who: str) -> tuple[ReviewItem, bool]:
        """Insert a queued item and its submission transition, or return the existing one.

        Returns:
            ``(item, created)``; ``created`` is False when ``result_id`` was already queued.

        Raises:
            ReviewError: the result id is queued with a different file hash (the file changed).
        """
        at = now_utc_us()
        try:
            with self.session() as s:
                existing = s.scalars(select(ReviewItem).where(ReviewItem.result_id == result_id)).first()
                if existing is None:
                    item = ReviewItem(result_id=result_id, result_path=result_path, result_sha256=result_sha256,
                                      task_id=task_id, branch=branch, base_commit=base_commit,
                                      candidate_commit=candidate_commit, target_branch=target_branch,
                                      state=State.QUEUED.value, created_at=at, updated_at=at)
                    s.add(item)
                    s.flush()
                    s.add(Transition(item_id=item.id, from_state=None, to_state=State.QUEUED.value, who=who, at=at,
                                     note=f"submitted {result_path}"))
                    created = True
                else:
                    item, created = existing, False
        except IntegrityError:  # another process inserted it between our select and insert
            with self.session() as s:
                item = s.scalars(select(ReviewItem).where(ReviewItem.result_id == result_id)).one()
            created = False
        if not created and item.result_sha256 != result_sha256:
            raise ReviewError(
                f"Result {result_id!r} is already queued as #{item.id} with sha256 {item.result_sha256[:12]}, "
                f"but {result_path} now hashes to {result_sha256[:12]}; result files are immutable, re-run "
                "`workbench verify` to get a new one.")
        return self.get(item.id), created

    def transition(self, item_id: int, expected: State | Sequence[State], new: State, *, who: str,
                   note: str | None = None, reason: str | None = None,
                   merge_commit: str | None = None) -> ReviewItem:
        """Move an item from one of ``expected`` to ``new`` atomically, logging who and when.

        Raises:
            ReviewInputError: unknown id.
            ReviewError: the transition is not allowed, or the item is no longer in an
                expected state (another reviewer got there first).
        """
        exp = [expected] if isinstance(expected, State) else list(expected)
        bad = [e for e in exp if new not in TRANSITIONS[e]]
        if bad:
            raise ReviewError(f"Review transition {bad[0].value} -> {new.value} is not allowed; "
                              f"from {bad[0].value} the next states are "
                              f"{', '.join(sorted(s.value for s in TRANSITIONS[bad[0]])) or 'none (final)'}.")
        at = now_utc_us()
        with self.session() as s:
            # FOR UPDATE: on PostgreSQL a racing reviewer waits here and then reads the state it left (SQLite's
            # BEGIN IMMEDIATE serializes the whole transaction already; its dialect renders no FOR UPDATE)
            current = s.get(ReviewItem, item_id, with_for_update=True)
            if current is None:
                raise ReviewInputError(
                    f"Review item {item_id} does not exist in {self.url}; `workbench review list` shows the ids.")
            old = current.state
            values: dict = {"state": new.value, "updated_at": at}
            if reason is not None:
                values["reason"] = reason
            if merge_commit is not None:
                values["merge_commit"] = merge_commit
            res = s.execute(update(ReviewItem)
                            .where(ReviewItem.id == item_id, ReviewItem.state.in_([e.value for e in exp]))
                            .values(**values).execution_options(synchronize_session=False))
            if res.rowcount != 1:
                raise ReviewError(
                    f"Review item #{item_id} is {old}, expected {' or '.join(e.value for e in exp)}; "
                    f"it cannot become {new.value} (someone else may have reviewed it; see `workbench review show {item_id}`).")
            s.add(Transition(item_id=item_id, from_state=old, to_state=new.value, who=who, at=at,
                             note=note if note is not None else reason))
        return self.get(item_id)
