"""How a child's response reaches the judge: the frame (magic, nonce, length, ``torch.save`` payload) written to
the response pipe, as ``guards/_child_main.py`` ``_send`` does and ``guards.sandbox.child_session`` reads it.

Two forms, each timed in a fresh child writing a response of the given size (float32 tensors in 16 cases, the
shape of a correctness response), while the parent drains the pipe in 1 MiB reads on a thread as the sandbox does:

- ``concat_64k`` (sessions 1-25): the payload copied into one frame ``bytes`` and written to a default pipe
  (64 KiB on Linux);
- ``two_writes_1m`` (session 26): the header, then the ``torch.save`` buffer itself (no copy), to a pipe widened
  to :data:`guards.sandbox.PIPE_BYTES` (``guards.sandbox._widen_pipe``).

    python bench/response_channel.py OUT.json [--mb 900] [--repeats 3]

Writes ``OUT`` (JSON, with the environment): per form, the child's ``torch.save`` time and its write time
(seconds, from the child's own clock), and the parent's time from start to the last byte read (seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from guards.sandbox import _widen_pipe  # noqa: E402
from workbench import env as envmod  # noqa: E402

_CHILD = r"""
import io, os, struct, sys, time, torch
fd, mb, form = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
response = {"ok": True, "cases": [{"out": torch.randn(mb * 2**20 // 4 // 16)} for _ in range(16)]}
head = b"M" * 8 + b"n" * 32
t0 = time.perf_counter()
buf = io.BytesIO()
torch.save(response, buf)
t1 = time.perf_counter()
if form == "concat_64k":
    payload = buf.getvalue()
    frame = head + struct.pack("<Q", len(payload)) + payload
    views = (memoryview(frame),)
else:
    payload = buf.getbuffer()
    views = (memoryview(head + struct.pack("<Q", len(payload))), payload)
for view in views:
    while view:
        view = view[os.write(fd, view):]
os.close(fd)
t2 = time.perf_counter()
print(f"{t1 - t0} {t2 - t1}")
"""


def one(form: str, mb: int) -> dict:
    r, w = os.pipe()
    if form == "two_writes_1m":
        _widen_pipe(w)
    got = [0]

    def drain() -> None:
        while True:
            b = os.read(r, 1 << 20)
            if not b:
                return
            got[0] += len(b)

    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(w), str(mb), form], pass_fds=(w,),
                            stdout=subprocess.PIPE, text=True)
    os.close(w)
    th = threading.Thread(target=drain)
    th.start()
    out, _ = proc.communicate()
    th.join()
    os.close(r)
    save_s, write_s = (float(x) for x in out.split())
    return {"save_s": round(save_s, 3), "write_s": round(write_s, 3), "bytes": got[0],
            "parent_total_s": round(time.perf_counter() - t0, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--mb", type=int, default=900, help="response size (MiB of float32 data)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    runs = {form: [one(form, args.mb) for _ in range(args.repeats)] for form in ("concat_64k", "two_writes_1m")}
    out = {"bench": "response_channel", "mb": args.mb, "repeats": args.repeats, "runs": runs,
           "median_write_s": {f: statistics.median(r["write_s"] for r in rs) for f, rs in runs.items()},
           "median_parent_total_s": {f: statistics.median(r["parent_total_s"] for r in rs) for f, rs in runs.items()},
           "environment": envmod.collect("cpu")}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("median_write_s", "median_parent_total_s")}))


if __name__ == "__main__":
    main()
