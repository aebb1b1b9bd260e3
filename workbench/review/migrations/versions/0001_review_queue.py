"""The review queue as issue 5 made it: items and their append-only transition log.

Revision ID: 0001
Revises:
Create Date: 2026-12-03

A queue made before migrations existed (``create_all``) has exactly this schema; the store stamps it as
0001 the first time it opens it (:func:`workbench.review.migrate.upgrade`).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "review_items",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("result_id", sa.String(200), nullable=False, unique=True),
        sa.Column("result_path", sa.Text, nullable=False),
        sa.Column("result_sha256", sa.String(64), nullable=False),
        sa.Column("task_id", sa.String(200), nullable=False),
        sa.Column("branch", sa.String(300), nullable=False),
        sa.Column("base_commit", sa.String(64), nullable=False),
        sa.Column("candidate_commit", sa.String(64), nullable=False),
        sa.Column("target_branch", sa.String(300), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("merge_commit", sa.String(64), nullable=True),
        sa.Column("created_at", sa.String(40), nullable=False),
        sa.Column("updated_at", sa.String(40), nullable=False),
    )
    op.create_index("ix_review_items_state", "review_items", ["state"])
    op.create_table(
        "review_transitions",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("item_id", sa.Integer, sa.ForeignKey("review_items.id"), nullable=False),
        sa.Column("from_state", sa.String(16), nullable=True),
        sa.Column("to_state", sa.String(16), nullable=False),
        sa.Column("who", sa.String(200), nullable=False),
        sa.Column("at", sa.String(40), nullable=False),
        sa.Column("note", sa.Text, nullable=True),
    )
    op.create_index("ix_review_transitions_item_id", "review_transitions", ["item_id"])


def downgrade() -> None:
    op.drop_index("ix_review_transitions_item_id", "review_transitions")
    op.drop_table("review_transitions")
    op.drop_index("ix_review_items_state", "review_items")
    op.drop_table("review_items")
