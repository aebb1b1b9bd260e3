"""Worker processes for the durability tests (run as ``python review_worker.py MODE ARGS``).

Modes:
    race DB GO NAME FILES...   wait for GO to exist, submit FILES (shuffled), then try to reject every
                               item submitted (shared items race with the other workers); print JSON.
    hold DB READY              open a write transaction, insert an item, touch READY, sleep (to be killed).
    churn DB PREFIX            submit and reject items forever (to be killed at a random moment).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from workbench.review import service
from workbench.review.store import ReviewError, ReviewItem, ReviewStore, Transition, now_utc_us


def race(db: str, go: str, name: str, files: list[str]) -> None:
    store = ReviewStore(db)
    random.seed(name)
    random.shuffle(files)
    while not Path(go).exists():
        time.sleep(0.005)
    created, ids = [], []
    for f in files:
        item, new = service.submit_result(store, Path(f), who=name)
        ids.append(item.id)
        if new:
            created.append(item.result_id)
    won = []
    for item_id in ids:
        try:
            service.reject(store, item_id, reviewer=name, reason=f"rejected by {name}")
            won.append(item_id)
        except ReviewError as exc:
            if "already rejected" not in str(exc) and "is rejected, expected" not in str(exc):
                raise
    print(json.dumps({"name": name, "created": created, "won": won}))


def hold(db: str, ready: str) -> None:
    store = ReviewStore(db)
    with store.session() as s:
        at = now_utc_us()
        item = ReviewItem(result_id="half-written", result_path="/x", result_sha256="0" * 64, task_id="t",
                          branch="b", base_commit="a" * 40, candidate_commit="c" * 40, target_branch="main",
                          state="queued", created_at=at, updated_at=at)
        s.add(item)
        s.flush()
        s.add(Transition(item_id=item.id, from_state=None, to_state="queued", who="hold", at=at))
        s.flush()
        Path(ready).write_text("in transaction")
        time.sleep(120)


def churn(db: str, prefix: str) -> None:
    store = ReviewStore(db)
    i = 0
    while True:
        item, _ = store.add(result_id=f"{prefix}-{i}", result_path="/x", result_sha256="0" * 64, task_id="t",
                            branch="b", base_commit="a" * 40, candidate_commit="c" * 40, target_branch="main",
                            who=prefix)
        if i % 2:
            service.reject(store, item.id, reviewer=prefix, reason="churn")
        i += 1


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    {"race": lambda: race(args[0], args[1], args[2], args[3:]), "hold": lambda: hold(*args),
     "churn": lambda: churn(*args)}[mode]()
