"""The machine locks' state in one pytest worker (tests/conftest.py), in a module of its own.

pytest loads ``tests/conftest.py`` as the module ``conftest``, and test modules import its helpers
(``expecting_gain``, ``released_share``) from ``tests.conftest``: two module objects, each with its own
globals. State kept in conftest's globals was therefore invisible to those helpers (a session fixture's
``expecting_gain`` timed without the machine to itself). Both copies import this module by one name.
"""

from __future__ import annotations

held: dict[str, object] = {}
"""This worker's open lock files while a test runs: ``dir``, the shared ``machine`` hold, and the flags
``gain`` (timing takes the machine alone) and ``exclusive`` (it has it now)."""

waits: dict[str, float] = {}
"""This worker's lock times (seconds) since its last test ended: waits at the turnstile (``shared_wait_s``),
for the machine alone (``exclusive_wait_s``), and time holding it alone (``exclusive_held_s``)."""
