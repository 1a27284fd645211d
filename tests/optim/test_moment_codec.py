"""Adam's moments in 8 bits (Note [8-bit moments]): the codes keep each value
to a stated relative error within its block's 16 octaves, round the second
moment's root up rather than to 0, keep blocks independent, come back
unchanged from a decode and encode (so fp32 checkpoints resume bitwise), and
one step of the kernel stores exactly the fp32 step's moments encoded while
its weights equal the fp32 step's."""

import pytest
import torch

from offload import _native
from offload.optim import AdamHyper, adam_step
from offload.optim.adam_fallback import adam_step_torch
from offload.optim.moment_codec import BLOCK, BlockCodes, blocks, decode_moments, encode_moments


def _empty(n: int) -> BlockCodes:
    return BlockCodes(torch.empty(n, dtype=torch.uint8), torch.empty(blocks(n)))


def _round_trip(m: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, BlockCodes, BlockCodes]:
    codes = _empty(m.numel()), _empty(m.numel())
    encode_moments(m, v, *codes)
    return *decode_moments(*codes), *codes


def _wide(n: int, decades: float) -> torch.Tensor:
    return torch.randn(n) * 10 ** (-decades * torch.rand(n))


def test_relative_error_within_each_blocks_range():
    torch.manual_seed(0)
    n = 4 * BLOCK
    m, v = _wide(n, 4), _wide(n, 8).abs()
    m_back, v_back, *_ = _round_trip(m, v)
    def scale(x):
        return x.view(-1, BLOCK).abs().amax(1).repeat_interleave(BLOCK)

    in_range = m.abs() >= 1.25 * 2.0**-16 * scale(m)
    assert in_range.float().mean() > 0.9
    assert ((m_back - m).abs() / m.abs())[in_range].max() <= 1 / 16
    assert torch.equal(m_back.sign()[in_range], m.sign()[in_range])
    s, s_back = v.sqrt(), v_back.sqrt()
    in_range = s >= 1.125 * 2.0**-16 * scale(s)
    assert in_range.float().mean() > 0.9
    assert ((s_back - s).abs() / s)[in_range].max() <= 1 / 32 + 1e-6
    assert (s_back >= s)[~in_range].all()


def test_small_first_moments_flush_to_zero_small_roots_round_up():
    big, tiny = 1.0, 2.0**-20
    m = torch.tensor([big, tiny, -tiny, 0.0])
    v = torch.tensor([big, tiny**2, 0.0, 0.0])
    m_back, v_back, _, s_codes = _round_trip(m, v)
    assert m_back.tolist() == [big, 0.0, 0.0, 0.0]
    smallest = 1.125 * 2.0**-16  # of the root, relative to the block's largest
    assert v_back[1].item() == pytest.approx(smallest**2, rel=1e-6)  # up, never to 0: it divides the step
    assert s_codes.codes[2:].tolist() == [0, 0]


def test_blocks_are_scaled_independently():
    m = torch.full((2 * BLOCK,), 1e-3)
    m[0] = 1e3  # would flush all of block 0 below it, and nothing of block 1
    m_back, *_ = _round_trip(m, m.abs())
    assert m_back[1:BLOCK].count_nonzero() == 0
    assert torch.equal(m_back[BLOCK:], m[BLOCK:])


@pytest.mark.parametrize("n", [1, BLOCK - 1, BLOCK, 3 * BLOCK + 5])
def test_codes_come_back_unchanged(n):
    torch.manual_seed(n)
    *_, m_codes, v_codes = _round_trip(_wide(n, 10), _wide(n, 20).abs())
    m, v = decode_moments(m_codes, v_codes)
    again = _empty(n), _empty(n)
    encode_moments(m, v, *again)
    assert torch.equal(again[0].codes, m_codes.codes) and torch.equal(again[0].scales, m_codes.scales)
    assert torch.equal(again[1].codes, v_codes.codes) and torch.equal(again[1].scales, v_codes.scales)


def test_a_nan_reaches_its_block_only():
    m = torch.ones(2 * BLOCK)
    m[3] = float("nan")
    m_back, *_ = _round_trip(m, m.abs())
    assert m_back[:BLOCK].isnan().all() and not m_back[BLOCK:].isnan().any()


IMPLEMENTATIONS = [
    pytest.param(adam_step, marks=pytest.mark.skipif(not _native.status().available, reason="native library not built"),
                 id="native"),
    pytest.param(lambda *args: adam_step_torch(*args, 1.0, None), id="fallback"),
]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_one_step_stores_the_fp32_moments_encoded_and_updates_with_fp32(impl):
    n = 3 * BLOCK + 11
    torch.manual_seed(1)
    hyper = AdamHyper(lr=1e-2, weight_decay=0.1)
    grad, init = _wide(n, 6), torch.randn(n)
    wide = [init.clone(), torch.zeros(n), torch.zeros(n)]
    narrow = [init.clone(), BlockCodes(torch.zeros(n, dtype=torch.uint8), torch.zeros(blocks(n))),
              BlockCodes(torch.zeros(n, dtype=torch.uint8), torch.zeros(blocks(n)))]
    impl(*wide[:1], grad, *wide[1:], hyper, 1)
    impl(*narrow[:1], grad, *narrow[1:], hyper, 1)
    assert torch.equal(narrow[0], wide[0])
    expected = _empty(n), _empty(n)
    encode_moments(wide[1], wide[2], *expected)
    for got, want in zip(narrow[1:], expected):
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
    assert not torch.equal(decode_moments(*narrow[1:])[0], wide[1])  # the rounding is real
