"""vllm_kbit: k-bit (K = 2..5) codebook weight quantization for vLLM, with fused CUDA kernels.

The CUDA extension `vllm_kbit._C` is built only where torch is a CUDA build and nvcc is
found; elsewhere the package installs pure-Python and its ops run the PyTorch reference.
Restrict the architectures for quick builds with TORCH_CUDA_ARCH_LIST (e.g. "9.0a" on Hopper:
the wgmma kernel exists only in sm_90a code, which "9.0" does not produce).
"""
import glob
import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def cuda_extension():
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None or os.environ.get("KBIT_NO_CUDA") == "1":
        return [], {}
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;8.6;8.9;9.0a")
    archs = os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").split(";")
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/**/*.cu", recursive=True))
    if not sources:
        return [], {}
    # no -std flag: torch's BuildExtension adds the standard its headers need (C++17 or 20)
    nvcc = ["-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr",
            "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
            "--threads", "4"]
    if any(a.startswith("9.0a") for a in archs):
        nvcc.append("-DKBIT_HAS_SM90A")  # the wgmma kernel's sm_90a code is in this build
    ext = CUDAExtension(
        name="vllm_kbit._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc},
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = cuda_extension()

setup(
    name="vllm_kbit",
    version="0.1.0",
    description="k-bit codebook weight quantization for vLLM with fused CUDA kernels",
    packages=find_packages(include=["vllm_kbit", "vllm_kbit.*"]),
    python_requires=">=3.10",
    install_requires=["torch", "safetensors", "compressed-tensors", "tqdm"],
    extras_require={"test": ["pytest"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={
        "vllm.general_plugins": ["kbit = vllm_kbit:register"],
        "console_scripts": ["vllm-kbit-convert = vllm_kbit.convert:main"],
    },
)
