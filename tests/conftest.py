import os
import sys
import zlib

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/oracle.py


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture
def rng():
    """A fresh generator per test, seeded from the test's name: different inputs per test, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "").encode()))
