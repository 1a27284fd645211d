"""Note [adding a gradient part]: the native pass adds a part into a float32
gradient bit for bit as ``dst.add_(src)`` does, whatever the part's dtype,
the length (vector tails) or the thread count, special values included."""

import pytest
import torch

from offload import _native
from offload.optim import grad_add
from offload.optim.grad_add import add_into

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")


_SPECIALS = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -3e-41, 6e-8, -6e-8, 65504.0])


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 20, (n,), generator=g).float())
    x[: min(n, len(_SPECIALS))] = _SPECIALS[: min(n, len(_SPECIALS))]
    return x.to(dtype)  # narrowing makes subnormals and overflows of each 16-bit format


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 33, 100_003])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_native_add_is_torchs_add_bit_for_bit(dtype, n, threads):
    dst, part = _values(n, torch.float32, 1).roll(len(_SPECIALS) // 2), _values(n, dtype, 2)  # specials meet others
    expected = dst.clone().add_(part)
    add_into(dst, part, threads=threads)
    assert _same_bits(dst, expected)


def test_what_the_native_pass_does_not_take_goes_to_torch(monkeypatch):
    """A bf16 destination (a gradient kept in the compute dtype), a strided or
    fp32 part: PyTorch's add; the native library missing: PyTorch's add, said once."""
    calls = []
    monkeypatch.setattr(_native, "lib", lambda: calls.append(1))
    dst, part = torch.ones(8, dtype=torch.bfloat16), torch.full((8,), 2.0, dtype=torch.bfloat16)
    add_into(dst, part)
    assert torch.equal(dst, torch.full((8,), 3.0, dtype=torch.bfloat16))
    strided = torch.arange(16.0)[::2]
    dst = torch.zeros(8)
    add_into(dst, strided)
    add_into(dst, torch.ones(8))
    assert torch.equal(dst, strided + 1) and not calls
    monkeypatch.setattr(_native, "status", lambda: _native.NativeStatus(False, "not built"))
    monkeypatch.setattr(grad_add, "warn_fallback_once", lambda: calls.append("warned"))
    add_into(dst, torch.ones(8, dtype=torch.bfloat16))
    assert torch.equal(dst, strided + 2) and calls == ["warned"]
    with pytest.raises(ValueError, match="8 elements \\+= 9"):
        add_into(dst, torch.ones(9))
