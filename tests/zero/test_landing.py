"""Note [landing off backward's thread]: parts land in the order sent, a
reader waits only for the parts before its mark, and a part that failed to
land is raised to the readers it concerns, once it is moot to none."""

import threading

import pytest
import torch

from offload.zero.landing import Lander


class _Copy:
    """A copy that lands when let go (``go``), or fails."""

    def __init__(self, values: torch.Tensor, fails: bool = False) -> None:
        self.tensor, self.fails, self.go, self.released = values, fails, threading.Event(), False
        self.fails_with = "the copy failed"

    def done(self) -> bool:
        return self.go.is_set()

    def wait(self) -> torch.Tensor:
        self.go.wait()
        if self.fails:
            raise OSError(self.fails_with)
        return self.tensor

    def release(self) -> None:
        self.released = True


def test_a_reader_waits_for_the_parts_before_its_mark_only():
    lander, total = Lander(threaded=True), torch.zeros(2)
    first, second = _Copy(torch.ones(2)), _Copy(torch.full((2,), 2.0))
    lander.submit(first, add_into=total)
    mark = lander.submitted
    lander.submit(second, add_into=total)
    waiting = threading.Thread(target=lander.wait, args=(mark,))
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive()  # the first part has not landed
    first.go.set()
    waiting.join(5)
    assert not waiting.is_alive() and torch.equal(total, torch.ones(2)) and not second.released
    second.go.set()
    lander.wait()
    assert torch.equal(total, torch.full((2,), 3.0)) and second.released
    lander.close()


def test_a_failed_part_is_raised_to_the_readers_it_concerns_until_forgotten():
    lander, total = Lander(threaded=True), torch.zeros(2)
    good, bad, later = _Copy(torch.ones(2)), _Copy(torch.ones(2), fails=True), _Copy(torch.ones(2))
    lander.submit(good, add_into=total)
    before_bad = lander.submitted
    lander.submit(bad, add_into=total)
    window = lander.submitted
    lander.submit(later, add_into=total)
    for copy in (good, bad, later):
        copy.go.set()
    lander.wait(before_bad)  # the failure came after this reader's parts
    for _ in range(2):
        with pytest.raises(OSError, match="the copy failed"):
            lander.wait()
    assert bad.released  # its staging buffer went back all the same
    lander.forget(window)  # that window was zeroed: its failure is moot
    lander.wait()
    lander.close()  # it was shown to a reader: not again


def test_a_failure_no_reader_saw_is_raised_at_close():
    lander = Lander(threaded=True)
    seen, unseen = _Copy(torch.ones(2), fails=True), _Copy(torch.ones(2), fails=True)
    lander.submit(seen, add_into=torch.zeros(2))
    seen.go.set()
    with pytest.raises(OSError):
        lander.wait()
    unseen.fails_with = "the second copy failed"
    lander.submit(unseen, add_into=torch.zeros(2))
    unseen.go.set()
    with pytest.raises(OSError, match="the second copy failed"):  # though an earlier one was shown
        lander.close()
