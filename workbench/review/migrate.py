"""The review queue's schema through Alembic migrations (``workbench/review/migrations/``), not ``create_all``.

:func:`upgrade` brings any store to the newest revision when it is opened: a new database gets every
revision, a queue made before migrations existed (its tables but no ``alembic_version``) is stamped as
revision 0001 first, and a queue at the head is left alone (one read). On PostgreSQL the whole upgrade holds
a transaction-scoped advisory lock, so processes opening a new team queue at once migrate it once; on
SQLite the store's ``BEGIN IMMEDIATE`` does the same.

Source: Alembic docs, "Cookbook: Sharing a Connection across one or more programmatic migration commands"
and "Building an Up to Date Database from Scratch" (stamp); PostgreSQL docs, "Advisory Locks".
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import inspect
from sqlalchemy.engine import Engine

MIGRATIONS = Path(__file__).with_name("migrations")
BASELINE = "0001"
"""The revision whose schema ``create_all`` made before migrations (a queue without ``alembic_version``)."""
PG_LOCK_KEY = 0x776F726B62656E63
"""The advisory lock key of the queue's migrations on PostgreSQL (the bytes of "workbenc", a 64-bit int)."""


def _config():
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def head_revision() -> str:
    """The newest revision in ``migrations/versions``."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    """The revision ``engine``'s database is at (``None``: never migrated)."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine) -> str:
    """Migrate ``engine``'s database to the head revision; return the revision it was at (``"none"``: new).

    Raises:
        sqlalchemy.exc.OperationalError: the database cannot be reached or written.
    """
    from alembic import command
    from alembic.runtime.migration import MigrationContext

    head = head_revision()
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({PG_LOCK_KEY})")
        current = MigrationContext.configure(conn).get_current_revision()
        if current == head:
            return current
        cfg = _config()
        cfg.attributes["connection"] = conn
        if current is None and inspect(conn).has_table("review_items"):
            command.stamp(cfg, BASELINE)  # made by create_all before migrations: that schema is revision 0001
            current = BASELINE
        command.upgrade(cfg, "head")
    return current or "none"
