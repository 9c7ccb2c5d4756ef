"""CPU tests of the Python mirror of the tiled layout (vllm_kbit/layout.py)."""
import pytest
import torch

from vllm_kbit import format as kf
from vllm_kbit import layout as kl


def _random_checkpoint(n, k, bits, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.int64).to(torch.uint8)
    qweight = kf.pack_bitplanes(idx, bits)
    absmax = torch.randint(1, 256, (n, k // 32), generator=g, dtype=torch.int64).to(torch.uint8)
    return idx, qweight, absmax


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("n,k", [(64, 64), (200, 96), (130, 4128 // 8 * 1 + 32), (8, 32)])
def test_round_trip(bits, n, k):
    k = k // 32 * 32
    _, qweight, absmax = _random_checkpoint(n, k, bits, seed=n + k + bits)
    packed, amax_p = kl.repack_ref(qweight, absmax, bits)
    assert packed.dtype == torch.int32 and amax_p.dtype == torch.uint8
    assert packed.numel() == kl.packed_numel(n, k, bits)
    assert amax_p.numel() == kl.absmax_numel(n, k)
    q2, a2 = kl.unpack_ref(packed, amax_p, bits, n, k)
    assert torch.equal(q2, qweight)
    assert torch.equal(a2, absmax)


@pytest.mark.parametrize("bits", [2, 5])
def test_padding_is_zero(bits):
    n, k = 70, 96  # N64 = 128, K64 = 128: padded columns 70..127, k 96..127
    _, qweight, absmax = _random_checkpoint(n, k, bits, seed=1)
    # all-ones indices and codes so that any non-padding bit is set
    qweight = torch.full_like(qweight, -1)
    absmax = torch.full_like(absmax, 255)
    packed, amax_p = kl.repack_ref(qweight, absmax, bits)
    nu, ku = kl.n_units(n), kl.k_units(k)
    words = kl.slots_to_planes(packed.view(nu, ku, bits, 32, 4).to(torch.int64) & 0xFFFFFFFF, bits)
    amax = amax_p.view(nu, ku, 8, 4, 4)
    for c in range(nu * 64):
        for kk in range(0, ku * 64, 1):
            p = kl.position(c, kk)
            for b in range(bits):
                bit = (words[p["nu"], p["ku"], b, p["lane"], p["w"]] >> (8 * p["q"] + p["e"])) & 1
                assert int(bit) == (1 if (c < n and kk < k) else 0), (c, kk, b)
        for kb_global in range(ku * 2):
            p = kl.position(c, kb_global * 32)
            code = int(amax[p["nu"], p["ku"], p["g"], p["w"], p["q"]])
            assert code == (255 if (c < n and kb_global * 32 < k) else 0), (c, kb_global)


def test_hand_checked_positions():
    """A few weights placed by hand from the header's formula."""
    bits, n, k = 3, 128, 128
    idx = torch.zeros(n, k, dtype=torch.uint8)
    # (column, k, index): chosen to hit different units, lanes, words, bytes and bits
    marks = [(0, 0, 1), (9, 1, 2), (8 * 5 + 3, 2 * 3 + 8 + 16 + 32, 4), (64 + 63, 64 + 63, 7)]
    for c, kk, v in marks:
        idx[c, kk] = v
    qweight = kf.pack_bitplanes(idx, bits)
    absmax = torch.zeros(n, k // 32, dtype=torch.uint8)
    absmax[9, 0] = 0x5A
    absmax[64 + 63, 3] = 0xC3
    packed, amax_p = kl.repack_ref(qweight, absmax, bits)
    words = kl.slots_to_planes(packed.view(2, 2, bits, 32, 4).to(torch.int64) & 0xFFFFFFFF, bits)
    # (0, 0): unit (0,0), g=0 t=0 -> lane 0; j=0 -> w=0, q=0; e=0. Index 1 -> plane 0 only.
    assert words[0, 0, 0, 0, 0] == 1 and words[0, 0, 1, 0, 0] == 0
    # (9, 1): j=1, g=1 -> lane 4, w=0, q=1; k=1 -> t=0, e=1. Index 2 -> plane 1, bit 8+1.
    assert words[0, 0, 1, 4, 0] == 1 << 9
    # (43, 62): j=5, g=3; k=62 = 32 + 16 + 8 + 6 -> kb=1, s=1, h=1, t=3, p=0 -> lane 15,
    # w = 2*1 + 1 = 3, q = 1, e = 4 + 2 = 6. Index 4 -> plane 2.
    assert words[0, 0, 2, 15, 3] == 1 << (8 + 6)
    # (127, 127): unit (1, 1); j=7, g=7; k=63 = 32+16+8+6+1 -> kb=1, s=1, h=1, t=3, p=1
    # -> lane 31, w=3, q=3, e=7. Index 7 -> planes 0, 1, 2.
    for b in range(3):
        assert words[1, 1, b, 31, 3] == 1 << 31
    # everything else is zero
    assert int((words != 0).sum()) == 1 + 1 + 1 + 3
    amax = amax_p.view(2, 2, 8, 4, 4)
    assert amax[0, 0, 1, 0, 1] == 0x5A            # column 9: g=1, j=1 -> w=0, q=1; block 0
    assert amax[1, 1, 7, 3, 3] == 0xC3            # column 127, block 3 -> ku=1, kb=1 -> w=3
    assert int((amax != 0).sum()) == 2


def test_k4_stores_nibble_words():
    """K=4: slot s of a lane's word position holds N_s; nibble 2q + (e >> 2) of N_(e & 3) is the
    whole index of element e of byte q (layout.py / csrc/core/layout.cuh)."""
    n, k = 64, 64
    idx = torch.zeros(n, k, dtype=torch.uint8)
    # (9, 1): lane 4, w = 0, q = 1, e = 1 -> slot 1, nibble 2; (43, 62): lane 15, w = 3, q = 1,
    # e = 6 -> slot 2, nibble 3
    idx[9, 1], idx[43, 62] = 0xB, 0x6
    packed, _ = kl.repack_ref(kf.pack_bitplanes(idx, 4), torch.ones(n, k // 32, dtype=torch.uint8), 4)
    words = packed.view(4, 32, 4).to(torch.int64) & 0xFFFFFFFF
    assert words[1, 4, 0] == 0xB << 8
    assert words[2, 15, 3] == 0x6 << 12
    assert int((words != 0).sum()) == 2
    # the transpose is its own inverse, and random words survive it
    w = torch.randint(0, 2 ** 32, (2, 4, 32, 4), dtype=torch.int64)
    assert torch.equal(kl.nibble_transpose(kl.nibble_transpose(w)), w)


def test_k3_k5_slot_forms():
    """K=5: slots 0..3 hold N_0..N_3 of planes 0..3, slot 4 plane 4. K=3: slot b holds N_b in
    each nibble's bits 0..2 and bit b of N_3's nibble in bit 3 (csrc/core/layout.cuh, slot_form)."""
    n, k = 64, 64
    # (9, 1): lane 4, w = 0, q = 1, e = 1 -> nibble 2 of N_1; (43, 62): lane 15, w = 3, q = 1,
    # e = 6 -> nibble 3 of N_2; (9, 9): lane 4, w = 0, q = 1, e = 3 (k = 8 + 1) -> nibble 2 of N_3
    ones = torch.ones(n, k // 32, dtype=torch.uint8)
    idx = torch.zeros(n, k, dtype=torch.uint8)
    idx[9, 1], idx[43, 62], idx[9, 9] = 0x1B, 0x16, 0x11
    packed, _ = kl.repack_ref(kf.pack_bitplanes(idx, 5), ones, 5)
    words = packed.view(5, 32, 4).to(torch.int64) & 0xFFFFFFFF
    assert words[1, 4, 0] == 0xB << 8 and words[2, 15, 3] == 0x6 << 12 and words[3, 4, 0] == 0x1 << 8
    # plane 4: bit 8q + e of the word (q = 1, e = 1 / 6 / 3)
    assert words[4, 4, 0] == (1 << 9) | (1 << 11) and words[4, 15, 3] == 1 << 14
    assert int((words != 0).sum()) == 5
    idx = torch.zeros(n, k, dtype=torch.uint8)
    idx[9, 1], idx[43, 62], idx[9, 9] = 0x5, 0x6, 0x7
    packed, _ = kl.repack_ref(kf.pack_bitplanes(idx, 3), ones, 3)
    words = packed.view(3, 32, 4).to(torch.int64) & 0xFFFFFFFF
    # N_3's nibble 2 (lane 4, w 0) is 7: bit 3 of nibble 2 in all three slots; slot 1 also
    # holds N_1's nibble 2 (5)
    assert words[0, 4, 0] == 0x8 << 8 and words[1, 4, 0] == 0xD << 8 and words[2, 4, 0] == 0x8 << 8
    assert words[2, 15, 3] == 0x6 << 12
    assert int((words != 0).sum()) == 4
    for bits in (3, 5):
        w = torch.randint(0, 2 ** 32, (2, bits, 32, 4), dtype=torch.int64)  # any planes
        assert torch.equal(kl.slots_to_planes(kl.planes_to_slots(w, bits), bits), w)
