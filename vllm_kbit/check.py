"""Check a vllm_kbit install: `python3 -m vllm_kbit.check [MODEL_DIR]` (or `vllm-kbit-check`).

Prints the package, torch and CUDA versions, whether the CUDA extension loaded (or why not),
the architectures it was built for, the GPU and the kernel paths it gets (each one, the MoE
expert kernel and, where the build and GPU have it, the FP8-activation kernel, run once against
a float64 reference, with the key of the kernel that ran), what FP8 activations run on here, and
whether vLLM loads the plugin and sees the `kbit` method. With MODEL_DIR (a kbit checkpoint),
also its bits and activations setting.
Exit status 1 where a GPU is present but the kbit kernels are not usable on it, or where vLLM
is missing or does not see `kbit`; 0 otherwise (a machine without a GPU runs the reference).
"""
from __future__ import annotations

import os
import sys

import torch

# kbit::gemm_path's paths (ops.Path) and an M each path serves
_PATHS = (("GEMV", "GEMV", 1, None), ("mma.sync", "MMA", 16, "has_mma"), ("wgmma", "WGMMA", 64, "has_wgmma"),
          ("dequantize + cuBLAS", "DEQUANT", 128, None))
_TOL = 2e-2  # relative error of a bf16 product (tests/test_kernels_gpu.py's bound is tighter)


