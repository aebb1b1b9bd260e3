"""Unit tests of the vLLM plugin's pure parts (no vLLM needed): the step classifier, the expand fix, the
decode_backend resolution, the trace files, the draft config."""

from __future__ import annotations

import types

import pytest
import torch

from k3_model.vllm_plugin.batch import classify_batch
from k3_model.vllm_plugin.patches import expand_into
from k3_model.vllm_plugin.trace import StepTrace, read_traces


@pytest.mark.parametrize(
    "qlens, ctx, num_spec, spec_rows, want",
    [
        ([1, 1, 1], [5, 9, 2], 0, None, "decode"),
        ([7], [0], 0, None, "prefill"),
        ([1], [0], 0, None, "prefill"),  # a one-token prompt is a prefill
        ([1, 63], [10, 0], 0, None, "mixed"),
        ([8, 8], [20, 31], 7, None, "spec_verify"),  # verification steps: 1 + D tokens
        ([8, 1], [20, 31], 7, [True, False], "spec_verify"),  # a row without drafts is still a decode row
        ([1, 1], [20, 31], 7, [True, True], "decode"),  # no request got drafts this step
        ([8], [40], 7, [False], "prefill"),  # a chunk of 1 + D tokens the scheduler did not mark
        ([8, 5], [20, 0], 7, [True, False], "mixed"),
    ],
)
def test_classify_batch(qlens, ctx, num_spec, spec_rows, want):
    assert classify_batch(qlens, ctx, num_spec=num_spec, spec_rows=spec_rows) == want


def test_classify_batch_rejects_bad_input():
    with pytest.raises(ValueError, match="one query length"):
        classify_batch([1, 1], [3])
    with pytest.raises(ValueError, match=">= 0"):
        classify_batch([-1], [3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_into_keeps_dtype_and_values(dtype):
    vals = torch.tensor([0.8, 0.0, 0.5]).to(dtype) if dtype.is_floating_point else torch.tensor([3, 0, 7], dtype=dtype)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = torch.full((6,), -99).to(dtype)
    expand_into(out, vals, cu, 0, 1)
    want = [vals[0], vals[0], 1, 1, 1, vals[2]]
    assert out.tolist() == pytest.approx([float(v) for v in want])


@pytest.mark.slow
def test_resolve_decode_backend_sources_and_errors():
    pytest.importorskip("vllm")
    from k3_model.vllm_plugin.model import K3ServingConfigError, resolve_decode_backend

    hf = types.SimpleNamespace(text_config=types.SimpleNamespace())
    assert resolve_decode_backend({}, hf) == "standard"
    assert resolve_decode_backend({"decode_backend": "latency_specialized"}, hf) == "latency_specialized"
    hf2 = types.SimpleNamespace(decode_backend="latency_specialized", text_config=None)
    assert resolve_decode_backend(None, hf2) == "latency_specialized"
    with pytest.raises(K3ServingConfigError, match="not one of"):
        resolve_decode_backend({"decode_backend": "fast"}, hf)
    with pytest.raises(K3ServingConfigError, match="different values"):
        resolve_decode_backend({"decode_backend": "standard"}, hf2)


def test_step_trace_round_trip(tmp_path):
    d = types.SimpleNamespace(op="moe_dispatch", implementation="standard", reason="decode_backend is standard")
    tr = StepTrace(tmp_path, role="target")
    tr.write(phase="decode", query_lens=[1, 1], decode_backend="standard", decisions=[d, d])
    recs = read_traces(tmp_path)
    assert len(recs) == 1
    assert recs[0]["implementations"] == {"moe_dispatch:standard": 2}
    assert recs[0]["query_lens"] == [1, 1] and recs[0]["phase"] == "decode" and recs[0]["step"] == 0


def test_draft_config_is_one_mla_layer(tmp_path):
    from k3_model.hf_config import parse_hf_config
    from k3_model.vllm_plugin.draft import draft_hf_config

    pytest.importorskip("vllm")
    from k3_model.vllm_plugin.model import wrap_text_config

    data = draft_hf_config()
    assert data["model_type"] == "kimi_linear" and data["architectures"] == ["K3ForCausalLM"]
    cfg = parse_hf_config(wrap_text_config(data))
    t = cfg.text_config
    assert t.num_hidden_layers == 1 and t.is_mla_layer(0) and t.kv_lora_rank + t.qk_rope_head_dim == 576
