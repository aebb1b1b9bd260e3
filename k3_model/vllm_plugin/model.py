"""``K3ForCausalLM``: K3 / K3-mini inside vLLM (out of tree), on k3_model's own layers and weights.

What runs where:

* **MLA layers** (gated NoPE MLA) use vLLM's ``MLAAttention`` with its paged latent KV cache (on this
  CPU: the AMX_MLA / CPU_MLA backends, which accept only the 512 + 64 = 576-wide latent K3 has). The
  projections, the NoPE split (``k_pe`` is never rotated: no rotary embedding is passed), and the
  sigmoid output gate are k3_model's; the absorbed ``kv_b_proj`` lives in a vLLM ``ColumnParallelLinear``
  because ``MLAAttention`` packs it itself.
* **KDA layers** run k3_model's :func:`~k3_model.layers.kda_forward` with their recurrent and conv state
  kept by the plugin (:class:`K3KDALayer`), keyed by the request's first KV block id, as snapshots
  indexed by tokens processed. vLLM's Mamba-style state cache cannot host them on this CPU build: as a
  hybrid model, vLLM raises the attention block size to 128 so one attention page holds one KDA state
  page, and CPU_MLA accepts only 16 (``ValueError: Aligned KV cache block size 128 is not supported by
  attention backend(s): CPU_MLA.``). Speculative verification rows keep one snapshot per token, so
  rejected drafts are rolled back when the next step resumes from an earlier position.
* **AttnRes, LatentMoE (routing through the dispatcher's ``moe_route_dispatch`` op), SiTU MLPs, norms,
  embedding and head** are k3_model's functions on the flat ``(N, H)`` token rows vLLM hands over.

The ``decode_backend`` switch comes from ``additional_config["decode_backend"]`` (as vLLM's own K3 reads
it) or ``--hf-overrides '{"decode_backend": ...}'``. Every forward step is classified
(:func:`k3_model.vllm_plugin.batch.classify_batch`) and runs inside
:func:`k3_model.dispatch.forward_context`, so latency-specialized kernels run only on pure-decode steps
inside their declared scope; the per-step decisions go to the trace (:mod:`k3_model.vllm_plugin.trace`).

Limits on vLLM's CPU build (found by running it; see docs/vllm.md):
prefix caching must stay off (the plugin's KDA state has no prefix cache); expert and pipeline parallelism
crash in vLLM itself; the model runs eagerly (no ``torch.compile``: Python-level dispatch per step).

Source: shared/reference/vllm_cpu.md §4 (plugin API, metadata facts), §5 (spec decoding);
shared/reference/k3_architecture.md §4 (forward), §7.2 (``additional_config`` ``decode_backend``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.model_executor.layers.linear import ColumnParallelLinear

from k3_model.config import DECODE_BACKENDS
from k3_model.dispatch import forward_context, record_trace
from k3_model.hf_config import K3HFConfig, K3TextConfig, load_hf_config, parse_hf_config
from k3_model.layers import (
    KDAState,
    KDAWeights,
    MLAWeights,
    attn_res_mix,
    kda_forward,
    rms_norm,
)
from k3_model.model import K3Model
from k3_model.vllm_plugin.batch import classify_batch
from k3_model.vllm_plugin.trace import StepTrace, trace_dir

logger = logging.getLogger("vllm.k3_model.model")  # under "vllm." or vLLM drops plugin INFO lines


class K3ServingConfigError(ValueError):
    """The serving configuration of K3ForCausalLM is invalid (decode_backend, parallelism, checkpoint)."""


def _k3_config(vllm_config: VllmConfig) -> K3HFConfig:
    """Parse the checkpoint's own ``config.json`` with k3_model's validating parser.

    Raises:
        K3ServingConfigError: the model path is not a local folder with a ``kimi_k3`` config.json.
    """
    path = Path(vllm_config.model_config.model)
    if not (path / "config.json").is_file():
        raise K3ServingConfigError(
            f"K3ForCausalLM: model {str(path)!r} is not a local checkpoint folder with config.json; "
            "generate one with `python -m k3_model.generate --out DIR` and pass --model DIR."
        )
    data = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if data.get("model_type") == "kimi_linear":
        return parse_hf_config(wrap_text_config(data), where=str(path / "config.json"))
    return load_hf_config(path)


def wrap_text_config(text: dict[str, Any]) -> dict[str, Any]:
    """A flat ``kimi_linear`` config (the draft's) as the ``kimi_k3`` config k3_model parses."""
    top = {k: text[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in text}
    return {"architectures": text.get("architectures", ["K3ForCausalLM"]), "model_type": "kimi_k3",
            "tie_word_embeddings": False, **top, "text_config": dict(text)}


def resolve_decode_backend(additional_config: Any, hf_config: Any) -> str:
    """The ``decode_backend`` asked for, from ``additional_config`` or ``--hf-overrides``.

    Args:
        additional_config: ``vllm_config.additional_config`` (a dict, possibly empty).
        hf_config: ``vllm_config.model_config.hf_config`` (``decode_backend`` set by ``--hf-overrides``,
            on the top-level config or its ``text_config``).

    Returns:
        ``"standard"`` (the default) or ``"latency_specialized"``.

    Raises:
        K3ServingConfigError: an unknown value, or the two sources disagree.
    """
    found: dict[str, str] = {}
    if isinstance(additional_config, dict) and additional_config.get("decode_backend") is not None:
        found["additional_config"] = str(additional_config["decode_backend"])
    for where, obj in (("hf_overrides", hf_config), ("hf_overrides text_config", getattr(hf_config, "text_config", None))):
        value = getattr(obj, "decode_backend", None) if obj is not None else None
        if value is not None:
            found[where] = str(value)
    for where, value in found.items():
        if value not in DECODE_BACKENDS:
            raise K3ServingConfigError(
                f"K3ForCausalLM ({where}): decode_backend {value!r} is not one of {list(DECODE_BACKENDS)}; "
                "pass --additional-config '{\"decode_backend\": \"latency_specialized\"}'."
            )
    if len(set(found.values())) > 1:
        raise K3ServingConfigError(f"K3ForCausalLM: decode_backend given twice with different values {found}; "
                                   "set it in one place.")
    return next(iter(found.values()), "standard")


@dataclasses.dataclass(frozen=True)
class RequestRows:
    """One request's rows in a forward step.

    Attributes:
        key: the request's first KV block id (unique among live requests with prefix caching off).
        start: index of its first row in the step's (N, H) rows. length: its query length (tokens).
        position: position of its first new token = tokens it had processed before (tokens).
        verify: its tokens may be rejected afterwards (a speculative verification row): keep the
            state after every token.
    """

    key: int
    start: int
    length: int
    position: int
    verify: bool


class KDAStateError(RuntimeError):
    """The plugin-managed KDA state of a request is missing at the position vLLM resumes it from."""


class K3KDALayer(nn.Module):
    """One KDA layer with its recurrent and conv state managed by the plugin, keyed by request.

    vLLM's Mamba-style state cache cannot host it on this CPU build (docs/vllm.md: the hybrid block-size
    alignment asks CPU_MLA for 128-token blocks, CPU_MLA takes only 16), so each layer keeps, per request
    key, k3_model :class:`KDAState` snapshots indexed by "tokens processed". A step resumes a request
    from the snapshot at its first new position (0 = fresh state), so a preempted-and-recomputed request
    restarts cleanly and rejected speculative tokens are rolled back by resuming from an earlier
    snapshot. Verification rows keep one snapshot per token; other rows keep the final one.

    Shapes: a snapshot is ``recurrent`` (1, nh, d, d) float32 and ``conv`` (1, 3, P, C-1) float32.
    """

    def __init__(self, text: K3TextConfig, prefix: str) -> None:
        super().__init__()
        self.text, self.prefix = text, prefix
        la = text.linear_attn_config
        self.heads, self.head_dim, self.lower_bound = la.num_heads, la.head_dim, la.gate_lower_bound
        self.conv_width = la.short_conv_kernel_size
        self.weights: KDAWeights | None = None
        self.states: dict[int, dict[int, KDAState]] = {}
        self.plan: list[RequestRows] | None = None

    def _run(self, x: torch.Tensor, state: KDAState) -> torch.Tensor:
        return kda_forward(self.weights, x, state, heads=self.heads, head_dim=self.head_dim,
                           lower_bound=self.lower_bound, eps=self.text.rms_norm_eps)

    def _resume(self, r: RequestRows, device: torch.device) -> KDAState:
        if r.position == 0:
            self.states[r.key] = {}
            return KDAState.zeros(1, self.heads, self.head_dim, self.conv_width, device)
        snap = self.states.get(r.key, {}).get(r.position)
        if snap is None:
            raise KDAStateError(
                f"{self.prefix}: no KDA state for request (first KV block {r.key}) after {r.position} tokens; "
                f"held: {sorted(self.states.get(r.key, {}))}. Prefix caching must be off "
                "(enable_prefix_caching=False) so vLLM never skips tokens this layer has not seen."
            )
        return KDAState(snap.recurrent.clone(), snap.conv.clone())

    def _keep(self, r: RequestRows, n: int, st: KDAState) -> None:
        snaps = self.states.setdefault(r.key, {})
        snaps[n] = KDAState(st.recurrent.clone(), st.conv.clone())
        for old in [k for k in snaps if k < r.position]:
            del snaps[old]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """KDA over the step's rows.

        Args:
            x: (N, H) the normalized attention input, rows grouped by request in :attr:`plan` order.

        Returns:
            (N, H) in ``x``'s dtype (rows not in the plan, i.e. padding, are zero).

        Raises:
            KDAStateError: a request resumes from a position whose state was never computed.
        """
        if self.plan is None:  # profile / dummy run: no requests; run the math on a fresh state
            st = KDAState.zeros(1, self.heads, self.head_dim, self.conv_width, x.device)
            return self._run(x.unsqueeze(0), st).squeeze(0)
        out = torch.zeros_like(x)
        singles = [r for r in self.plan if r.length == 1]
        if singles:  # plain decode rows batched: B requests x 1 token
            sts = [self._resume(r, x.device) for r in singles]
            st = KDAState(torch.cat([s.recurrent for s in sts]), torch.cat([s.conv for s in sts]))
            rows = torch.tensor([r.start for r in singles], device=x.device)
            out[rows] = self._run(x[rows].unsqueeze(1), st).squeeze(1)
            for b, r in enumerate(singles):
                self._keep(r, r.position + 1, KDAState(st.recurrent[b:b + 1], st.conv[b:b + 1]))
        for r in self.plan:
            if r.length <= 1:
                continue
            st = self._resume(r, x.device)
            if r.verify:  # one snapshot per token: any prefix of the drafts may be accepted
                for t in range(r.length):
                    out[r.start + t] = self._run(x[r.start + t].view(1, 1, -1), st)[0, 0]
                    self._keep(r, r.position + t + 1, st)
            else:
                out[r.start:r.start + r.length] = self._run(x[r.start:r.start + r.length].unsqueeze(0), st)[0]
                self._keep(r, r.position + r.length, st)
        return out


class K3MLALayer(nn.Module):
    """One gated NoPE MLA layer: k3_model's projections around vLLM's ``MLAAttention`` (paged latent cache).

    ``q = q_b(RMSNorm(q_a(x)))`` split into ``q_nope | q_pe``; ``c = RMSNorm(kv_a(x)[:L])``,
    ``k_pe = kv_a(x)[L:]`` (raw, never rotated); vLLM attends with scale ``(n + r)^-1/2``; the output is
    gated by ``sigmoid(g_proj(x))`` before ``o_proj``.

    Source: k3_architecture.md §4.3.
    """

    def __init__(self, text: K3TextConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.text = text
        t = text
        nh, n, r, dv, L = t.num_attention_heads, t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim, t.kv_lora_rank
        self.kv_b_proj = ColumnParallelLinear(L, nh * (n + dv), bias=False, quant_config=None,
                                              prefix=f"{prefix}.kv_b_proj")
        self.attn = MLAAttention(num_heads=nh, scale=(n + r) ** -0.5, qk_nope_head_dim=n, qk_rope_head_dim=r,
                                 v_head_dim=dv, q_lora_rank=t.q_lora_rank, kv_lora_rank=L, kv_b_proj=self.kv_b_proj,
                                 cache_config=vllm_config.cache_config, quant_config=None, prefix=f"{prefix}.attn")
        self.weights: MLAWeights | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, H) normalized attention input. Returns (N, H)."""
        t, w = self.text, self.weights
        nh, n, r, dv, L = t.num_attention_heads, t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim, t.kv_lora_rank
        eps = t.rms_norm_eps
        N = x.shape[0]
        q = F.linear(rms_norm(F.linear(x, w.q_a_proj), w.q_a_layernorm, eps), w.q_b_proj).view(N, nh, n + r)
        kv = F.linear(x, w.kv_a_proj_with_mqa)
        c = rms_norm(kv[:, :L], w.kv_a_layernorm, eps).contiguous()
        k_pe = kv[:, L:].unsqueeze(1).contiguous()
        o = self.attn(q.contiguous(), c, k_pe, output_shape=(N, nh * dv))
        o = (o.float() * torch.sigmoid(F.linear(x, w.g_proj).float())).to(x.dtype)
        return F.linear(o, w.o_proj)


class K3ForCausalLM(nn.Module):
    """K3 / K3-mini for vLLM (see the module docstring).

    Args:
        vllm_config: the engine config. prefix: vLLM's module prefix (``""`` for the target model).

    Raises:
        K3ServingConfigError: bad ``decode_backend``, tensor/pipeline parallelism other than 1, or no
            local checkpoint folder.
        k3_model.config.K3ConfigError: config.json is not a valid ``kimi_k3`` config.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        pc = vllm_config.parallel_config
        if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
            raise K3ServingConfigError(
                f"K3ForCausalLM: tensor_parallel_size={pc.tensor_parallel_size}, pipeline_parallel_size="
                f"{pc.pipeline_parallel_size}; this model runs its weights unsharded (TP=1, PP=1 only)."
            )
        self.cfg = _k3_config(vllm_config)
        self.text = t = self.cfg.text_config
        self.dtype = vllm_config.model_config.dtype
        self.decode_backend = resolve_decode_backend(vllm_config.additional_config,
                                                     vllm_config.model_config.hf_config)
        spec = vllm_config.speculative_config
        self.num_spec = int(spec.num_speculative_tokens) if spec is not None and spec.num_speculative_tokens else 0
        folder = trace_dir(vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else None)
        self.trace = StepTrace(folder, role=prefix or "target") if folder is not None else None
        pre = f"{prefix}." if prefix else ""
        self.layers = nn.ModuleList(
            K3MLALayer(t, vllm_config, f"{pre}model.layers.{i}.self_attn") if t.is_mla_layer(i)
            else K3KDALayer(t, f"{pre}model.layers.{i}.self_attn")
            for i in range(t.num_hidden_layers)
        )
        self._model: K3Model | None = None
        self._mla_name = next(f"{pre}model.layers.{i}.self_attn.attn" for i in range(t.num_hidden_layers)
                              if t.is_mla_layer(i))
        logger.info("K3ForCausalLM: decode_backend=%s num_spec=%d layers=%s trace=%s", self.decode_backend,
                    self.num_spec, "".join("M" if t.is_mla_layer(i) else "K" for i in range(t.num_hidden_layers)),
                    None if self.trace is None else self.trace.path)

    # ---- weights ---------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the generator's safetensors (HF names) through k3_model's own checks and layout.

        Returns:
            The names of this module's parameters that were loaded (the MLA ``kv_b_proj`` ones).

        Raises:
            k3_model.model.K3WeightsError: tensors missing, unexpected or misshapen.
        """
        tensors = {name: w for name, w in weights}
        self._model = K3Model(self.cfg, tensors, dtype=self.dtype, device="cpu")
        loaded: set[str] = set()
        params = dict(self.named_parameters())
        for i, (layer, lw) in enumerate(zip(self.layers, self._model.layers)):
            layer.weights = lw.attn
            if isinstance(layer, K3MLALayer):
                name = f"layers.{i}.kv_b_proj.weight"
                p = params[name]
                getattr(p, "weight_loader", None)(p, tensors[f"model.layers.{i}.self_attn.kv_b_proj.weight"].to(p.dtype))
                loaded.add(name)
        return loaded

    # ---- forward ---------------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._model.embed_tokens[input_ids]

    def _plan(self, positions: torch.Tensor) -> list[RequestRows] | None:
        """The step's requests from the first MLA layer's metadata (``None`` in a profile/dummy run).

        MLA orders rows decodes first, then prefills; the request key is column 0 of the block table
        (``decode.block_table`` then ``prefill.block_table``). With speculative decoding, the verification
        rows are vLLM's own decode rows (``num_decodes``, on backends that decode spec rows) and, on CPU_MLA
        (whose metadata lists them among the prefills: ``reorder_batch_threshold`` stays 1), every row with
        context and 2 to 1 + D tokens.
        """
        meta = get_forward_context().attn_metadata
        if isinstance(meta, list):
            meta = meta[0]
        if not isinstance(meta, dict) or not meta:
            return None
        m = meta.get(self._mla_name)
        if m is None or m.num_reqs == 0:
            return None
        tables = []
        if m.num_decodes:
            tables.append(m.decode.block_table[: m.num_decodes, 0])
        if m.num_prefills:
            tables.append(m.prefill.block_table[: m.num_prefills, 0])
        keys = torch.cat(tables).tolist()
        loc = m.query_start_loc[: m.num_reqs + 1].tolist()
        pos = positions.tolist()
        if len(keys) != m.num_reqs:
            raise KDAStateError(f"K3ForCausalLM: MLA metadata lists {m.num_reqs} requests but {len(keys)} block-table "
                                "rows; cannot key the KDA state.")
        plan = []
        for i in range(m.num_reqs):
            q = loc[i + 1] - loc[i]
            if q == 0:
                continue
            start = int(pos[loc[i]])
            # CPU_MLA does not treat spec rows as decodes (reorder threshold 1), so a verification row of
            # 1 + D tokens is listed among the prefills; with context and at most 1 + D tokens it is one
            # (chunked prefill is off with MLA on CPU, and a snapshot per token is correct for any row)
            verify = self.num_spec > 0 and q > 1 and (i < m.num_decodes or (start > 0 and q <= 1 + self.num_spec))
            plan.append(RequestRows(int(keys[i]), loc[i], q, start, verify))
        return plan

    def _phase(self, plan: list[RequestRows] | None, num_decodes: int) -> str:
        if not plan:
            return "prefill"  # profile/dummy run: never the decode path
        spec_rows = [r.verify or r.length == 1 for r in plan] if self.num_spec else None
        return classify_batch([r.length for r in plan], [r.position for r in plan], num_spec=self.num_spec,
                              spec_rows=spec_rows)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        """The decoder stack on vLLM's flat token rows.

        Args:
            input_ids: (N,) int64 (or None with ``inputs_embeds``). positions: (N,) int64 token positions.
            inputs_embeds: optional (N, H).

        Returns:
            (N, H) the output AttnRes mix (pre-norm; :meth:`compute_logits` applies norm and head).
        """
        plan = self._plan(positions)
        phase = self._phase(plan, 0)
        qlens = [r.length for r in plan] if plan else []
        for layer in self.layers:
            if isinstance(layer, K3KDALayer):
                layer.plan = plan
        try:
            with record_trace() as trace, forward_context(decode_backend=self.decode_backend, phase=phase,
                                                          requests=len(plan) if plan else None,
                                                          query_len=max(qlens) if phase == "spec_verify" else None):
                out = self._forward(input_ids, inputs_embeds)
        finally:
            for layer in self.layers:
                if isinstance(layer, K3KDALayer):
                    layer.plan = None
        if self.trace is not None and qlens:
            self.trace.write(phase=phase, query_lens=qlens, decode_backend=self.decode_backend,
                             decisions=trace.decisions)
        return out

    def _forward(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        m, t = self._model, self.text
        eps = t.rms_norm_eps
        h0 = inputs_embeds if inputs_embeds is not None else m.embed_tokens[input_ids]
        blocks: list[torch.Tensor] = []
        prefix: torch.Tensor | None = h0
        for layer, lw in zip(self.layers, m.layers):
            a_in = attn_res_mix(torch.stack([*blocks, prefix], 1), lw.self_attention_res_norm,
                                lw.self_attention_res_proj, eps)
            if t.writes_attn_res_block(lw.index):
                blocks.append(prefix)
                prefix = None
            y = layer(rms_norm(a_in, lw.input_layernorm, eps))
            prefix = y if prefix is None else prefix + y
            m_in = attn_res_mix(torch.stack([*blocks, prefix], 1), lw.mlp_res_norm, lw.mlp_res_proj, eps)
            prefix = prefix + m.ffn(lw, rms_norm(m_in, lw.post_attention_layernorm, eps))
        return attn_res_mix(torch.stack([*blocks, prefix], 1), m.output_attn_res_norm, m.output_attn_res_proj, eps)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: (N, H). Returns (N, V) float32 logits (final norm, untied lm_head)."""
        m = self._model
        return F.linear(rms_norm(hidden_states, m.norm, self.text.rms_norm_eps), m.lm_head).float()
