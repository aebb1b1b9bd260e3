"""Write a K3-mini checkpoint: random weights with a fixed seed (safetensors), config.json, tokenizer.

Usage: ``workbench model generate --out DIR [--config k3_mini] [--seed 0]`` or
``python -m k3_model.generate --out DIR``. The folder then holds ``config.json``,
``generation_config.json``, ``model.safetensors`` (one shard; bf16 with the fp32 tensors of
k3_architecture.md §2), ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``:
what ``K3Model`` (:func:`load_checkpoint`) and vLLM (``model=DIR, tokenizer=DIR``) read. Same seed,
same bytes.

Source: issue 6 ("weights are random with a fixed seed, written as safetensors with a config.json and
a small tokenizer built locally (no hub); a generator command makes them").
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from k3_model.hf_config import K3HFConfig, k3_mini_hf_config, load_hf_config, parse_hf_config
from k3_model.model import K3Model, check_weights, random_weights

CONFIGS: dict[str, Callable[[], dict[str, Any]]] = {"k3_mini": k3_mini_hf_config}
"""Named configs the generator can write (real K3 weights are far too large to generate)."""
WEIGHTS_FILE = "model.safetensors"


def write_checkpoint(out_dir: str | Path, *, config: str = "k3_mini", seed: int = 0,
                     with_tokenizer: bool = True) -> list[Path]:
    """Generate and write a checkpoint folder.

    Args:
        out_dir: created if missing; existing checkpoint files are overwritten.
        config: a key of :data:`CONFIGS`.
        seed: weight seed (the tokenizer's training text is fixed).
        with_tokenizer: also train and write the tokenizer (about 5 s).

    Returns:
        The written files.

    Raises:
        ValueError: unknown config name.
        k3_model.config.K3ConfigError: the config does not validate.
    """
    from safetensors.torch import save_file

    from k3_model.tokenizer import build_tokenizer, save_tokenizer

    if config not in CONFIGS:
        raise ValueError(f"write_checkpoint: unknown config {config!r}; known: {', '.join(CONFIGS)}.")
    data = CONFIGS[config]()
    data["k3_workbench"] = {"generator": "k3_model.generate", "config": config, "weights_seed": seed}
    cfg = parse_hf_config(data)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    p = out / "config.json"
    p.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    paths.append(p)
    p = out / "generation_config.json"
    p.write_text(json.dumps({"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
                             "pad_token_id": cfg.pad_token_id, "do_sample": False}, indent=2) + "\n", encoding="utf-8")
    paths.append(p)
    tensors = random_weights(cfg, seed)
    p = out / WEIGHTS_FILE
    save_file(tensors, str(p), metadata={"format": "pt"})  # one key: the header's key order is then fixed
    paths.append(p)
    if with_tokenizer:
        tok = build_tokenizer(cfg.text_config.vocab_size)
        paths += save_tokenizer(tok, out, bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id, pad_id=cfg.pad_token_id,
                                model_max_length=cfg.text_config.max_position_embeddings)
    return paths


def load_checkpoint(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> K3Model:
    """Load a checkpoint folder written by :func:`write_checkpoint` (or any unquantized ``kimi_k3`` one
    with these tensor names, in one or more ``*.safetensors`` files).

    Raises:
        k3_model.config.K3ConfigError: config.json missing or invalid.
        k3_model.model.K3WeightsError: tensors missing, unexpected or misshapen; or quantized weights.
        FileNotFoundError: no ``*.safetensors`` file in the folder.
    """
    from safetensors.torch import load_file

    from k3_model.model import K3WeightsError

    folder = Path(path)
    cfg: K3HFConfig = load_hf_config(folder)
    if cfg.text_config.quantization_config is not None:
        raise K3WeightsError(f"{folder}: quantized checkpoints (quantization_config present) are not supported by the "
                             "standalone model; generate an unquantized one.")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors file; generate one with `workbench model generate`.")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    check_weights(cfg, tensors)
    return K3Model(cfg, tensors, dtype=dtype, device=device)


def main(argv: list[str] | None = None) -> int:
    """``python -m k3_model.generate --out DIR [--config k3_mini] [--seed 0] [--no-tokenizer]``."""
    ap = argparse.ArgumentParser(prog="python -m k3_model.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="checkpoint folder to write")
    ap.add_argument("--config", default="k3_mini", choices=sorted(CONFIGS))
    ap.add_argument("--seed", default=0, type=int, help="weight seed")
    ap.add_argument("--no-tokenizer", action="store_true", help="skip training the tokenizer")
    args = ap.parse_args(argv)
    for p in write_checkpoint(args.out, config=args.config, seed=args.seed, with_tokenizer=not args.no_tokenizer):
        print(p)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
