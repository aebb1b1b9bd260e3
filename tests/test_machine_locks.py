"""The suite's machine locks (tests/conftest.py): the helpers test modules import act on the state the
loaded conftest's fixtures read."""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import expecting_gain

CONFTEST = Path(__file__).with_name("conftest.py").resolve()


def _loaded_conftest(config):
    """The module object pytest loaded tests/conftest.py as (its fixtures and hooks live there)."""
    mods = [m for m in config.pluginmanager.get_plugins()
            if getattr(m, "__file__", None) and Path(m.__file__).resolve() == CONFTEST]
    assert len(mods) == 1, mods
    return mods[0]


def test_expecting_gain_from_tests_conftest_reaches_the_loaded_conftest(request):
    loaded = _loaded_conftest(request.config)
    assert loaded.__name__ != "tests.conftest"  # two module objects for one file: the case this guards
    assert loaded._held.get("gain") is None
    with expecting_gain():
        assert loaded._held.get("gain") is True  # what the timing-section hook reads
    assert loaded._held.get("gain") is None


def test_auto_workers_is_one_per_core_within_memory(request):
    loaded = _loaded_conftest(request.config)
    gib = 2**30
    assert loaded.auto_workers(2, 23 * gib) == 2  # the CI machine: one per core
    assert loaded.auto_workers(16, 32 * gib) == 4  # many cores, little memory: 7 GiB a worker
    assert loaded.auto_workers(4, 3 * gib) == 1  # never none
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert loaded.pytest_xdist_auto_num_workers(request.config) == loaded.auto_workers(len(os.sched_getaffinity(0)),
                                                                                       memory)
