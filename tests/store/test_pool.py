"""The pinned pool: aligned buffers, reuse, and a hard cap that fails clearly."""

import pytest

from offload.store.pool import ALIGN, PinnedPool, PoolExhausted


def test_buffers_are_aligned_rounded_and_reused():
    pool = PinnedPool(1 << 20)
    a = pool.acquire(5000)
    assert a.nbytes == 8192 and a.data.numel() == 8192 and a.data.data_ptr() % ALIGN == 0
    pool.release(a)
    assert pool.acquire(6000) is a  # same size class: the idle buffer comes back


def test_cap_is_enforced_with_a_message_naming_the_setting():
    pool = PinnedPool(64 * 1024, setting="offload_optimizer.pinned_limit_bytes")
    held = [pool.acquire(8192) for _ in range(5)]  # 5 x (8 KiB + alignment slack) = 60 KiB
    with pytest.raises(PoolExhausted, match=r"raise offload_optimizer\.pinned_limit_bytes"):
        pool.acquire(8192)
    assert pool.allocated_bytes <= pool.limit_bytes
    pool.release(held[0])
    assert pool.acquire(8192) is held[0]


def test_idle_buffers_of_other_sizes_are_freed_to_make_room():
    pool = PinnedPool(64 * 1024)
    small = [pool.acquire(4096) for _ in range(6)]
    for b in small:
        pool.release(b)
    big = pool.acquire(40_000)
    assert big.nbytes == 40_960 and pool.allocated_bytes <= pool.limit_bytes


def test_double_release_is_refused():
    pool = PinnedPool(1 << 20)
    b = pool.acquire(10)
    pool.release(b)
    with pytest.raises(ValueError, match="released twice"):
        pool.release(b)
