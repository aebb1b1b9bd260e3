"""K3 model tests run torch single-threaded: the model's many small ops are 10x slower with a thread
pool on a shared 2-core machine (measured), and the guards' child processes use one thread too."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
