"""Calibrate the model eval's bfloat16 flip bound from A/A runs of the standard path against itself.

The bfloat16 leg of ``guards/model_eval.py`` teacher-forces the candidate on the standard path's greedy
tokens and FAILs a flip (argmax != the standard's token) where the standard's top-1/top-2 logit margin
exceeds ``bf16_tie_margin``. Which margins can an honest difference flip? This script measures it with
no candidate at all: K3-mini in bfloat16 on the standard path, a reference run (the guard's bf16 shape:
``batch`` sequences, ``bf16_context_tokens`` prompt, ``bf16_generate_tokens`` generated, prefill chunks and
MLA pages of :data:`guards.model_eval.BF16_PREFILL_CHUNK` / ``BF16_PAGE_TOKENS``), then the same
sequences teacher-forced on the reference tokens in another valid batch composition:

- ``reversed``: the same batch in reverse row order;
- ``alone``: each sequence decoded at batch 1 (GEMMs of another M take another reduction order);
- ``padded``: the batch plus ``batch`` other prompts (batch 2 * ``batch``).

Every flip's reference margin (nats) is recorded, each sequence's first one too; the bound on a first
divergence (``bf16_tie_margin``) is ``BF16_SAFETY`` x the largest first-flip margin, the bound on later
flips (``bf16_later_tie_margin``) the same of every flip's; in short, each is
``guards.model_eval.BF16_SAFETY`` (2) x the largest A/A flip margin seen: a candidate's flip FAILs only at
twice any margin at which the standard path flipped against itself. Writes ``bench/results/cpu/model_eval_bf16_calibration.json``
with the environment.

    PYTHONPATH=$PWD python bench/model_eval_calibration.py [--seeds 6] [--threads 1] [--device cpu|cuda] [--out PATH]

Source: issue 15 item 3 ("a bound calibrated from A/A runs (the standard path against itself with a
different but valid reduction order or batch composition)").
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _flips(ref_tokens, ref_margin, other, rows, first_seq: int = 0) -> list[dict]:
    """Teacher-forced flips of the run ``other``: its row ``rows[b]`` replays reference sequence ``b``.

    Args:
        ref_tokens, ref_margin: (B, G) the reference's greedy tokens and top-1/top-2 margins (nats).
        other: a :class:`k3_model.decode.GenerationResult` forced on those tokens.
        first_seq: the reference index of row 0 (for the ``alone`` runs).
    """
    out = []
    for b, r in enumerate(rows):
        bad = (other.argmax[r] != ref_tokens[b]).nonzero().flatten().tolist()
        for i, g in enumerate(bad):
            out.append({"sequence": first_seq + b, "token": g, "first": i == 0,
                        "reference_margin": float(ref_margin[b, g]), "variant_margin": float(other.margin[r, g])})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=6, help="weight/prompt seeds (count)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model runs")
    ap.add_argument("--out", type=Path, default=None,
                    help="result file [bench/results/cpu/model_eval_bf16_calibration.json on cpu, "
                         "bench/results/h200/model_eval_bf16_calibration.json on cuda]")
    args = ap.parse_args()
    if args.out is None:
        args.out = Path("bench/results/cpu/model_eval_bf16_calibration.json" if args.device == "cpu"
                        else "bench/results/h200/model_eval_bf16_calibration.json")

    import torch

    from guards.model_eval import BF16_PAGE_TOKENS, BF16_PREFILL_CHUNK, ModelEvalSettings
    from guards.model_eval import BF16_SAFETY as SAFETY
    from k3_model.decode import generate
    from k3_model.hf_config import k3_mini_hf_config, parse_hf_config
    from k3_model.model import K3Model, random_weights
    from workbench.env import collect

    torch.set_num_threads(args.threads)
    s = ModelEvalSettings()
    cfg = parse_hf_config(k3_mini_hf_config())
    bos = k3_mini_hf_config()["bos_token_id"]
    B, T0, G = s.batch, s.bf16_context_tokens, s.bf16_generate_tokens
    kw = {"prefill_chunk": BF16_PREFILL_CHUNK, "page_tokens": BF16_PAGE_TOKENS}
    runs, t_start = [], time.monotonic()
    for seed in range(args.seeds):
        model = K3Model(cfg, random_weights(cfg, 1000 + seed), dtype=torch.bfloat16, device=args.device)
        prompts = torch.randint(0, bos, (2 * B, T0), generator=torch.Generator().manual_seed(seed))
        t0 = time.monotonic()
        ref = generate(model, prompts[:B], G, **kw)
        ref_s = time.monotonic() - t0
        variants = {}
        rev = generate(model, prompts[:B].flip(0), G, forced=ref.tokens.flip(0), **kw)
        variants["reversed"] = _flips(ref.tokens, ref.margin, rev, list(range(B - 1, -1, -1)))
        alone = []
        for b in range(B):
            one = generate(model, prompts[b:b + 1], G, forced=ref.tokens[b:b + 1], **kw)
            alone += _flips(ref.tokens[b:b + 1], ref.margin[b:b + 1], one, [0], first_seq=b)
        variants["alone"] = alone
        forced = torch.cat([ref.tokens, generate(model, prompts[B:], G, **kw).tokens])
        pad = generate(model, prompts, G, forced=forced, **kw)
        variants["padded"] = _flips(ref.tokens, ref.margin, pad, list(range(B)))
        runs.append({"weights_seed": 1000 + seed, "prompt_seed": seed, "reference_run_s": round(ref_s, 2),
                     "variants": variants,
                     "reference_margin_quantiles": {q: float(torch.quantile(ref.margin.flatten().double(), q))
                                                    for q in (0.01, 0.1, 0.5)}})
        print(f"seed {seed}: " + ", ".join(f"{k} {len(v)} flips" for k, v in variants.items())
              + f" (reference run {ref_s:.1f} s)", flush=True)
    margins = [f["reference_margin"] for r in runs for v in r["variants"].values() for f in v]
    first = [f["reference_margin"] for r in runs for v in r["variants"].values() for f in v if f["first"]]
    worst = max(margins, default=0.0)
    fractions = sorted(sum(1 for f in v if f["sequence"] == b) / G for r in runs for v in r["variants"].values()
                       for b in range(B))
    doc = {
        "what": "A/A flips of K3-mini's standard path in bfloat16 against itself in other batch compositions "
                "(teacher-forced on the reference's greedy tokens); the model eval's bf16_tie_margin comes from it",
        "command": f"PYTHONPATH=$PWD python bench/model_eval_calibration.py --seeds {args.seeds} --threads {args.threads} "
                   f"--device {args.device}",
        "environment": {**collect(args.device), "torch_threads": args.threads},
        "shape": {"batch": B, "context_tokens": T0, "generate_tokens": G, **kw, "dtype": "bfloat16"},
        "runs": runs,
        "flips": len(margins),
        "sequences_compared": args.seeds * B * 3,
        "first_flip_margins_nats": sorted(first),
        "all_flip_margins_nats": sorted(margins),
        "max_aa_flip_margin_nats": worst,
        "max_aa_first_flip_margin_nats": max(first, default=0.0),
        "rule": f"bf16_tie_margin = {SAFETY:g} x the largest A/A margin at a sequence's first flip (where free-running "
                f"greedy decode first diverges); bf16_later_tie_margin = {SAFETY:g} x the largest A/A margin at any "
                "teacher-forced flip (later flips come after the recurrent state has parted, where A/A margins are "
                "larger); bf16_max_flip_fraction = 2 x the largest fraction of one sequence's teacher-forced "
                "steps that flipped in an A/A run",
        "bound_nats": SAFETY * max(first, default=0.0),
        "later_bound_nats": SAFETY * worst,
        "flip_fractions": fractions,
        "max_aa_flip_fraction": max(fractions),
        "flip_fraction_bound": SAFETY * max(fractions),
        "duration_s": round(time.monotonic() - t_start, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(margins)} A/A flips ({len(first)} first ones): bounds {doc['bound_nats']:.4g} nats (first divergence), "
          f"{doc['later_bound_nats']:.4g} nats (later flips); {args.out}")


if __name__ == "__main__":
    main()
