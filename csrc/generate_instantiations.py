#!/usr/bin/env python3
"""Writes the kernel instantiations and their key -> kernel selectors (as vLLM's Marlin generator
writes its kernel_selector.h): for each family (GEMV, mma.sync, wgmma, MoE GEMV, grouped MoE GEMM,
FP8-activation GEMM, dequantize, quantize) and bit width, csrc/<dir>/instantiations/<family>_k<BITS>.cu defines
one selector entry per compiled kernel (kernel_entry<...>(): its launch and what the planner
needs to know of it), and csrc/<dir>/<family>_kernels.h declares every entry and maps a key
(core/kernel_keys.h) to its entry. The lists below are the kernels the planners can name; a key no entry matches gets
nullptr (the launcher's cudaErrorInvalidValue), so a planner and this list cannot disagree
quietly.

Run it after changing a list: python3 csrc/generate_instantiations.py
(--check: exit 1 if a file on disk differs from what it would write)."""
import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
BITS = (2, 3, 4, 5)
DTYPES = (("f16", "__half", "DType::kHalf"), ("bf16", "__nv_bfloat16", "DType::kBFloat16"))
DTYPES_F32 = DTYPES + (("f32", "float", "DType::kFloat32"),)  # quantize's input
# dequantize's output: e4m3 is the FP8 path's decoded weight (kbit::decode_fp8)
DTYPES_DEQUANT = DTYPES_F32 + (("e4m3", "__nv_fp8_e4m3", "DType::kE4m3"),)
LUT_BITS = (3, 4)  # the bit widths with a pair table in shared memory (core/decode.cuh, PairTable)


def gemv_keys(bits):
    """(mt, warps, wide, x_smem, slabs) of every GEMV kernel of a bit width (gemv_kernel.cuh)."""
    def wide_lut(mt, warps):  # gemv_kernel.cuh, wide_lut: one CTA per SM (min_blocks == 1)
        min_blocks = 4 if warps == 4 else 1 if mt > 1 else 2 if warps == 8 else 1
        return bits in LUT_BITS and min_blocks == 1 and not (bits == 4 and mt == 2 and warps == 16)

    keys = []
    for mt, warps, x_smem in ((1, 4, False), (1, 8, False), (1, 16, False), (2, 4, True), (2, 16, True),
                              (2, 8, False)):
        keys.append((mt, warps, False, x_smem, 0))
        if warps != 4 and wide_lut(mt, warps):
            keys.append((mt, warps, True, x_smem, 0))
    for mt in (1, 2):  # x resident: 16-warp CTAs of 2, 4 or 16 slabs, 15-warp CTAs of 15
        for slabs in (2, 4, 15, 16):
            keys.append((mt, 15 if slabs == 15 else 16, False, True, slabs))
            if bits in LUT_BITS and slabs != 2:
                keys.append((mt, 15 if slabs == 15 else 16, True, True, slabs))
    return keys


def wgmma_keys(bits):
    """(tile_m, columns, row_split, built_per_sm, split_tall) of every wgmma kernel (wgmma_plan.h
    names them: 512-column CTAs only forced, the rest by the plan)."""
    return [(256, 128, 2, 1, False), (256, 128, 2, 1, True),
            (16, 512, 1, 1, False), (32, 512, 1, 1, False), (64, 512, 1, 1, False),
            (16, 256, 1, 2, False), (32, 256, 2, 2, False), (32, 256, 1, 2, False),
            (64, 256, 2, 1, False), (64, 256, 2, 2, False), (128, 256, 2, 1, False)]


def b(v):
    return "true" if v else "false"


# family: header the instantiations include, namespace, entry type, key type, keys(bits) ->
# [(name suffix, template arguments given the C++ type, key condition)]
def gemv_family(bits):
    for mt, warps, wide, x_smem, slabs in gemv_keys(bits):
        name = f"mt{mt}_w{warps}_{'wide' if wide else 'packed'}_{'xsmem' if x_smem else 'xreg'}_g{slabs}"
        cond = f"k.mt == {mt} && k.warps == {warps} && k.wide == {b(wide)} && k.x_smem == {b(x_smem)} && k.slabs == {slabs}"
        yield name, lambda t, a=(mt, warps, wide, x_smem, slabs): f"{bits}, {a[0]}, {t}, {a[1]}, {b(a[2])}, {b(a[3])}, {a[4]}", cond


def mma_family(bits):
    for cfg in (0, 1, 2):
        yield f"cfg{cfg}", lambda t, c=cfg: f"{t}, {bits}, {c}", f"k.cfg == {cfg}"


def wgmma_family(bits):
    for mt, cn, r, cps, tall in wgmma_keys(bits):
        name = f"mt{mt}_cn{cn}_r{r}_cps{cps}" + ("_split_tall" if tall else "")
        cond = (f"k.tile_m == {mt} && k.columns == {cn} && k.row_split == {r} && k.built_per_sm == {cps} && "
                f"k.split_tall == {b(tall)}")
        yield name, lambda t, a=(mt, cn, r, cps, tall): f"{bits}, {a[0]}, {a[1]}, {a[2]}, {a[3]}, {t}, {b(a[4])}", cond


def moe_family(bits):
    yield "gemv", lambda t: f"{bits}, {t}", "true"


# (tokens per CTA = block_m of the sorted ids, CTAs per SM built for) (moe/grouped_kernel.cuh).
# No two-per-SM build at K=2: ptxas serializes its wgmma pipeline (C7515).
MOE_GROUPED_TILES = ((64, 1), (64, 2), (128, 1), (256, 1))


