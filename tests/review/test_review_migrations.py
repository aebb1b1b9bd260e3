"""The store's schema comes from Alembic migrations on SQLite and PostgreSQL: a new queue is at the head, a
queue made by ``create_all`` before migrations is stamped and keeps its rows, processes opening a new team
queue at once migrate it once, and a PostgreSQL URL nobody answers is one line (issue 16 item 2)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from review_helpers import add_item, fresh_postgres_db, make_checkout
from sqlalchemy import create_engine, inspect
from typer.testing import CliRunner

from workbench.cli import app
from workbench.review.migrate import current_revision, head_revision
from workbench.review.store import ReviewStore, metadata

PROJECT = Path(__file__).resolve().parents[2]
TABLES = {"review_items", "review_transitions", "alembic_version"}


def test_a_new_queue_is_made_by_the_migrations(db):
    store = ReviewStore(db)
    assert head_revision() == "0001"
    assert current_revision(store.engine) == "0001"
    insp = inspect(store.engine)
    assert set(insp.get_table_names()) == TABLES
    assert {c["name"] for c in insp.get_columns("review_items")} == set(metadata.tables["review_items"].columns.keys())
    assert [u["column_names"] for u in insp.get_unique_constraints("review_items")] == [["result_id"]] or any(
        ix["unique"] and ix["column_names"] == ["result_id"] for ix in insp.get_indexes("review_items"))
    assert {ix["name"] for ix in insp.get_indexes("review_transitions")} >= {"ix_review_transitions_item_id"}
    assert [fk["referred_table"] for fk in insp.get_foreign_keys("review_transitions")] == ["review_items"]
    (item,) = add_item(store)
    assert store.get(item.id).state == "queued" and ReviewStore(db).get(item.id).result_id == item.result_id


def test_a_queue_made_before_migrations_is_stamped_and_keeps_its_rows(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    metadata.create_all(create_engine(url))  # what ReviewStore did before issue 16
    with create_engine(url).begin() as conn:
        conn.exec_driver_sql("INSERT INTO review_items (result_id, result_path, result_sha256, task_id, branch, "
                             "base_commit, candidate_commit, target_branch, state, created_at, updated_at) VALUES "
                             "('old', '/x', '0', 't', 'b', 'a', 'c', 'main', 'queued', 'x', 'x')")
    store = ReviewStore(url)
    assert current_revision(store.engine) == "0001"
    assert [it.result_id for it in store.items()] == ["old"]


def test_processes_opening_a_new_postgres_queue_at_once_migrate_it_once(tmp_path):
    with fresh_postgres_db() as url:
        go = tmp_path / "go"
        code = ("import sys, time, pathlib\nwhile not pathlib.Path(sys.argv[2]).exists(): time.sleep(0.005)\n"
                "from workbench.review.store import ReviewStore\nReviewStore(sys.argv[1]).close()\nprint('ok')\n")
        procs = [subprocess.Popen([sys.executable, "-c", code, url, str(go)], cwd=PROJECT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(6)]
        time.sleep(2.0)  # every process imported and waits
        go.write_text("go")
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert (p.returncode, out.strip()) == (0, "ok"), err[-2000:]
        engine = create_engine(url)
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalars().all() == ["0001"]
        engine.dispose()


def test_a_postgres_url_nobody_answers_is_one_line(tmp_path):
    root = make_checkout(tmp_path / "repo")
    out = CliRunner().invoke(app, ["review", "list", "--repo", str(root), "--db",
                                   "postgresql+psycopg://team:secret@127.0.0.1:1/queue"], env={"WORKBENCH_DB": ""})
    assert out.exit_code == 2
    line = out.stderr.strip()
    assert "\n" not in line and "secret" not in line
    assert line.startswith("error: Review store 'postgresql+psycopg://team:***@127.0.0.1:1/queue': cannot open it "
                           "(OperationalError: ")
    assert line.endswith("give a SQLAlchemy URL such as sqlite:///path/queue.db or postgresql+psycopg://USER@HOST:PORT/DB "
                         "(pip install -e '.[pool]' for psycopg) via --db or $WORKBENCH_DB, and check that its server is up.")
