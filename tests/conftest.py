import os
import random
import zlib

import numpy as np
import pytest
import torch

from sglang_cpu import install_torchvision_shim

# The test install's torchvision (pinned by SGLang 0.5.23) is a CUDA build whose ops cannot
# register on CPU torch; transformers imports it. Define the two schemas before anything does.
install_torchvision_shim()


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    # On 2 shared cores, OpenMP threads spinning against the tests' other processes (server
    # ranks, gloo peers) make tiny forwards up to 20x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fixed_rng(request):
    # Each test starts from its own fixed random state, whatever ran before it in its process:
    # under pytest-xdist which tests share a worker varies from run to run. Tests that want a
    # fresh draw every run take the seed fixture below, which reseeds after this one.
    value = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value)


@pytest.fixture
def seed():
    """A fresh random seed per test (printed by pytest on failure through the fixture value)."""
    value = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(value)
    return value