def moe_grouped_family(bits):
    for mt, cps in MOE_GROUPED_TILES:
        if bits == 2 and cps == 2:
            continue
        yield (f"mt{mt}_cps{cps}", lambda t, a=(mt, cps): f"{bits}, {a[0]}, {a[1]}, {t}",
               f"k.tile_m == {mt} && k.built_per_sm == {cps}")


def dequant_family(bits):
    for stacked in (False, True):
        yield ("stacked" if stacked else "rows"), lambda t, st=stacked: f"{bits}, {t}, {b(st)}", f"k.stacked == {b(stacked)}"


FP8_TILES = ((64, 128), (128, 128), (256, 128), (128, 256))  # (tokens, columns) per CTA, fp8_kernel.cuh


def fp8_family(bits):
    for mt, cn in FP8_TILES:
        yield f"mt{mt}_cn{cn}", lambda t, a=(mt, cn): f"{bits}, {a[0]}, {a[1]}, {t}", f"k.tile_m == {mt} && k.tile_n == {cn}"


def quant_family(bits):
    yield "quantize", lambda t: f"{bits}, {t}", "true"


PARTS = {
    # part: (kernel header, config header, namespace, entry, key, family, what, directory, dtypes)
    "gemv": ("gemv/gemv_kernel.cuh", "gemv/gemv_config.h", "gemv", "GemvKernel", "GemvKey", gemv_family,
             "GEMV kernels (1 <= M <= 16)", "gemv", DTYPES),
    "mma": ("mma/mma_kernel.cuh", "mma/mma_config.h", "mma", "MmaKernel", "MmaKey", mma_family,
            "mma.sync kernels", "mma", DTYPES),
    "wgmma": ("wgmma/launch.cuh", "wgmma/wgmma_config.h", "wg", "WgmmaKernel", "WgmmaKey", wgmma_family,
              "wgmma kernels (sm_90a)", "wgmma", DTYPES),
    "moe": ("moe/moe_gemv_kernel.cuh", "moe/moe_config.h", "moe", "MoeKernel", "MoeKey", moe_family,
            "MoE expert GEMV kernels", "moe", DTYPES),
    "moe_grouped": ("moe/grouped_kernel.cuh", "moe/grouped_config.h", "moe", "MoeGroupedKernel", "MoeGroupedKey",
                    moe_grouped_family, "grouped wgmma MoE kernels (sm_90a)", "moe", DTYPES),
    "fp8": ("wgmma_fp8/fp8_kernel.cuh", "wgmma_fp8/fp8_config.h", "fp8", "Fp8Kernel", "Fp8Key", fp8_family,
            "FP8-activation GEMM kernels (sm_90a)", "wgmma_fp8", DTYPES),
    "dequant": ("repack/dequant_kernel.cuh", "repack/repack_config.h", "repack", "DequantKernel", "DequantKey",
                dequant_family, "dequantize kernels (rows and stacked experts)", "repack", DTYPES_DEQUANT),
    "quant": ("repack/quant_kernel.cuh", "repack/repack_config.h", "repack", "QuantKernel", "QuantKey",
              quant_family, "quantize kernels", "repack", DTYPES_F32),
}


def entry_name(part, bits, dt, suffix):
    return f"{part}_k{bits}_{dt}_{suffix}"


def selector(part):
    kernel_header, config, ns, entry, key, family, what, folder, dtypes = PARTS[part]
    decls, cases = [], []
    for bits in BITS:
        lines = []
        for dt, _, dtype in dtypes:
            for suffix, _, cond in family(bits):
                name = entry_name(part, bits, dt, suffix)
                decls.append(f"extern const {entry} {name};")
                full = f"k.dtype == {dtype}" + ("" if cond == "true" else f" && {cond}")
                lines.append(f"      if ({full}) return &{name};")
        cases.append(f"    case {bits}:\n" + "\n".join(lines) + "\n      return nullptr;")
    return f"""\
// Generated by csrc/generate_instantiations.py: the {what}, one entry per compiled kernel
// (defined in {folder}/instantiations/{part}_k<BITS>.cu), and the key -> kernel selector.
#pragma once
#include "core/kernel_keys.h"
#include "{config}"

namespace kbit {{
namespace {ns} {{

{chr(10).join(decls)}

// The compiled kernel `k` names; nullptr where none is built.
inline const {entry}* select_kernel(const {key}& k) {{
  switch (k.bits) {{
{chr(10).join(cases)}
  }}
  return nullptr;
}}

}}  // namespace {ns}
}}  // namespace kbit
"""


def instantiation(part, bits):
    kernel_header, config, ns, entry, key, family, what, folder, dtypes = PARTS[part]
    defs = []
    for dt, ctype, _ in dtypes:
        for suffix, args, _ in family(bits):
            defs.append(f"const {entry} {entry_name(part, bits, dt, suffix)} = kernel_entry<{args(ctype)}>();")
    return f"""\
// Generated by csrc/generate_instantiations.py: the {what} for K = {bits} bits.
#include "{kernel_header}"
#include "{folder}/{part}_kernels.h"

namespace kbit {{
namespace {ns} {{

{chr(10).join(defs)}

}}  // namespace {ns}
}}  // namespace kbit
"""


def files():
    for part, spec in PARTS.items():
        folder = spec[7]
        yield os.path.join(ROOT, folder, f"{part}_kernels.h"), selector(part)
        for bits in BITS:
            yield os.path.join(ROOT, folder, "instantiations", f"{part}_k{bits}.cu"), instantiation(part, bits)


def main():
    check = "--check" in sys.argv[1:]
    stale = []
    for path, text in files():
        old = open(path).read() if os.path.exists(path) else None
        if old == text:
            continue
        if check:
            stale.append(path)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
    if stale:
        print("stale (run python3 csrc/generate_instantiations.py):", *stale, sep="\n  ")
        sys.exit(1)


if __name__ == "__main__":
    main()