def gpu_problem() -> str | None:
    """Why kbit models cannot be served on this machine's GPU, or None. For scripts that need
    one: it says what is missing before vLLM fails with a less direct error."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"{torch.cuda.get_device_name()} is sm_{major}{minor}; the kbit kernels need sm_80 or newer"
    from vllm_kbit import ops
    if not ops.HAS_CUDA_KERNELS and not ops.REFERENCE_REQUESTED:
        return (f"the kbit CUDA extension vllm_kbit._C is {ops.KERNELS_ERROR}; build it with "
                f"`{ops.build_command()}` (python3 -m vllm_kbit.check tells more)")
    return None


def build_info() -> dict | None:
    try:
        from vllm_kbit import _build_info
    except ImportError:
        return None
    return {k: getattr(_build_info, k, None) for k in ("EXTENSION", "REASON", "TORCH_CUDA_ARCH_LIST", "TORCH")}


def arch_covered(arch_list: str, major: int, minor: int) -> bool:
    """Whether a TORCH_CUDA_ARCH_LIST holds code that runs on compute capability major.minor:
    SASS of the same major and a minor not above it (sm_90a's only on 9.0), or PTX not newer."""
    for entry in arch_list.replace(" ", ";").split(";"):
        ptx = entry.endswith("+PTX")
        entry = entry.removesuffix("+PTX")
        specific = entry.endswith(("a", "f"))
        try:
            a_major, a_minor = (int(v) for v in entry.rstrip("af").split("."))
        except ValueError:
            continue
        if ptx and not specific and (a_major, a_minor) <= (major, minor):
            return True
        if a_major == major and (a_minor == minor if specific else a_minor <= minor):
            return True
    return False


def _checked_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """y's relative error against the float64 ref, or a RuntimeError above _TOL (NaN too)."""
    err = ((y.double() - ref).norm() / ref.norm()).item()
    if not err < _TOL:
        raise RuntimeError(f"relative error {err:.2e} against float64 (want < {_TOL})")
    return err


def _self_test(name: str, path: int, m: int) -> str:
    """Run one kernel path on a random bf16 problem; the kernel that ran (its key) and its
    relative error against float64."""
    from vllm_kbit import format as kf
    from vllm_kbit import ops

    n, k, bits = 256, 512, 4
    w = torch.randn(n, k, device="cuda") * 0.02
    cb = kf.default_codebook(bits, "cuda")
    q, a, _ = ops.quantize(w.to(torch.bfloat16), bits, cb)
    packed, absmax = ops.repack(q, a, bits)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    y = torch.ops.kbit.gemm_path(x, packed, absmax, cb, bits, n, k, None, int(path))
    torch.cuda.synchronize()
    kernel = ops.gemm_kernel(m, n, k, bits, torch.bfloat16, path)
    ref = x.double() @ kf.dequantize(q, a, bits, cb, dtype=torch.float64).t()
    err = _checked_error(y, ref)
    return f"{name} (M = {m}, {kernel}): ok, relative error {err:.1e}"


def _moe_self_test() -> str:
    """Run kbit::moe_gemm once (4 bf16 experts, 2 tokens routed to 2 each, one pair a block as
    experts_forward's sparse path lays them out); its relative error against float64."""
    from vllm_kbit import format as kf
    from vllm_kbit import ops

    experts, n, k, bits, m, top_k = 4, 128, 256, 4, 2, 2
    cb = kf.default_codebook(bits, "cuda")
    q, a = zip(*[ops.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16), bits, cb)[:2]
                 for _ in range(experts)])
    tiles = [ops.repack(q[e], a[e], bits) for e in range(experts)]
    packed = torch.stack([p.reshape(-1) for p, _ in tiles])
    absmax = torch.stack([t.reshape(-1) for _, t in tiles])
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    ids = [0, 2, 3, 2]  # pair p = token p // top_k, expert ids[p]
    on = dict(dtype=torch.int32, device="cuda")
    y = torch.ops.kbit.moe_gemm(x, packed, absmax, cb, bits, n, k, torch.arange(m * top_k, **on),
                                torch.tensor(ids, **on), torch.tensor([m * top_k], **on), 1, top_k)
    torch.cuda.synchronize()
    ref = torch.stack([x[p // top_k].double() @ kf.dequantize(q[e], a[e], bits, cb, dtype=torch.float64).t()
                       for p, e in enumerate(ids)])
    err = _checked_error(y, ref)
    kernel = ops.moe_kernel(bits, torch.bfloat16)
    return f"MoE experts (moe_gemm, {m} tokens x top-{top_k}, {kernel}): ok, relative error {err:.1e}"


def _moe_grouped_self_test() -> str:
    """Run kbit::moe_gemm_grouped once (4 bf16 experts, 40 tokens x top-2 in blocks of 64, the
    gated silu fused); its relative error against float64."""
    from vllm_kbit import format as kf
    from vllm_kbit import ops
    from vllm_kbit.moe_cpu import align_block_size_torch

    experts, n, k, bits, m, top_k, block_m = 4, 256, 256, 4, 40, 2, 64
    cb = kf.default_codebook(bits, "cuda")
    q, a = zip(*[ops.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16), bits, cb)[:2]
                 for _ in range(experts)])
    tiles = [ops.repack(q[e], a[e], bits) for e in range(experts)]
    packed = torch.stack([p.reshape(-1) for p, _ in tiles])
    absmax = torch.stack([t.reshape(-1) for _, t in tiles])
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    ids = torch.randint(0, experts, (m, top_k), device="cuda", dtype=torch.int32)
    aligned = align_block_size_torch(ids, block_m, experts)
    silu_and_mul = ops.MOE_ACTIVATIONS.index("silu_and_mul")
    y = torch.ops.kbit.moe_gemm_grouped(x, packed, absmax, cb, bits, n, k, *aligned, block_m, top_k, None,
                                        silu_and_mul)
    torch.cuda.synchronize()
    w = [kf.dequantize(q[e], a[e], bits, cb, dtype=torch.float64) for e in range(experts)]
    h = torch.stack([x[p // top_k].double() @ w[int(e)].t() for p, e in enumerate(ids.reshape(-1))])
    ref = ops.moe_activation_apply(silu_and_mul, h)
    err = _checked_error(y, ref)
    kernel = ops.moe_grouped_kernel(bits, torch.bfloat16, block_m, aligned[0].numel(), n, silu_and_mul)
    return f"MoE experts, large batches (moe_gemm_grouped, {kernel}): ok, relative error {err:.1e}"


def _fp8_self_test() -> str:
    """Run kbit::gemm_fp8 (FP8 activations) once on a random bf16 problem of a prefill's size
    (below it the plan runs 16-bit activations, which the lines above check); the kernel its plan
    names and its relative error against fp8.py's float64 function of the same operands."""
    from vllm_kbit import format as kf
    from vllm_kbit import fp8
    from vllm_kbit import ops

    m, n, k, bits = 2048, 256, 512, 4
    w = torch.randn(n, k, device="cuda") * 0.02
    cb = kf.default_codebook(bits, "cuda")
    q, a, _ = ops.quantize(w.to(torch.bfloat16), bits, cb)
    packed, absmax = ops.repack(q, a, bits)
    w_exp = fp8.weight_exponent(a)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    y = ops.gemm_fp8(x, packed, absmax, cb, bits, n, k, w_exp)
    torch.cuda.synchronize()
    xq, scale = fp8.quantize_activations(x)
    ref = fp8.linear_quantized(xq, scale, fp8.decode_weight(q, a, cb, bits, w_exp), w_exp)
    err = _checked_error(y, ref)
    kernel = ops.fp8_plan(m, n, k, bits, torch.bfloat16).kernel
    return f"FP8 activations (gemm_fp8, M = {m}, {kernel}): ok, relative error {err:.1e}"


def _vllm_sees_kbit() -> tuple[bool | None, str]:
    """(None: vLLM not installed | True | False, what was found)."""
    try:
        import vllm
    except ImportError as e:
        return None, f"not importable ({type(e).__name__}: {e})"
    try:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
        from vllm.plugins import load_general_plugins
        load_general_plugins()  # what every vLLM process does: the vllm.general_plugins entry points
    except Exception as e:  # a broken vLLM install is reported, not raised
        return False, f"{vllm.__version__}: loading its plugins failed ({type(e).__name__}: {e})"
    if "kbit" in QUANTIZATION_METHODS:
        return True, f"{vllm.__version__}, the `kbit` quantization method is registered"
    why = ("VLLM_PLUGINS does not list kbit" if os.environ.get("VLLM_PLUGINS") is not None
           else "no vllm.general_plugins entry point `kbit`: pip install vllm_kbit in this environment")
    return False, f"{vllm.__version__} does not see the `kbit` method ({why})"


def fp8_line() -> str:
    """What layers set to FP8 activations run in this process."""
    from vllm_kbit import fp8
    how = "quantization_config.activations or --hf-overrides kbit_activations = fp8"
    why_not = fp8.unavailable_reason()
    if why_not is not None:
        return f"FP8 activations ({how}): not here, 16-bit activations instead: {why_not}"
    if not fp8.kernel_available():
        return (f"FP8 activations ({how}): the PyTorch reference (vllm_kbit.fp8), the function the "
                f"kernels compute, above {fp8.GEMV_MAX_M} tokens")
    from vllm_kbit import ops
    m = next((m for m in (2 ** i for i in range(5, 17))
              if ops.fp8_plan(m, 4096, 4096, 4, torch.bfloat16).path != ops.Fp8Path.SIXTEEN_BIT), None)
    start = f"from {m} tokens" if m else "nowhere by default"
    return (f"FP8 activations ({how}): the CUDA kernels, where the plan finds FP8 faster ({start} on an "
            f"8B-sized bf16 layer here), 16-bit activations elsewhere")


def model_line(folder: str) -> tuple[str, str | None]:
    """(A kbit checkpoint's settings, a problem or None)."""
    import json
    from vllm_kbit import fp8
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            qc = json.load(f).get("quantization_config")
    except (OSError, ValueError) as e:
        return f"model {folder}: cannot read {path} ({e})", f"cannot read {path}"
    if not qc or qc.get("quant_method") != "kbit":
        return f"model {folder}: not a kbit checkpoint (no kbit quantization_config)", f"{folder} is not a kbit checkpoint"
    activations = qc.get("activations", "auto")
    try:
        fp8.check_activations(activations)
    except ValueError as e:
        return f"model {folder}: {e}", str(e)
    return f"model {folder}: kbit K={qc.get('bits')}, activations {activations}", None


def run(out=sys.stdout, model: str | None = None) -> int:
    import vllm_kbit
    from vllm_kbit import ops

    problems: list[str] = []

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    say(f"vllm_kbit {vllm_kbit.__version__} at {os.path.dirname(os.path.abspath(vllm_kbit.__file__))}")
    say(f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none (CPU build)'}")
    if ops.HAS_CUDA_KERNELS:
        import vllm_kbit._C as ext
        say(f"extension vllm_kbit._C: loaded ({ext.__file__})")
    else:
        say(f"extension vllm_kbit._C: {ops.KERNELS_ERROR}")
    info = build_info()
    if info is None:
        say("build: no vllm_kbit/_build_info.py (installed before setup.py wrote it, or from a copy)")
    elif info["EXTENSION"]:
        against = f", against torch {info['TORCH']}" if info["TORCH"] else ""
        say(f"build: TORCH_CUDA_ARCH_LIST={info['TORCH_CUDA_ARCH_LIST']}{against}")
    else:
        say(f"build: without the CUDA extension ({info['REASON']})")

    if not torch.cuda.is_available():
        say("GPU: none visible: kbit ops run the PyTorch reference (CPU)")
    else:
        major, minor = torch.cuda.get_device_capability()
        say(f"GPU: {torch.cuda.get_device_name()}, compute capability {major}.{minor}")
        archs = info and info["EXTENSION"] and info["TORCH_CUDA_ARCH_LIST"]
        if major < 8:
            problems.append(f"the kbit kernels need compute capability 8.0 or newer, this GPU is {major}.{minor}")
        elif ops.REFERENCE_REQUESTED:
            problems.append("VLLM_KBIT_REFERENCE=1 is set: kbit layers run the slow PyTorch reference on "
                            "this GPU (unset it to check the kernels)")
        elif not ops.HAS_CUDA_KERNELS:
            problems.append(f"the extension is {ops.KERNELS_ERROR}; build it: {ops.build_command()}")
        else:
            if archs and not arch_covered(archs, major, minor):
                problems.append(f"the extension was built for TORCH_CUDA_ARCH_LIST={archs}, which has no code "
                                f"for compute capability {major}.{minor}; rebuild: {ops.build_command()}")
            if (major, minor) != (9, 0):
                wgmma_note = ": needs a compute capability 9.0 GPU (Hopper)"
            elif archs and "9.0a" not in archs:
                wgmma_note = ": this build has no sm_90a code (TORCH_CUDA_ARCH_LIST without 9.0a)"
            else:
                wgmma_note = ": not in this build"
            say(f"kernel paths on this GPU (tuned table: {ops.heuristics_table()}):")
            for name, path_name, m, flag in _PATHS:
                path = ops.Path[path_name]
                if flag is not None and not getattr(torch.ops.kbit, flag)():
                    say(f"  {name}: not available" + (wgmma_note if flag == "has_wgmma" else ": needs sm_80"))
                    continue
                try:
                    say("  " + _self_test(name, path, m))
                except Exception as e:
                    say(f"  {name} (M = {m}): FAILED: {' '.join(str(e).split())[:300]}")
                    problems.append(f"the {name} kernel fails on this GPU")
            try:
                say("  " + _moe_self_test())
            except Exception as e:  # e.g. an extension built before the MoE kernels: no CUDA kernel
                say(f"  MoE experts (moe_gemm): FAILED: {' '.join(str(e).split())[:300]}")
                problems.append(f"the MoE expert kernel fails on this GPU (a stale build? {ops.build_command()})")
            if ops.has_moe_grouped():  # Hopper with sm_90a code, as the wgmma path
                try:
                    say("  " + _moe_grouped_self_test())
                except Exception as e:
                    say(f"  MoE experts, large batches (moe_gemm_grouped): FAILED: {' '.join(str(e).split())[:300]}")
                    problems.append("the grouped MoE kernel fails on this GPU")
            if ops.has_fp8():  # an optional path: listed where this build and GPU have it
                try:
                    say("  " + _fp8_self_test())
                except Exception as e:
                    say(f"  FP8 activations (gemm_fp8): FAILED: {' '.join(str(e).split())[:300]}")
                    problems.append("the FP8-activation kernel fails on this GPU")

    say(fp8_line())
    if model is not None:
        line, problem = model_line(model)
        say(line)
        if problem is not None:
            problems.append(problem)

    seen, what = _vllm_sees_kbit()
    say(f"vLLM: {what}")
    if seen is False:
        problems.append(f"vLLM {what}")
    elif seen is None:
        problems.append("vLLM is not installed: kbit checkpoints can be converted here but not served "
                        "(pip install vllm==0.24.0)")

    for p in problems:
        say(f"PROBLEM: {p}")
    if not problems:
        say("OK: " + ("kbit layers use the CUDA kernels" if torch.cuda.is_available()
                      else "no GPU; kbit ops run the PyTorch reference"))
    return 1 if problems else 0


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python3 -m vllm_kbit.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", metavar="MODEL_DIR", help="a kbit checkpoint folder: show its settings")
    args = parser.parse_args(argv)
    return run(model=args.model)


if __name__ == "__main__":
    sys.exit(main())
