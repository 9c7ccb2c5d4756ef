"""Every kernel path reads the codebook it is given (per-layer codebooks, convert
--fit-codebook): random indices and E4M4 codes with a random, asymmetric, non-normal-float
codebook, against a float64 matmul of the weight dequantized with THAT codebook; the result
must also differ from what the normal-float codebook would give.

Paths forced through torch.ops.kbit.gemm_path: 1 = GEMV, 2 = mma.sync, 3 = dequantize +
cuBLAS, 4 = wgmma (sm_90 builds only)."""
import pytest
import torch

import gemm_cases
import kernel_check as kc
from vllm_kbit import format as kf
from vllm_kbit import ops

pytestmark = pytest.mark.gpu

PATHS = {ops.Path.GEMV: None, ops.Path.MMA: "has_mma", ops.Path.DEQUANT: None,
         ops.Path.WGMMA: "has_wgmma"}  # None: in every build of the extension
M_FOR_PATH = {ops.Path.GEMV: (1, 4), ops.Path.MMA: (33, 256), ops.Path.DEQUANT: (64, 300), ops.Path.WGMMA: (64, 256)}


def available(path):
    if PATHS[path] is None:
        return torch.cuda.is_available() and ops.HAS_CUDA_KERNELS
    return gemm_cases.have(PATHS[path])


def random_codebook(bits, gen):
    cb = torch.sort(torch.rand(1 << bits, generator=gen, device="cuda") * 1.7 - 0.8).values
    cb[0] = -1.0
    return cb


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("bits", kf.SUPPORTED_BITS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_path_reads_the_given_codebook(path, bits, dtype):
    if not available(path):
        pytest.skip(f"path {path} is not built on this GPU")
    n, k = 1000, 2080
    g = torch.Generator(device="cuda").manual_seed(17 * path + bits)
    idx = torch.randint(0, 1 << bits, (n, k), generator=g, device="cuda").to(torch.uint8)
    codes = torch.randint(0x70, 0xA0, (n, k // 32), generator=g, device="cuda").to(torch.uint8)
    packed, absmax = torch.ops.kbit.repack(kf.pack_bitplanes(idx, bits), codes, bits)
    cb = random_codebook(bits, g)
    scale = kf.decode_e4m4(codes).double().repeat_interleave(32, dim=1)
    w = cb.double()[idx.long()] * scale
    w_nf = kf.normal_float_codebook(bits, "cuda").double()[idx.long()] * scale
    for m in M_FOR_PATH[path]:
        x = torch.randn(m, k, device="cuda").to(dtype)
        y = gemm_cases.run(path, x, packed, absmax, cb, bits, n, k)
        assert torch.isfinite(y).all(), f"path {path} m={m}: non-finite output"
        kc.assert_close(y, kc.matmul(x, w), dtype, f"path {path} bits {bits} m={m} {dtype}")
        ref_nf = x.double() @ w_nf.t()
        assert ((y.double() - ref_nf).norm() / ref_nf.norm()).item() > 0.05, "the NF codebook's result"
