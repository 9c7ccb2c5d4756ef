"""The format reference: bit-planes, E4M4, codebook, quantize/dequantize, SQNR."""
import math
import struct

import pytest
import torch

from vllm_kbit import format as kf

BITS = kf.SUPPORTED_BITS


@pytest.mark.parametrize("bits", BITS)
def test_pack_unpack_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    idx = torch.randint(0, 1 << bits, (37, 8 * 32), generator=g, dtype=torch.uint8)
    words = kf.pack_bitplanes(idx, bits)
    assert words.dtype == torch.int32 and words.shape == (37, 8 * bits)
    assert torch.equal(kf.unpack_bitplanes(words, bits), idx)


def test_bitplane_bit_order():
    # element i of a block sets bit i of word b when bit b of its index is set
    idx = torch.zeros(32, dtype=torch.uint8)
    idx[0], idx[5], idx[31] = 0b101, 0b010, 0b111
    w = kf.pack_bitplanes(idx, 3).to(torch.int64) & 0xFFFFFFFF
    assert w.tolist() == [(1 << 0) | (1 << 31), (1 << 5) | (1 << 31), (1 << 0) | (1 << 31)]


def test_e4m4_definition_range_and_subnormals():
    t = kf.e4m4_table().double()
    assert (t[1:] > t[:-1]).all(), "E4M4 must be strictly increasing in the code"
    for code in range(256):
        e, m = code >> 4, code & 15
        want = 2.0 ** (e - 11) * (1 + m / 16) if e else 2.0 ** -10 * (m / 16)
        assert t[code].item() == want
    assert t[0] == 0 and t[1] == kf.E4M4_MIN_SUBNORMAL == 2.0 ** -14 and t[255] == kf.E4M4_MAX == 31.0
    # the exact fp16 identity the kernels rely on: E4M4(c) == 16 * fp16_bits(c << 6)
    half = (torch.arange(256, dtype=torch.int16) << 6).view(torch.float16).double() * 16
    assert torch.equal(half, t)


def test_e4m4_encode_exact_monotone_nearest():
    t = kf.e4m4_table()
    assert torch.equal(kf.encode_e4m4(t), torch.arange(256, dtype=torch.uint8))
    x = torch.rand(100_000, generator=torch.Generator().manual_seed(1)) * 40 - 4
    x = x.clamp(0, kf.E4M4_MAX)
    codes = kf.encode_e4m4(x.sort().values)
    assert (codes[1:] >= codes[:-1]).all()
    dec = kf.decode_e4m4(kf.encode_e4m4(x))
    err = (dec - x).abs()
    neighbours = (t.unsqueeze(0) - x.unsqueeze(1)).abs().min(1).values
    assert torch.equal(err, neighbours), "encode must pick a nearest representable value"
    assert (err[x >= 2.0 ** -10] <= x[x >= 2.0 ** -10] / 32 + 1e-7).all(), "normal range: <= 1/32 relative"
    # a value halfway between two codes takes the larger one (the CUDA quantize kernel's rule too)
    mid = (t[:-1].double() + t[1:].double()) / 2
    exact = mid.float().double() == mid  # midpoints float32 holds exactly
    assert exact.sum() > 200
    assert torch.equal(kf.encode_e4m4(mid.float())[exact], torch.arange(1, 256, dtype=torch.uint8)[exact])


@pytest.mark.parametrize("bits", BITS)
def test_default_codebook_is_its_definition(bits):
    n = 1 << bits
    q = [math.sqrt(2) * _erfinv(2 * (i + 0.5) / n - 1) for i in range(n)]
    m = max(abs(v) for v in q)
    want = torch.tensor([v / m for v in q], dtype=torch.float32)
    cb = kf.normal_float_codebook(bits)
    assert cb.dtype == torch.float32 and cb.shape == (n,)
    torch.testing.assert_close(cb, want, rtol=0, atol=2e-7)
    assert (cb[1:] > cb[:-1]).all() and cb.abs().max() == 1.0


def _erfinv(y):
    # Newton on math.erf, independent of torch.special.ndtri used by the implementation
    x = 0.0
    for _ in range(100):
        x -= (math.erf(x) - y) / (2 / math.sqrt(math.pi) * math.exp(-x * x))
    return x


@pytest.mark.parametrize("bits,min_db", [(2, 7.3), (3, 14.9), (4, 21.1), (5, 26.2)])
def test_sqnr_normal_4m(bits, min_db):
    w = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(100 + bits))  # 4M samples
    cb = kf.normal_float_codebook(bits)
    q, a = kf.quantize(w, bits, cb)
    assert kf.sqnr_db(w, kf.dequantize(q, a, bits, cb)) >= min_db


