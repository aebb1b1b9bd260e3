"""The perf judge's shared-memory slots (guards/_protocol.py): a strided input (a task's ``layout`` overlay, e.g.
small_m_gemm's ``row_view``) keeps its strides in the slot and in the timed child's copy (session 27's red team:
a kernel slow only on row views was accepted while the slots packed every input)."""

from __future__ import annotations

import torch

from guards import _protocol as P
from guards.perf import _tensor_spec


def _row_view(M=3, K=5, pad=4, start=2):
    wide = torch.randn(M, K + pad)
    return wide[:, start:start + K]


def test_a_row_view_keeps_its_strides_in_the_slot_and_its_values():
    x, w = _row_view(), torch.randn(7, 5)
    specs = {"x": _tensor_spec(x), "weight": _tensor_spec(w)}
    assert specs["x"] == {"shape": [3, 5], "dtype": "float32", "stride": [9, 1], "offset": 2}
    assert specs["weight"] == {"shape": [7, 5], "dtype": "float32"}  # packed inputs carry no strides
    outputs = {"out": {"shape": [3, 7], "dtype": "float32"}}
    layout, slot_bytes = P.slot_layout(specs, outputs)
    assert layout["in:x"][1] == (2 + 2 * 9 + 4 + 1) * 4  # offset + the strided span, not 3 * 5 packed
    buf = torch.zeros(2 * slot_bytes, dtype=torch.uint8)
    for slot in range(2):
        ins, outs = P.views(buf, slot * slot_bytes, layout, specs, outputs)
        assert ins["x"].stride() == (9, 1) and not ins["x"].is_contiguous() and ins["weight"].is_contiguous()
        ins["x"].copy_(x)
        ins["weight"].copy_(w)
        outs["out"].fill_(7.0)
        again, _ = P.views(buf, slot * slot_bytes, layout, specs, outputs)
        assert torch.equal(again["x"], x) and torch.equal(again["weight"], w)  # nothing overlaps


def test_the_timed_child_copies_a_strided_input_with_its_strides():
    from tests.guards.test_perf_route import _child_main

    x = _row_view()
    copy = _child_main()._device_copy(x, "cpu")
    assert copy.stride() == x.stride() and torch.equal(copy, x) and copy.data_ptr() != x.data_ptr()
