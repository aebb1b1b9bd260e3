"""The judge <-> child protocol: response frames, call-server commands and the shared-memory layout.

One file for both sides: the workbench imports it as ``guards._protocol``; the child loads it by path
(``guards/_child_main.py``), so the constants are never copied.

- **Response frame** (child -> judge, once, at exit): magic (8 bytes), nonce (32 bytes), payload length
  (8 bytes, little endian), a ``torch.save`` payload.
- **Call server** (perf): the judge writes fixed-size commands (:data:`CMD`) to the child's command
  pipe; the child answers each with an acknowledgement (:data:`ACK`, prefixed by the nonce, so bytes
  candidate code writes to the pipe are not an acknowledgement).
- **Shared memory**: one ``memfd`` per child, two slots per workload; each slot holds every input and
  every output at 64-byte aligned offsets (:func:`slot_layout`). The judge writes a call's inputs into
  a slot just before "go", poisons its outputs, and reads them back right after "done".

Source: issue 12 items 1-2.
"""

from __future__ import annotations

import hashlib
import struct

_SHA256 = hashlib.sha256
"""Bound when this module loads (in the child: before any candidate code), so a patched ``hashlib`` later
changes no digest the child sends."""

RESPONSE_MAGIC = b"WBRESP1\0"
NONCE_BYTES = 32

PROGRESS = struct.Struct("<q")
"""The correctness child's progress page (a ``memfd`` the judge maps; the child maps it and closes its fd
before any candidate code is imported, as the perf slots): the 1-based index of the configuration it has
begun. When the judge kills a child past its time limit, the verdict names that configuration from the
judge's own list (helper-33, session 27: a time-out named none). No text crosses, and nothing is written
where candidate code can watch it (helper-35, session 28: a line on stderr told candidate code it ran in
the correctness child)."""

CMD = struct.Struct("<cIII")
"""Command: opcode (1 byte), workload index, slot, spare (little endian)."""
ACK = struct.Struct("<cI")
"""Acknowledgement after the nonce: status (b"k" ok, b"e" the call raised, b"x" a check failed), then a count:
for "go", the CuTe DSL compiles (``cutlass.cute.compile`` calls) during the call (CUDA), else 0."""

OP_SELECT, OP_LOAD, OP_GO, OP_READ, OP_QUIT = b"S", b"L", b"G", b"R", b"Q"
"""S: build the workload's views and the candidate's own (ordinary) tensors; L: copy a slot's inputs into
them and poison the outputs (CUDA: also flush the L2); G: one call, after which the outputs are in the
slot on CPU; R: CUDA device->host copy of the outputs, then the per-call checks; Q: quit."""

SLOTS = 2
"""Input/output slots per workload: consecutive calls alternate, so a pointer-keyed cache returns stale data."""
ALIGN = 64

_ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1}


def _nbytes(shape, dtype: str) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * _ITEMSIZE[dtype]


def _extent(s: dict) -> int:
    """Bytes of one slot entry: its shape's, or for an input spec with ``stride`` (elements) and ``offset``
    (elements; a row view of a wider buffer, a task's ``layout`` overlay) the span of the strided view."""
    if "stride" not in s:
        return _nbytes(s["shape"], s["dtype"])
    shape, stride = [int(d) for d in s["shape"]], [int(x) for x in s["stride"]]
    if 0 in shape:
        return 0
    return (int(s.get("offset", 0)) + sum((d - 1) * st for d, st in zip(shape, stride)) + 1) * _ITEMSIZE[s["dtype"]]


def slot_layout(inputs: dict, outputs: dict) -> tuple[dict[str, tuple[int, int]], int]:
    """Offsets of one slot.

    Args:
        inputs: ``name -> {"shape": [...], "dtype": str}`` of every input tensor, plus ``stride`` and ``offset``
            (elements) for one that is not contiguous (a row view of a wider buffer).
        outputs: ``name -> {"shape", "dtype", "inplace"}``; in-place outputs live in their input.

    Returns:
        ``({"in:<name>" | "out:<name>": (offset_bytes, nbytes)}, slot_bytes)``.

    Raises:
        KeyError: a dtype this protocol does not carry.
    """
    off, out = 0, {}
    for kind, specs in (("in", inputs), ("out", outputs)):
        for name, s in specs.items():
            if kind == "out" and s.get("inplace"):
                continue
            n = _extent(s)
            out[f"{kind}:{name}"] = (off, n)
            off += (n + ALIGN - 1) // ALIGN * ALIGN
    return out, max(off, ALIGN)


