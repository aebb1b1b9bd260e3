"""Where a test session's time went: its tests by file and kind (a pytest JUnit XML file) and, inside its
judgments, by guard (every result file the session's judgments left under its temporary folders).

A test's time (JUnit ``time``) includes its waits for the machine locks (tests/conftest.py); a judgment's
guard times (``verdicts[].duration_s`` of each result JSON) are the judge's own clock around each guard, so
what a session spent judging, guard by guard, can be set against its tests' total. A judgment read twice
(a result file copied with a repository) counts once, by its ``result_id``.

Usage: ``python bench/suite_profile.py --junit /tmp/junit19.xml --basetemp /tmp/pytest-of-root/pytest-N
--out bench/results/cpu/suite_profile_session19.json``
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from workbench import env as envmod


def _kind(classname: str, name: str) -> str:
    """A test's kind: the fixture judgments by the guard their name says, the corpus, or its file."""
    if classname.endswith("test_fixtures_e2e"):
        m = re.search(r"\[\w+:(\w+)-", name)
        guard = m.group(1) if m and m.group(1) in ("isolation", "audit", "correctness", "activation", "model_eval",
                                                   "perf") else "good"
        return f"fixtures e2e: {guard}"
    return classname.rsplit(".", 1)[-1]


def tests_by_kind(junit: Path) -> dict:
    by: dict[str, list[float]] = collections.defaultdict(list)
    for tc in ET.parse(junit).iter("testcase"):
        if tc.find("skipped") is not None:
            continue
        by[_kind(tc.get("classname", ""), tc.get("name", ""))].append(float(tc.get("time", 0)))
    rows = {k: {"tests": len(v), "seconds": round(sum(v), 1)} for k, v in by.items()}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["seconds"]))


def judgments(basetemp: Path) -> dict:
    seen: set[str] = set()
    per_guard: dict[str, list[float]] = collections.defaultdict(list)
    total, n, by_task = 0.0, 0, collections.Counter()
    by_task_guard: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in basetemp.rglob(".workbench/results/*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        rid = data.get("result_id") or str(path)
        if rid in seen or "verdicts" not in data:
            continue
        seen.add(rid)
        n += 1
        total += float(data.get("duration_s") or 0.0)
        by_task[data.get("task_id", "?")] += float(data.get("duration_s") or 0.0)
        for v in data["verdicts"]:
            if v.get("duration_s") is not None and v.get("status") != "SKIP":
                per_guard[v["guard"]].append(float(v["duration_s"]))
                by_task_guard[data.get("task_id", "?")][v["guard"]].append(float(v["duration_s"]))
    guards = {g: {"runs": len(v), "seconds": round(sum(v), 1), "mean_s": round(sum(v) / len(v), 1)}
              for g, v in sorted(per_guard.items(), key=lambda kv: -sum(kv[1]))}
    return {"judgments": n, "seconds": round(total, 1), "by_guard": guards,
            "by_task": {k: round(v, 1) for k, v in by_task.most_common()},
            "by_task_and_guard": {t: {g: {"runs": len(v), "seconds": round(sum(v), 1)}
                                      for g, v in sorted(by_task_guard[t].items(), key=lambda kv: -sum(kv[1]))
                                      if sum(v) >= 0.05}
                                  for t, _ in by_task.most_common()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--junit", type=Path, required=True, help="JUnit XML of the session (pytest --junitxml)")
    ap.add_argument("--basetemp", type=Path, required=True, help="the session's pytest base temp folder")
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = ap.parse_args()
    kinds = tests_by_kind(args.junit)
    out = {"bench": "suite_profile", "junit": str(args.junit), "basetemp": str(args.basetemp),
           "tests_seconds": round(sum(r["seconds"] for r in kinds.values()), 1), "tests_by_kind": kinds,
           "judgments": judgments(args.basetemp), "environment": envmod.collect("cpu")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("tests_seconds",)} | {"judgments": {k: v for k, v in out["judgments"].items()
                                                                            if k != "by_task"}}, indent=1))


if __name__ == "__main__":
    main()
