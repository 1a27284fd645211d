import pytest

from .harness import let_the_worker_finish


@pytest.fixture
def worker_finishes_its_queue(monkeypatch):
    """harness.let_the_worker_finish, undone after the test."""
    let_the_worker_finish(monkeypatch.setattr)