def views(buf, base: int, layout: dict, inputs: dict, outputs: dict):
    """Tensors over one slot of ``buf`` (a flat ``torch.uint8`` tensor over the shared memory).

    Returns:
        ``(inputs, outputs)``: dicts of tensors viewing the slot; in-place outputs are their input.
    """
    import torch

    def view(key, s):
        off, n = layout[key]
        t = buf[base + off: base + off + n].view(getattr(torch, s["dtype"]))
        if "stride" in s:  # the strides a layout overlay drew, kept in the slot (session 27's red team)
            return t.as_strided(tuple(int(d) for d in s["shape"]), tuple(int(x) for x in s["stride"]),
                                t.storage_offset() + int(s.get("offset", 0)))
        return t.view(tuple(int(d) for d in s["shape"]))

    ins = {k: view(f"in:{k}", s) for k, s in inputs.items()}
    outs = {k: (ins[k] if s.get("inplace") else view(f"out:{k}", s)) for k, s in outputs.items()}
    return ins, outs


_INT_MIN = {"int64": -2**63, "int32": -2**31, "int16": -2**15, "int8": -2**7, "uint8": 0}


def poison_value(spec: dict, rng) -> float | int | bool:
    """The value written into an output before a call.

    The task's own poison when it names one (``spec["poison_random"]`` false); otherwise a fresh value
    per call, so candidate code cannot recognise the judge's buffers by a fixed sentinel: for floats one
    of NaN, +-inf or a large or arbitrary finite number, for signed ints a random negative value (never a
    valid id, index or count; -1 excluded), for bool ``True``.

    Args:
        spec: an output spec (``dtype``, ``poison``, ``poison_random``).
        rng: a ``random.Random`` (or ``secrets.SystemRandom``).
    """
    if not spec.get("poison_random"):
        return spec["poison"]
    dt = spec["dtype"]
    if dt.startswith(("float", "bfloat")):
        return rng.choice([float("nan"), float("inf"), float("-inf"), -3.0e38, 1.7e38, rng.uniform(-1e6, 1e6)])
    if dt == "bool":
        return True
    lo = _INT_MIN.get(dt, -2**31)
    return rng.randint(lo, -2) if lo < 0 else spec["poison"]


def tensor_digest(t) -> dict:
    """What the judge needs to know of an input after a call: its shape, dtype and a digest of its bits.

    The correctness child sends this instead of a copy of every input after every call (a full copy
    per call made the response of the DSpark task's V = 163840 workloads pass its 1 GiB cap on CUDA,
    where the CUDA-graph replay adds a fourth call). Bitwise: NaN payloads and the sign of zero count.

    Args:
        t: a CPU tensor (any dtype, any shape, contiguous or not).

    Returns:
        ``{"shape": [int, ...], "dtype": "bfloat16" | ..., "sha256": hex digest of its bytes}``.

    SHA-256, hashed from the tensor's memory without a copy: a cryptographic hash (no change of the bits
    keeps it, whatever the change), and the fastest one here: 1.35 GB/s with the CPU's SHA extensions
    against 0.47 GB/s for BLAKE2b on the 2-core machine (``hashlib``, 64 MiB), where hashing every input
    after every call was a large part of a correctness judgment.
    """
    import torch

    flat = t.detach().contiguous().reshape(-1)
    h = _SHA256()
    if flat.numel():
        h.update(flat.view(torch.uint8).numpy())  # the buffer itself: no bytes copy
    return {"shape": [int(d) for d in t.shape], "dtype": str(t.dtype).removeprefix("torch."), "sha256": h.hexdigest()}
