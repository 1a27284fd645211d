"""Note [checksums in the Adam pass]: the Adam kernel computing its swap data's
chunk CRCs as it writes the state gives the CRCs of the bytes it leaves, in
every state format, kernel and thread count, and the same state as without."""

import pytest
import torch

from offload import _native
from offload.optim import AdamHyper, adam_step
from offload.optim.state_format import StateFormat
from offload.store.shard_file import ChunkCrcs

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")

# (moments, master, stage, stage 3 weights): fp32; bf16 moments; 8-bit moments (scales first);
# a bf16 master in the weights (the buffer holds the moments only); a bf16 master in the buffer.
FORMATS = {
    "fp32": ("float32", "float32", 2, "cpu"),
    "bf16-moments": ("bfloat16", "float32", 2, "cpu"),
    "int8-moments": ("int8", "float32", 2, "cpu"),
    "bf16-master-in-weights": ("float32", "bfloat16", 2, "cpu"),
    "bf16-master-in-buffer": ("int8", "bfloat16", 3, "nvme"),
}
# 4096: many chunks, each array split by several; 12288: chunks straddling two arrays; 1 MiB: one or two chunks.
CHUNKS = [4096, 3 * 4096, 1 << 20]
HYPER = AdamHyper(lr=1e-3, weight_decay=0.01)


def _isas():
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(_native.cpu_isa()) + 1] if _native.status().available else []


def _state(fmt: StateFormat, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    buffer = fmt.blank(n)[: fmt.nbytes(n)].clone()
    weights = torch.randn(n, generator=g).to(torch.bfloat16) if fmt.master_in_weights else None
    master, exp_avg, exp_avg_sq = fmt.views(buffer, n, weights)
    master.copy_(torch.randn(n, generator=g))
    return buffer, weights, torch.randn(n, generator=g)


def _step(fmt, buffer, weights, grad, n, threads, checksum=None, steps=(1, 2)):
    master, exp_avg, exp_avg_sq = fmt.views(buffer, n, weights)
    sr_key = 11 if master.dtype == torch.bfloat16 else None
    for step in steps:
        adam_step(master, grad, exp_avg, exp_avg_sq, HYPER, step, threads=threads, sr_key=sr_key,
                  checksum=checksum if step == 2 else None)


def _crcs_of(data: torch.Tensor, chunk: int) -> list[int]:
    lib = _native.lib()
    return [lib.offload_crc32c(data.data_ptr() + at, min(chunk, data.numel() - at), 0)
            for at in range(0, data.numel(), chunk)]


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("n", [1, 4097, 70_001, 300_000])
@pytest.mark.parametrize("name", FORMATS)
def test_the_pass_leaves_the_crcs_of_what_it_wrote(name, n, chunk, threads, isa):
    fmt = StateFormat.named(*FORMATS[name])
    _native.set_adam_isa(isa)
    try:
        buffer, weights, grad = _state(fmt, n, seed=n)
        plain, plain_weights = buffer.clone(), None if weights is None else weights.clone()
        _step(fmt, plain, plain_weights, grad, n, threads)
        checksum = ChunkCrcs.of(buffer, chunk)
        from_memory = _from_memory()
        _step(fmt, buffer, weights, grad, n, threads, checksum)
        from_memory = _from_memory() - from_memory
    finally:
        _native.set_adam_isa(None)
    assert torch.equal(buffer, plain)
    assert weights is None or torch.equal(weights, plain_weights)
    assert checksum.filled
    assert [c & 0xFFFFFFFF for c in checksum.crcs.tolist()] == _crcs_of(buffer, chunk)
    assert from_memory == 0  # the kernel writes every byte of these formats: all joined from its runs


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
@pytest.mark.parametrize("name", FORMATS)
def test_a_pass_that_keeps_the_old_state_still_checksums_what_it_wrote(name):
    """Note [the old state kept in the pass] with Note [checksums in the Adam
    pass]: one pass over several tiles on two threads fills the backup with the
    state before it, writes the plain step's state, and leaves its CRCs."""
    fmt, n, chunk = StateFormat.named(*FORMATS[name]), 70_001, CHUNKS[0]
    buffer, weights, grad = _state(fmt, n, seed=5)
    plain, plain_weights = buffer.clone(), None if weights is None else weights.clone()
    _step(fmt, plain, plain_weights, grad, n, 2)
    _step(fmt, buffer, weights, grad, n, 2, steps=(1,))
    before, backup = buffer.clone(), torch.full_like(buffer, 7)
    master, exp_avg, exp_avg_sq = fmt.views(buffer, n, weights)
    old_master, old_avg, old_avg_sq = fmt.views(backup, n, weights)
    checksum = ChunkCrcs.of(buffer, chunk)
    sr_key = 11 if master.dtype == torch.bfloat16 else None
    kept = (None if fmt.master_in_weights else old_master, old_avg, old_avg_sq)
    adam_step(master, grad, exp_avg, exp_avg_sq, HYPER, 2, threads=2, sr_key=sr_key, checksum=checksum, backup=kept)
    assert torch.equal(backup, before) and torch.equal(buffer, plain)
    assert [c & 0xFFFFFFFF for c in checksum.crcs.tolist()] == _crcs_of(buffer, chunk)


def test_bytes_the_kernel_does_not_write_are_checksummed_from_memory():
    """Data reaching past the state (here 5000 bytes the kernel never touches,
    spanning a chunk boundary) still gets the CRCs of all of it: the two chunks
    they touch are checksummed from memory, the others joined from the runs."""
    fmt = StateFormat.named("float32")
    n = 10_000
    data = torch.randint(0, 256, (fmt.nbytes(n) + 5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    master, exp_avg, exp_avg_sq = fmt.views(data[: fmt.nbytes(n)], n)
    exp_avg.zero_()
    exp_avg_sq.zero_()
    master.copy_(torch.randn(n))
    checksum = ChunkCrcs.of(data, 4096)
    from_memory = _from_memory()
    adam_step(master, torch.randn(n), exp_avg, exp_avg_sq, HYPER, 1, checksum=checksum)
    assert [c & 0xFFFFFFFF for c in checksum.crcs.tolist()] == _crcs_of(data, 4096)
    assert _from_memory() - from_memory == 4096 + (data.numel() - 30 * 4096)  # chunk 29 holds byte 120000


def _from_memory() -> int:
    return _native.lib().offload_checksum_from_memory_bytes()


@pytest.mark.parametrize("spoil", ["too few crcs", "int64 crcs", "float data", "no chunk"])
def test_a_checksum_the_kernel_could_write_past_is_refused(spoil):
    fmt = StateFormat.named("float32")
    buffer, _, grad = _state(fmt, 1000, seed=0)
    checksum = ChunkCrcs.of(buffer, 4096)
    if spoil == "too few crcs":
        checksum.crcs = checksum.crcs[:-1]
    elif spoil == "int64 crcs":
        checksum.crcs = checksum.crcs.long()
    elif spoil == "float data":
        checksum.data = checksum.data.view(torch.float32)
    else:
        checksum.chunk = 0
    with pytest.raises(ValueError, match="checksum must be a ChunkCrcs"):
        _step(fmt, buffer, None, grad, 1000, 1, checksum)
