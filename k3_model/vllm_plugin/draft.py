"""A small K3-style draft model for speculative decoding, standing in for DSpark.

DSpark (K3's real drafter) is a few dense MLA layers reading the target's hidden states; vLLM's CPU
build has no DSpark method, so this stands in with vLLM's ``draft_model`` method: a one-layer K3
checkpoint (gated NoPE MLA + dense SiTU MLP, K3-mini's width, vocabulary and tokenizer) served by the
same ``K3ForCausalLM``. It is MLA-only on purpose: a draft with ordinary attention cannot share the KV
cache with CPU_MLA (docs/vllm.md: ``No common block size ... CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)]``).

``python -m k3_model.vllm_plugin.draft --target DIR --out DRAFT_DIR [--seed 1]``

Source: shared/reference/k3_architecture.md §6 (DSpark: dense MLA draft layers, 7 draft tokens);
shared/reference/vllm_cpu.md §5 (``draft_model`` works on CPU).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from k3_model.hf_config import k3_mini_hf_config, parse_hf_config
from k3_model.model import random_weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def draft_hf_config() -> dict[str, Any]:
    """K3-mini reduced to one MLA layer with the dense MLP, written as a flat ``kimi_linear`` text config.

    Flat (no ``kimi_k3`` wrapper) because vLLM rewrites any ``kimi_k3`` draft into its K3 MTP module
    (``SpeculativeConfig.hf_config_override``: ``model_type = "kimi_k3_mtp"``, ``n_predict =
    num_nextn_predict_layers``), which then fails with ``ZeroDivisionError: integer modulo by zero``
    for a checkpoint without MTP layers. ``K3ForCausalLM`` wraps a flat config back
    (:func:`k3_model.vllm_plugin.model.wrap_text_config`).
    """
    cfg = k3_mini_hf_config()
    t = dict(cfg["text_config"])
    t["architectures"] = ["K3ForCausalLM"]
    t["num_hidden_layers"] = 1
    t["linear_attn_config"] = {**t["linear_attn_config"], "full_attn_layers": [1], "kda_layers": []}
    t["intermediate_size"] = 256
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        t[key] = cfg[key]
    return t


def write_draft_checkpoint(target_dir: str | Path, out_dir: str | Path, *, seed: int = 1) -> list[Path]:
    """Write the draft checkpoint next to a K3-mini target (its tokenizer files are copied).

    Raises:
        FileNotFoundError: the target folder lacks a tokenizer file.
        k3_model.config.K3ConfigError: the draft config does not validate.
    """
    from safetensors.torch import save_file

    from k3_model.vllm_plugin.model import wrap_text_config

    data = draft_hf_config()
    cfg = parse_hf_config(wrap_text_config(data), where="draft config")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "config.json", out / "model.safetensors"]
    paths[0].write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    save_file(random_weights(cfg, seed), str(paths[1]), metadata={"format": "pt", "seed": str(seed)})
    for name in TOKENIZER_FILES:
        src = Path(target_dir) / name
        if not src.is_file():
            raise FileNotFoundError(f"write_draft_checkpoint: {src} is missing; generate the target first "
                                    "(python -m k3_model.generate --out DIR).")
        paths.append(Path(shutil.copy(src, out / name)))
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3_model.vllm_plugin.draft", description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, type=Path, help="the K3-mini checkpoint folder (for its tokenizer)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", default=1, type=int)
    args = ap.parse_args(argv)
    for p in write_draft_checkpoint(args.target, args.out, seed=args.seed):
        print(p)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