def assert_nearest_entries(w, q, a, bits, cb):
    """Every stored index is a codebook entry nearest to w / decode(absmax) (ties: either)."""
    scale = kf.decode_e4m4(a).double().repeat_interleave(32, 1)
    idx = kf.unpack_bitplanes(q, bits).long()
    dist = ((w.double() / scale).unsqueeze(-1) - cb.double()).abs()
    assert (dist.gather(-1, idx.unsqueeze(-1)).squeeze(-1) <= dist.min(-1).values + 1e-6).all()


@pytest.mark.parametrize("bits", BITS)
def test_quantize_picks_nearest_codebook_entry(bits):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(bits)) * 0.05
    q, a = kf.quantize(w, bits)  # the default codebook, nf0
    assert q.shape == (64, 256 // 32 * bits) and a.shape == (64, 8) and a.dtype == torch.uint8
    cb = kf.nf0_codebook(bits).double()
    assert_nearest_entries(w, q, a, bits, cb)
    # the block scale is the E4M4 value nearest the block's true absmax
    amax = w.abs().reshape(64, 8, 32).amax(-1)
    nearest = (kf.e4m4_table() - amax[..., None]).abs().min(-1).values
    assert ((kf.decode_e4m4(a) - amax).abs() <= nearest).all()
    # the format's error budget: |w - w_hat| <= (max_gap/2 + 1/16) * absmax
    w_hat = kf.dequantize(q, a, bits, dtype=torch.float64)
    absmax = amax.double().repeat_interleave(32, 1)
    gap = (cb[1:] - cb[:-1]).max()
    assert ((w.double() - w_hat).abs() <= (gap / 2 + 1 / 16) * absmax + 1e-6).all()


def test_quantize_custom_codebook_and_errors():
    cb = torch.tensor([-1.0, -0.2, 0.1, 1.0])  # far from NF2: the indices must come from it
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    q, a = kf.quantize(w, 2, cb)
    assert_nearest_entries(w, q, a, 2, cb)
    idx = kf.unpack_bitplanes(q, 2).long()
    assert torch.equal(kf.dequantize(q, a, 2, cb), cb[idx] * kf.decode_e4m4(a).repeat_interleave(32, 1))
    with pytest.raises(kf.KbitFormatError, match="layer.w: in_features 48"):
        kf.quantize(torch.randn(4, 48), 4, name="layer.w")
    bad = torch.randn(4, 64)
    bad[2, 7] = float("nan")
    with pytest.raises(kf.KbitFormatError, match=r"layer.w: non-finite value at index \[2, 7\]"):
        kf.quantize(bad, 4, name="layer.w")
    with pytest.raises(kf.KbitFormatError, match="exceeds the E4M4 range"):
        kf.quantize(torch.full((2, 32), 40.0), 4)
    with pytest.raises(kf.KbitFormatError, match="exactly 8"):
        kf.check_codebook([0.0, 1.0], 3)
    with pytest.raises(kf.KbitFormatError, match="ascending"):
        kf.check_codebook([0.0, 1.0, 0.5, 0.7], 2)
    with pytest.raises(kf.KbitFormatError, match="bits must be"):
        kf.check_bits(6)


def test_underflow_blocks_are_counted_not_silent():
    w = torch.randn(2, 64)
    w[1, :32] = 1e-6  # below half the smallest E4M4 value: stored as a zero block
    assert kf.check_quantizable(w) == 1
    q, a = kf.quantize(w, 4)
    assert a[1, 0] == 0 and kf.dequantize(q, a, 4)[1, :32].abs().max() == 0


def test_from_bitsandbytes_flat_layout():
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
    q, a = kf.quantize(w, 3)
    # bitsandbytes' buffers: the little-endian bytes of the row-major plane words, flat absmax,
    # built here byte by byte rather than by viewing q
    words = [v & 0xFFFFFFFF for v in q.flatten().tolist()]
    flat_q = torch.tensor(list(struct.pack(f"<{len(words)}I", *words)), dtype=torch.uint8)
    flat_a = torch.tensor(a.flatten().tolist(), dtype=torch.uint8)
    q2, a2 = kf.from_bitsandbytes(flat_q, flat_a, 8, 128, 3)
    assert torch.equal(q2, q) and torch.equal(a2, a)
    with pytest.raises(kf.KbitFormatError, match="absmax must be E4M4 uint8"):
        kf.from_bitsandbytes(flat_q, flat_a.float(), 8, 128, 3)
    with pytest.raises(kf.KbitFormatError, match="in_features 120"):
        kf.from_bitsandbytes(flat_q, flat_a, 8, 120, 3)
