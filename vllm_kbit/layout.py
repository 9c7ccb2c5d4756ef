"""Python mirror of the tiled kbit layout (csrc/core/layout.cuh), in vectorized torch.

The CUDA kernels read weights only in this layout; `repack_ref` builds it from the checkpoint
layout of format.py exactly as the repack kernel does (tests compare them bit for bit), and
`unpack_ref` goes back. Index math, with W[N, K] padded to N64 x K64 (zeros):

  unit (nu, ku) = 64 columns x 64 k, stored unit-major: unit = nu * KU + ku
  packed words per unit: [bits][32 lanes][4 words]; absmax bytes per unit: [8 g][4 w][4 q]
  lane l: g = l >> 2, t = l & 3; word w: block kb = w >> 1; byte q: n8 group j = 4 (w & 1) + q
  column c = 64 nu + 8 j + g
  bit e of the byte in plane b = bit b of the index at
      k = 64 ku + 32 kb + 16 (e >> 2) + 8 ((e >> 1) & 1) + 2 t + (e & 1)

K = 3, 4, 5 store nibble words in the plane slots instead (`planes_to_slots`): bit 4m + b of
word N_s is bit 4m + s of plane b (4x4 bit-block transpose, b < 4), so nibble 2q + (e >> 2) of
N_(e & 3) holds the low (up to four) index bits of element e of byte q, and the kernels need
(almost) no transpose of their own. K=4: N_0..N_3. K=5: N_0..N_3, then plane 4. K=3: slot b
holds N_b (three bits a nibble) and, in each nibble's bit 3, bit b of N_3's nibble. K=2: planes.

So the column index splits as c = 64 nu + 8 (4 jh + q) + g  (jh = w & 1) and the k index as
k = 64 ku + 32 kb + 16 s + 8 h + 2 t + p  (e = 4 s + 2 h + p): the layout is one permutation
of those digits, which is what the reshapes below do.
"""
from __future__ import annotations

import torch

from vllm_kbit import format as kf

UNIT_N = 64
UNIT_K = 64


def n_units(n: int) -> int:
    return (n + UNIT_N - 1) // UNIT_N


def k_units(k: int) -> int:
    return (k + UNIT_K - 1) // UNIT_K


def packed_numel(n: int, k: int, bits: int) -> int:
    """int32 words of the tiled layout of W[n, k]."""
    return n_units(n) * k_units(k) * bits * 128


def absmax_numel(n: int, k: int) -> int:
    """bytes of the tiled absmax of W[n, k]."""
    return n_units(n) * k_units(k) * 128


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


# digit order of a padded index tensor viewed as
#   [NU, jh(2), q(4), g(8), KU, kb(2), s(2), h(2), t(4), p(2)]
# -> [NU, KU, g, t, kb, jh, q, s, h, p]  (= unit, lane, word, byte, bit e)
_TO_TILED = (0, 4, 3, 8, 5, 1, 2, 6, 7, 9)
_FROM_TILED = tuple(_TO_TILED.index(i) for i in range(10))


def nibble_transpose(words: torch.Tensor) -> torch.Tensor:
    """[..., 4 slots, 32 lanes, 4 words] int64 (32-bit values): planes <-> nibble words
    (bit 4m + b of output slot s = bit 4m + s of input slot b; its own inverse)."""
    out = torch.zeros_like(words)
    for s in range(4):
        for b in range(4):
            src = words[..., b, :, :]
            moved = src << (b - s) if b >= s else src >> (s - b)
            out[..., s, :, :] |= moved & (0x11111111 << b)
    return out & 0xFFFFFFFF


_NIB = 0x11111111


def _transpose_low_planes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """K = 2, 4, 5, where planes <-> slots is its own inverse: planes kept (K=2), or planes
    0..3 transposed into nibble words and plane 4 kept (K = 4, 5)."""
    if bits == 2:
        return words
    return torch.cat([nibble_transpose(words[..., :4, :, :]), words[..., 4:, :, :]], dim=-3)


def planes_to_slots(words: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., bits, 32, 4] int64 plane words -> the words the tiled layout stores in the `bits`
    slots (core/layout.cuh, slot_form)."""
    if bits != 3:
        return _transpose_low_planes(words, bits)
    nib = nibble_transpose(torch.cat([words, torch.zeros_like(words[..., :1, :, :])], dim=-3))
    n3 = nib[..., 3, :, :]
    return torch.stack([nib[..., b, :, :] | (((n3 >> b) & _NIB) << 3) for b in range(3)], dim=-3)


def slots_to_planes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of planes_to_slots."""
    if bits != 3:
        return _transpose_low_planes(words, bits)
    n3 = sum(((words[..., b, :, :] >> (3 - b)) & (_NIB << b)) for b in range(3))
    nib = torch.stack([words[..., b, :, :] & 0x77777777 for b in range(3)] + [n3], dim=-3)
    return nibble_transpose(nib)[..., :3, :, :]


