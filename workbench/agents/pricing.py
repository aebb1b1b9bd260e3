"""Prices of Anthropic models, to turn recorded token counts into dollars.

Per million tokens (US dollars): base input, 5-minute cache write, cache read (hits and refreshes),
output. Source: Anthropic's pricing page, https://platform.claude.com/docs/en/about-claude/pricing
("Model pricing" table; as read on the date in :data:`PRICES_AS_OF`). Prices change: a model missing
here gets ``cost_usd = None`` (tokens are still recorded) and a logged warning; add a row to fix it.
Batch, long-context, data-residency and fast-mode surcharges are not modelled (the runner uses none).
"""

from __future__ import annotations

import dataclasses
import logging

logger = logging.getLogger("workbench.agents.pricing")

PRICES_SOURCE = "https://platform.claude.com/docs/en/about-claude/pricing (Model pricing table)"
PRICES_AS_OF = "2026-11"


@dataclasses.dataclass(frozen=True)
class ModelPrice:
    """US dollars per million tokens (USD/MTok)."""

    input_per_mtok: float
    cache_write_per_mtok: float
    cache_read_per_mtok: float
    output_per_mtok: float


PRICES: dict[str, ModelPrice] = {
    # model id prefix: price (longest matching prefix wins, so dated ids like ...-20250929 match)
    "claude-fable-5-1": ModelPrice(10.0, 12.50, 0.25, 50.0),
    "claude-mythos-5-1": ModelPrice(10.0, 12.50, 0.25, 50.0),
    "claude-fable-5": ModelPrice(10.0, 12.50, 1.00, 50.0),
    "claude-mythos-5": ModelPrice(10.0, 12.50, 1.00, 50.0),
    "claude-opus-5": ModelPrice(5.0, 6.25, 0.50, 25.0),
    "claude-opus-4-8": ModelPrice(5.0, 6.25, 0.50, 25.0),
    "claude-opus-4-7": ModelPrice(5.0, 6.25, 0.50, 25.0),
    "claude-opus-4-6": ModelPrice(5.0, 6.25, 0.50, 25.0),
    "claude-opus-4-5": ModelPrice(5.0, 6.25, 0.50, 25.0),
    "claude-opus-4-1": ModelPrice(15.0, 18.75, 1.50, 75.0),
    "claude-opus-4-0": ModelPrice(15.0, 18.75, 1.50, 75.0),
    "claude-opus-4-20250514": ModelPrice(15.0, 18.75, 1.50, 75.0),
    "claude-sonnet-5": ModelPrice(2.0, 2.50, 0.20, 10.0),
    "claude-sonnet-4-6": ModelPrice(3.0, 3.75, 0.30, 15.0),
    "claude-sonnet-4-5": ModelPrice(3.0, 3.75, 0.30, 15.0),
    "claude-sonnet-4-0": ModelPrice(3.0, 3.75, 0.30, 15.0),
    "claude-sonnet-4-20250514": ModelPrice(3.0, 3.75, 0.30, 15.0),
    "claude-haiku-4-5": ModelPrice(1.0, 1.25, 0.10, 5.0),
}
"""Sonnet 5 row from the Sonnet 5 model page (same source site); Sonnet 5.5, Opus 5.5 and Haiku 5.5 are
left out on purpose: their published rates changed during 2026 or depend on prompt length."""


def price_for(model: str) -> ModelPrice | None:
    """The price row whose key is the longest prefix of ``model``, or ``None``."""
    best = max((k for k in PRICES if model == k or model.startswith(k + "-")), key=len, default=None)
    return PRICES[best] if best else None


def cost_usd(model: str, *, input_tokens: int, output_tokens: int, cache_creation_input_tokens: int = 0,
             cache_read_input_tokens: int = 0) -> float | None:
    """Dollars for one response's usage, or ``None`` (logged) when the model is not in :data:`PRICES`.

    Args:
        model: the model id sent to the API.
        input_tokens, output_tokens, cache_creation_input_tokens, cache_read_input_tokens: from
            ``response.usage`` (tokens).
    """
    p = price_for(model)
    if p is None:
        logger.warning("no price for model %r in workbench/agents/pricing.py; cost not computed (tokens are recorded)", model)
        return None
    return round((input_tokens * p.input_per_mtok + output_tokens * p.output_per_mtok
                  + cache_creation_input_tokens * p.cache_write_per_mtok
                  + cache_read_input_tokens * p.cache_read_per_mtok) / 1e6, 6)
