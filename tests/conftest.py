import os

import pytest
import torch

from offload import _native


def pytest_sessionstart(session):
    # `make test` sets this: there the native library was just built, so its
    # absence is a failure, not a reason to skip half the suite.
    if os.environ.get("OFFLOAD_REQUIRE_NATIVE") == "1" and not _native.status().available:
        pytest.exit(f"OFFLOAD_REQUIRE_NATIVE=1 but the native library is unavailable: {_native.status().reason}", returncode=1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
