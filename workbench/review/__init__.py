"""The human review queue: accepted candidates wait for a person, who approves (merge) or rejects.

Public surface: the store (:class:`ReviewStore`, :class:`State`, :class:`ReviewItem`), the
operations (:func:`submit_result`, :func:`approve`, :func:`reject`, :func:`open_store`), what a result
left unjudged (:func:`judgement_label`, :func:`unjudged_verdicts`) and the web
app (:func:`workbench.review.web.create_app`). Names resolve lazily so ``workbench --help`` does not
import SQLAlchemy.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "approve": "service", "default_reviewer": "service", "open_store": "service", "reject": "service",
    "judgement_label": "service", "unjudged_verdicts": "service",
    "submit_result": "service", "ReviewError": "store", "ReviewInputError": "store", "ReviewItem": "store", "ReviewStore": "store",
    "State": "store", "Transition": "store",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"workbench.review.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'workbench.review' has no attribute {name!r}")
