import os

import pytest
import torch


@pytest.fixture
def seed():
    """A fresh random seed per test (printed by pytest on failure through the fixture value)."""
    value = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(value)
    return value
