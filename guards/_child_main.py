"""Entry point of the child process that runs candidate code (never imported by the workbench).

Usage: python -I _child_main.py WORKTREE REQUEST.pt RESPONSE.pt

The request (written by the parent, loaded with ``weights_only=True``) lists cases; for each, the
child calls the task's target through the K3 dispatcher and returns outputs, the inputs as they were
after each call, the dispatch trace and any exception text. The parent compares everything: nothing
this process says is trusted beyond being data.
"""

from __future__ import annotations

import importlib
import sys
import traceback


def _poisoned(spec, device):
    import torch

    dtype = getattr(torch, spec["dtype"])
    t = torch.empty(tuple(spec["shape"]), dtype=dtype, device=device)
    t.fill_(spec["poison"])
    return t


def _decisions(trace):
    return [d.to_dict() for d in trace.decisions]


def _call(fn, forward_context, record_trace, backend, phase, inputs, outs, kwargs):
    with record_trace() as trace, forward_context(decode_backend=backend, phase=phase):
        fn(**inputs, **kwargs, **outs)
    return trace


def _correctness_case(fn, fc, rt, req, case):
    import torch

    device = req["device"]
    backend = req["decode_backend"]
    results = []

    def one(inputs, label):
        outs = {k: _poisoned(s, device) for k, s in case["outputs"].items()}
        rec = {"label": label, "error": None, "trace": []}
        try:
            trace = _call(fn, fc, rt, backend, case["phase"], inputs, outs, case["kwargs"])
            rec["trace"] = _decisions(trace)
        except Exception as exc:  # the candidate failed on this case: report it as data
            rec["error"] = f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exc(limit=6))[-2000:]
        if device == "cuda":
            torch.cuda.synchronize()
        rec["outputs"] = {k: v.detach().to("cpu").clone() for k, v in outs.items()}
        rec["inputs_after"] = {k: v.detach().to("cpu").clone() for k, v in inputs.items()}
        return rec

    buf = {k: v.to(device).clone() for k, v in case["inputs_a"].items()}
    results.append(one(buf, "a_fresh"))
    for k, v in case["inputs_b"].items():  # same storage, new data: defeats caches keyed by pointer
        buf[k].copy_(v.to(device))
    results.append(one(buf, "b_reused_buffers"))
    fresh = {k: v.to(device).clone() for k, v in case["inputs_a"].items()}
    results.append(one(fresh, "a_repeat"))
    return {"name": case["name"], "calls": results}


def _perf_case(fn, fc, rt, req, case):
    from kernels.timing import time_interleaved

    device = req["device"]
    inputs = {k: v.to(device).clone() for k, v in case["inputs_a"].items()}
    outs_a = {k: _poisoned(s, device) for k, s in case["outputs"].items()}
    outs_b = {k: _poisoned(s, device) for k, s in case["outputs"].items()}
    kw = case["kwargs"]
    phase = case["phase"]
    traces = {}
    for side, backend, outs in (("baseline", "standard", outs_a), ("candidate", req["decode_backend"], outs_b)):
        traces[side] = _decisions(_call(fn, fc, rt, backend, phase, inputs, outs, kw))

    def baseline():
        with fc(decode_backend="standard", phase=phase):
            fn(**inputs, **kw, **outs_a)

    def candidate():
        with fc(decode_backend=req["decode_backend"], phase=phase):
            fn(**inputs, **kw, **outs_b)

    details: dict = {}
    a, b, wall = time_interleaved(
        baseline, candidate, device=device, warmup=req["perf"]["warmup"], repetitions=req["perf"]["repetitions"],
        details=details,
    )
    if device == "cuda":  # the physical floor of this configuration (kernels/timing.py)
        from kernels.timing import device_limits, floor_us, min_bytes

        lim = device_limits()
        details["min_bytes"] = min_bytes([*inputs.values(), *outs_b.values()])
        details["floor_us"] = floor_us(details["min_bytes"], bandwidth_gbps=lim.copy_gbps, launch_us=lim.launch_us)
        details["device_limits"] = lim.to_dict()
    return {
        "name": case["name"],
        "baseline_us": a,
        "candidate_us": b,
        "wall_s": wall,
        "trace_baseline": traces["baseline"],
        "trace_candidate": traces["candidate"],
        **details,
    }


def _model_eval(req):
    """Run the standalone K3-mini decode loop (``k3_model.decode.generate``) once; see guards/model_eval.py."""
    import torch

    from k3_model.decode import generate
    from k3_model.hf_config import k3_mini_hf_config, parse_hf_config
    from k3_model.model import K3Model, random_weights

    cfg = parse_hf_config(k3_mini_hf_config())
    model = K3Model(cfg, random_weights(cfg, req["weights_seed"]), dtype=torch.float32, device=req["device"])
    s = req["settings"]
    res = generate(model, req["prompts"], s["generate_tokens"], decode_backend=req["decode_backend"],
                   forced=req.get("forced"), prefill_chunk=s["prefill_chunk"], page_tokens=s["page_tokens"])
    mla = [c for c in res.cache.layers if hasattr(c, "pages_allocated")]
    return {"tokens": res.tokens, "logprobs": res.logprobs, "argmax": res.argmax, "margin": res.margin,
            "implementations": {ph: res.implementation_counts(ph) for ph in ("prefill", "decode")},
            "forward_calls": {ph: sum(1 for st in res.steps if st["phase"] == ph) for ph in ("prefill", "decode")},
            "mla_pages": mla[0].pages_allocated if mla else 0, "context_tokens": res.cache.length,
            "kernel_module_imported": f"k3_model.kernels.{req['op']}" in sys.modules}


def main() -> int:
    worktree, req_path, resp_path = sys.argv[1:4]
    sys.path.insert(0, worktree)
    import torch

    req = torch.load(req_path, weights_only=True)
    response = {"ok": False, "error": None, "scope": None, "cases": [], "perf": []}
    try:
        from k3_model.dispatch import declared_scope, forward_context, record_trace

        mod_name, fn_name = req["target"].split(":")
        fn = getattr(importlib.import_module(mod_name), fn_name)
        standard_only = req["mode"] == "model_eval" and req["decode_backend"] == "standard"
        scope = None if standard_only else declared_scope(req["op"])  # standard runs never import kernel code
        response["scope"] = None if scope is None else {
            k: list(v) if isinstance(v, tuple) else v for k, v in scope.to_dict().items()
        }
        if req["mode"] == "correctness":
            for case in req["cases"]:
                response["cases"].append(_correctness_case(fn, forward_context, record_trace, req, case))
        elif req["mode"] == "model_eval":
            response["model_eval"] = _model_eval(req)
        else:
            for case in req["cases"]:
                response["perf"].append(_perf_case(fn, forward_context, record_trace, req, case))
        response["ok"] = True
    except Exception as exc:
        response["error"] = f"{type(exc).__name__}: {exc}\n" + traceback.format_exc(limit=8)[-3000:]
    torch.save(response, resp_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
