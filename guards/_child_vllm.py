"""The vLLM leg of the model eval, inside the contained child (never imported by the workbench process).

``guards/_child_main.py`` loads this file by path (so the candidate's worktree cannot shadow it) for
requests with ``mode == "model_eval_vllm"``, after it has read the nonce and put the candidate's worktree
first on ``sys.path``. :func:`run` then serves K3-mini through an offline ``vllm.LLM`` in this same
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no EngineCore or worker processes, so every line of model
code stays inside the child's containment), with the ``K3ForCausalLM`` plugin from the worktree, the
checkpoint the parent generated, ``decode_backend`` from ``additional_config``, greedy decoding and the
top-2 raw log-probs per generated token. Everything returned is data for the parent to judge.

Source: issue 6 ("run on the standalone loop in CI and through vLLM where available");
shared/reference/vllm_cpu.md §2 (offline ``vllm.LLM`` on the CPU build: ``enforce_eager``,
``kv_cache_memory_bytes``), README "Serving K3-mini through vLLM" (the plugin, the trace).
"""

from __future__ import annotations

import os
import sys
import tempfile

TOP_LOGPROBS = 2
"""Log-probs returned per generated token besides the chosen one (top-2: the margin needs both)."""

VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine runs in this process (contained), not in spawned ones
    "VLLM_CPU_CI_ENV": "1",  # skip vLLM's warm-up pass (README: start-up time on the CPU build)
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
"""Set before vLLM is imported (the child's environment is otherwise the sandbox's allowlist)."""

_TORCH_CUDA_REPLACED = ("Event", "Stream", "set_stream", "current_stream", "synchronize")
"""``torch.cuda`` names vLLM's CPU worker replaces with placeholders when imported
(``vllm/v1/worker/cpu/shm.py``); put back after the run."""


def _eager_logprob_ranks() -> None:
    """Run vLLM's log-prob rank count eagerly: it is ``torch.compile``d with inductor on the CPU build, whose
    C++ build takes tens of seconds and writes a precompiled header larger than the sandbox's file-size cap
    (``g++: internal compiler error: File size limit exceeded``). Only vLLM's sampler reference is swapped
    for the undecorated function (``_torchdynamo_orig_callable``); candidate code is left alone."""
    from vllm.v1.sample import sampler

    orig = getattr(sampler.batched_count_greater_than, "_torchdynamo_orig_callable", None)
    if orig is not None:
        sampler.batched_count_greater_than = orig


def run(req: dict, worktree: str) -> dict:
    """Serve K3-mini once through vLLM and generate greedily for every prompt.

    Args:
        req: the parent's request: ``checkpoint`` (folder), ``decode_backend``, ``prompts`` (B, P) int64,
            ``vllm`` (``max_model_len``, ``kv_cache_memory_bytes`` in bytes, ``dtype``), ``settings``
            (``generate_tokens``), ``op``.
        worktree: the candidate's checkout (already first on ``sys.path``; also put on ``PYTHONPATH`` for
            any process vLLM starts).

    Returns:
        ``vllm_version``; ``tokens`` (B, G) int64; ``logprobs`` (B, G) float64, nats, of each chosen token;
        ``top_ids`` (B, G, 2) and ``top_logprobs`` (B, G, 2) (rank 1 and 2; -inf where vLLM gave fewer);
        ``trace``: one dict per forward step (phase, query lengths, implementation counts);
        ``kernel_module_imported``.

    Raises:
        RuntimeError: vLLM returned fewer sequences or tokens than asked for.
    """
    for k, v in VLLM_ENV.items():
        os.environ[k] = v
    os.environ["PYTHONPATH"] = worktree
    import torch

    saved = {name: getattr(torch.cuda, name) for name in _TORCH_CUDA_REPLACED}
    try:
        return _serve(req, torch)
    finally:  # vLLM's CPU worker replaces these at import; the harness's tamper check compares them
        for name, obj in saved.items():
            setattr(torch.cuda, name, obj)


def _serve(req: dict, torch) -> dict:
    import vllm
    from vllm import LLM, ModelRegistry, SamplingParams
    from vllm.inputs import TokensPrompt

    from k3_model.vllm_plugin import ARCHITECTURE
    from k3_model.vllm_plugin.model import K3ForCausalLM
    from k3_model.vllm_plugin import cpu_attention_config
    from k3_model.vllm_plugin.trace import read_traces

    # registered as a class, not lazily by name: vLLM inspects lazily registered models in a fresh
    # interpreter, which costs seconds (the plugin's own register() then sees it and keeps it)
    ModelRegistry.register_model(ARCHITECTURE, K3ForCausalLM)
    _eager_logprob_ranks()

    trace_dir = tempfile.mkdtemp(prefix="k3_trace_", dir=os.environ.get("HOME"))
    v = req["vllm"]
    gen = int(req["settings"]["generate_tokens"])
    prompts = req["prompts"]
    llm = LLM(model=req["checkpoint"], skip_tokenizer_init=True, dtype=v["dtype"], enforce_eager=True, seed=0,
              max_model_len=int(v["max_model_len"]), max_num_seqs=int(prompts.shape[0]),
              kv_cache_memory_bytes=int(v["kv_cache_memory_bytes"]), enable_prefix_caching=False,
              hf_overrides={"architectures": ["K3ForCausalLM"]},
              attention_config=cpu_attention_config(v["dtype"]) or None,
              additional_config={"decode_backend": req["decode_backend"], "k3_trace_dir": trace_dir})
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True, logprobs=TOP_LOGPROBS,
                            detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts.tolist()], params, use_tqdm=False)
    if len(outs) != prompts.shape[0]:
        raise RuntimeError(f"vLLM returned {len(outs)} outputs for {prompts.shape[0]} prompts")
    B = len(outs)
    tokens = torch.zeros(B, gen, dtype=torch.int64)
    logprobs = torch.zeros(B, gen, dtype=torch.float64)
    top_ids = torch.full((B, gen, TOP_LOGPROBS), -1, dtype=torch.int64)
    top_lp = torch.full((B, gen, TOP_LOGPROBS), float("-inf"), dtype=torch.float64)
    for b, o in enumerate(outs):
        c = o.outputs[0]
        ids, lps = list(c.token_ids), c.logprobs
        if len(ids) != gen or lps is None or len(lps) != gen:
            raise RuntimeError(f"vLLM returned {len(ids)} tokens ({None if lps is None else len(lps)} log-prob "
                               f"entries) for sequence {b}; asked for {gen} with ignore_eos")
        for g, (tok, pos) in enumerate(zip(ids, lps)):
            tokens[b, g] = tok
            logprobs[b, g] = pos[tok].logprob
            for tid, lp in pos.items():
                if 1 <= lp.rank <= TOP_LOGPROBS:
                    top_ids[b, g, lp.rank - 1] = tid
                    top_lp[b, g, lp.rank - 1] = lp.logprob
    trace = [{"phase": r["phase"], "query_lens": list(r["query_lens"]), "implementations": dict(r["implementations"])}
             for r in read_traces(trace_dir)]
    return {"vllm_version": str(vllm.__version__), "tokens": tokens, "logprobs": logprobs, "top_ids": top_ids,
            "top_logprobs": top_lp, "trace": trace,
            "kernel_module_imported": f"k3_model.kernels.{req['op']}" in sys.modules}
