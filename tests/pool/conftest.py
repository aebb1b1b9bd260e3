"""Fixtures for the pool tests: the real Ray cluster of ``.ci/install-services.sh`` and a private clone.

Without ``WORKBENCH_TEST_RAY_ADDRESS`` (or without Ray) the cluster tests skip with the reason; under
``CI=true`` they fail instead: CI must run them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from pool_helpers import in_ci

from workbench import envs


@pytest.fixture(scope="session")
def ray_address() -> str:
    """``ray://HOST:PORT`` of the test cluster."""
    address = envs.TEST_RAY_ADDRESS.read()
    why = None
    if not address:
        why = (f"{envs.TEST_RAY_ADDRESS.name} is not set: start a cluster with `bash .ci/install-services.sh` "
               "and `source .ci/services.env`")
    else:
        try:
            import ray  # noqa: F401
        except ImportError:
            why = "Ray is not installed (pip install -e '.[pool]')"
    if why:
        if in_ci():
            pytest.fail(f"CI=true: the pool tests need a real Ray cluster; {why}.")
        pytest.skip(why)
    return address


@pytest.fixture(scope="module")
def repo(pristine_repo, tmp_path_factory) -> Path:
    """A private clone of the project without its merged kernels (worktrees and branches stay there)."""
    d = tmp_path_factory.mktemp("repo") / "repo"
    subprocess.run(["git", "clone", "-q", str(pristine_repo), str(d)], check=True)
    return d