def repack_ref(qweight: torch.Tensor, absmax: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint layout (qweight int32 [N, K/32*bits], absmax uint8 [N, K/32]) -> tiled layout
    (packed int32 [NU*KU*bits*128], absmax_packed uint8 [NU*KU*128]), like kbit::repack."""
    kf.check_bits(bits)
    n, nb = absmax.shape
    if qweight.shape != (n, nb * bits):
        raise kf.KbitFormatError(f"qweight {tuple(qweight.shape)} does not match absmax {tuple(absmax.shape)}")
    k = nb * kf.BLOCK_SIZE
    nu, ku = n_units(n), k_units(k)
    idx = torch.zeros(nu * UNIT_N, ku * UNIT_K, dtype=torch.int64, device=qweight.device)
    idx[:n, :k] = kf.unpack_bitplanes(qweight, bits).to(torch.int64)
    digits = idx.view(nu, 2, 4, 8, ku, 2, 2, 2, 4, 2).permute(_TO_TILED)
    digits = digits.reshape(nu, ku, 32, 4, 4, 8)                       # unit, lane, w, q, e
    planes = (digits.unsqueeze(2) >> torch.arange(bits, device=idx.device).view(1, 1, bits, 1, 1, 1, 1)) & 1
    shifts = (8 * torch.arange(4, device=idx.device).view(4, 1) + torch.arange(8, device=idx.device)).view(4, 8)
    words = (planes << shifts).sum((-1, -2))                          # [nu, ku, bits, 32, 4]
    packed = _to_int32(planes_to_slots(words, bits)).reshape(-1)

    amax = torch.zeros(nu * UNIT_N, ku * 2, dtype=torch.uint8, device=absmax.device)
    amax[:n, :nb] = absmax
    # [NU, jh, q, g, KU, kb] -> [NU, KU, g, kb, jh, q]  (g, w = 2 kb + jh, q)
    absmax_packed = amax.view(nu, 2, 4, 8, ku, 2).permute(0, 4, 3, 5, 1, 2).reshape(-1).contiguous()
    return packed.contiguous(), absmax_packed


def unpack_ref(packed: torch.Tensor, absmax_packed: torch.Tensor, bits: int, n: int,
               k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled layout -> checkpoint layout (qweight, absmax); the inverse of repack_ref."""
    kf.check_bits(bits)
    nu, ku = n_units(n), k_units(k)
    if packed.numel() != packed_numel(n, k, bits) or absmax_packed.numel() != absmax_numel(n, k):
        raise kf.KbitFormatError("tiled layout size does not match n, k, bits")
    words = slots_to_planes(packed.reshape(nu, ku, bits, 32, 4).to(torch.int64) & 0xFFFFFFFF, bits)
    shifts = (8 * torch.arange(4, device=packed.device).view(4, 1) + torch.arange(8, device=packed.device)).view(4, 8)
    bits_ = (words.view(nu, ku, bits, 32, 4, 1, 1) >> shifts) & 1        # [nu, ku, bits, 32, 4, q, e]
    digits = (bits_ << torch.arange(bits, device=packed.device).view(1, 1, bits, 1, 1, 1, 1)).sum(2)
    digits = digits.view(nu, ku, 8, 4, 2, 2, 4, 2, 2, 2).permute(_FROM_TILED)
    idx = digits.reshape(nu * UNIT_N, ku * UNIT_K)[:n, :k]
    qweight = kf.pack_bitplanes(idx.to(torch.uint8), bits)
    amax = absmax_packed.view(nu, ku, 8, 2, 2, 4).permute(0, 4, 5, 2, 1, 3).reshape(nu * UNIT_N, ku * 2)
    return qweight, amax[:n, :k // kf.BLOCK_SIZE].contiguous()


def position(c: int, kk: int, bits_index: int = 0, k: int | None = None) -> dict:
    """Where the index bit `bits_index` of weight (column c, input kk) lives in the bit-plane
    form, by the header's formula (for hand checks; the layout stores planes_to_slots of them):
    word index into `packed` needs KU = k_units(k) and bits."""
    nu, cc = divmod(c, UNIT_N)
    j, g = divmod(cc, 8)
    jh, q = divmod(j, 4)
    ku, r = divmod(kk, UNIT_K)
    kb, r = divmod(r, 32)
    s, r = divmod(r, 16)
    h, r = divmod(r, 8)
    t, p = divmod(r, 2)
    return {"nu": nu, "ku": ku, "lane": 4 * g + t, "w": 2 * kb + jh, "q": q, "e": 4 * s + 2 * h + p,
            "g": g}
