"""Alembic's environment for the review queue's schema (:mod:`workbench.review.migrate` runs it).

Programmatic runs pass their connection in ``config.attributes["connection"]`` (one transaction with the
caller's lock); the ``alembic`` command line, given ``-x url=SQLALCHEMY_URL``, opens its own.

Source: Alembic docs, "Cookbook: Sharing a Connection across one or more programmatic migration commands".
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from workbench.review.store import metadata

config = context.config
connection = config.attributes.get("connection")


def _run(conn) -> None:
    context.configure(connection=conn, target_metadata=metadata, render_as_batch=conn.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


if connection is not None:
    _run(connection)
else:  # pragma: no cover - the alembic command line, for a person writing the next revision
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    with create_engine(url).connect() as conn:
        _run(conn)
