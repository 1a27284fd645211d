import os
import signal

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


@pytest.fixture
def default_sigint():
    """SIGINT as in a terminal, whatever the test runner was started with (a
    job started with ``&`` from a script ignores it)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
