"""vllm_kbit: k-bit (K = 2..5) codebook weight quantization for vLLM, with fused CUDA kernels.

Install from this folder with the torch of the environment (not one pip fetches into an
isolated build environment): `pip install --no-build-isolation .` (`-e .` for an editable one).
The CUDA extension `vllm_kbit._C` is built where torch is a CUDA build and a CUDA toolkit (nvcc
and its headers) is found; with a CPU torch, or VLLM_KBIT_NO_CUDA=1, the package installs
pure-Python and its ops run the PyTorch reference. A CUDA torch without a usable toolkit fails
at once (extension_plan says why and what to do).
Restrict the architectures for quick builds with TORCH_CUDA_ARCH_LIST (e.g. "9.0a" on Hopper:
the wgmma kernel exists only in sm_90a code, which "9.0" does not produce).
"""
import glob
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_INFO = os.path.join(ROOT, "vllm_kbit", "_build_info.py")
DEFAULT_ARCH_LIST = "8.0;8.6;8.9;9.0a"
NO_CUDA_VARS = ("VLLM_KBIT_NO_CUDA", "KBIT_NO_CUDA")  # KBIT_NO_CUDA: the older name, still honoured


class BuildConfigError(SystemExit):
    """The build cannot go on; its message says why and what to do (pip prints it as is)."""


def isolated_build(env) -> bool:
    """Whether pip runs this build in an isolated environment: pip puts its build environment's
    site folder (pip-build-env-*) on PYTHONPATH for the build backend."""
    return "pip-build-env-" in env.get("PYTHONPATH", "")


def extension_plan(torch_version, torch_cuda, cuda_home, env, nvcc_on_path=None) -> tuple[bool, str]:
    """Whether to build the CUDA extension, and why; raises BuildConfigError where building
    without it would silently give a reference-only install on a CUDA machine, or building it
    would fail late. torch_version: None when torch is not importable in the build environment;
    torch_cuda: torch.version.cuda; cuda_home: torch's CUDA_HOME; env: os.environ;
    nvcc_on_path: shutil.which("nvcc")."""
    no_cuda = next((v for v in NO_CUDA_VARS if env.get(v) == "1"), None)
    if no_cuda:
        return False, f"{no_cuda}=1: reference-only install (no CUDA extension)"
    fixes = ("Either install with the environment's torch, `pip install --no-build-isolation .` "
             "(-e . for an editable install), or set VLLM_KBIT_NO_CUDA=1 for a reference-only "
             "install (the slow PyTorch path; kbit layers on a GPU then need VLLM_KBIT_REFERENCE=1).")
    if torch_version is None:
        if nvcc_on_path or cuda_home:
            toolkit = nvcc_on_path or cuda_home
            if isolated_build(env):
                raise BuildConfigError(
                    "vllm_kbit: torch is not importable in the build environment (pip's build isolation), "
                    f"but a CUDA toolkit is here ({toolkit}), so the CUDA extension would "
                    f"be silently left out. {fixes}")
            raise BuildConfigError(
                f"vllm_kbit: torch is not installed in this environment, but a CUDA toolkit is here ({toolkit}): "
                "the CUDA extension is compiled against the torch it will run with. Install torch first "
                "(`pip install vllm==0.24.0` brings vLLM's torch), then run this install again; or set "
                "VLLM_KBIT_NO_CUDA=1 for a reference-only install.")
        return False, "torch is not importable in the build environment and no CUDA toolkit is found"
    if torch_cuda is None:
        return False, f"torch {torch_version} is a CPU build"
    if cuda_home is None:
        raise BuildConfigError(
            f"vllm_kbit: torch {torch_version} is a CUDA {torch_cuda} build but no CUDA toolkit is found "
            "(nvcc on PATH, CUDA_HOME or /usr/local/cuda), which the CUDA extension needs. Install the "
            f"CUDA toolkit {torch_cuda.split('.')[0]}.x (nvcc and headers) and set CUDA_HOME, or set "
            "VLLM_KBIT_NO_CUDA=1 for a reference-only install.")
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    if not os.path.isfile(nvcc):
        raise BuildConfigError(
            f"vllm_kbit: torch {torch_version} is a CUDA {torch_cuda} build and CUDA_HOME is {cuda_home}, but "
            f"{nvcc} does not exist. Install the CUDA toolkit {torch_cuda.split('.')[0]}.x and point CUDA_HOME "
            "at it, or set VLLM_KBIT_NO_CUDA=1 for a reference-only install.")
    header_dirs = [os.path.join(cuda_home, "include")] + ([env["CUDA_INC_PATH"]] if env.get("CUDA_INC_PATH") else [])
    if not any(os.path.isfile(os.path.join(d, "cuda_runtime_api.h")) for d in header_dirs):
        raise BuildConfigError(
            f"vllm_kbit: torch {torch_version} is a CUDA {torch_cuda} build and CUDA_HOME is {cuda_home}, but "
            f"{os.path.join(header_dirs[0], 'cuda_runtime_api.h')} does not exist: the CUDA runtime headers "
            f"are missing. Install the CUDA toolkit headers (e.g. the cuda-cudart-dev-{torch_cuda.split('.')[0]}-x "
            "package, or a full toolkit, and point CUDA_HOME at it), or set VLLM_KBIT_NO_CUDA=1 for a "
            "reference-only install.")
    return True, f"torch {torch_version} (CUDA {torch_cuda}), CUDA toolkit at {cuda_home}"


def write_build_info(build: bool, why: str, arch_list: str | None, torch_version: str | None = None) -> None:
    """vllm_kbit/_build_info.py (not in git): what this build is, for `python3 -m vllm_kbit.check`."""
    text = ("# Written by setup.py at build time: what the CUDA extension was built for.\n"
            f"EXTENSION = {build!r}\nREASON = {why!r}\nTORCH_CUDA_ARCH_LIST = {arch_list!r}\n"
            f"TORCH = {torch_version!r}\n")
    if not os.path.isfile(BUILD_INFO) or open(BUILD_INFO).read() != text:
        with open(BUILD_INFO, "w") as f:
            f.write(text)


def cuda_extension():
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
        torch_version, torch_cuda = torch.__version__, torch.version.cuda
    except ImportError:
        torch_version = torch_cuda = CUDA_HOME = None
    build, why = extension_plan(torch_version, torch_cuda, CUDA_HOME, os.environ, shutil.which("nvcc"))
    if not build:
        print(f"vllm_kbit: building without the CUDA extension: {why}", file=sys.stderr)
        write_build_info(False, why, None)
        return [], {}, None
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    archs = os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").split(";")
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/**/*.cu", recursive=True))
    if not sources:
        return [], {}, None
    write_build_info(True, why, ";".join(a for a in archs if a), torch_version)
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
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}, torch_version


def torch_requirement(built_against: str | None) -> str:
    """The extension links against one torch's C++ ABI: a build with it requires that torch's
    major.minor (a wheel then refuses to install beside another); a pure-Python one, any torch."""
    if built_against is None:
        return "torch"
    major, minor = built_against.split("+")[0].split(".")[:2]
    return f"torch=={major}.{minor}.*"


def main():
    from setuptools import find_packages, setup

    ext_modules, cmdclass, built_against = cuda_extension()
    setup(
        name="vllm_kbit",
        version="0.1.0",
        description="k-bit codebook weight quantization for vLLM with fused CUDA kernels",
        packages=find_packages(include=["vllm_kbit", "vllm_kbit.*"]),
        python_requires=">=3.10",
        install_requires=[torch_requirement(built_against), "safetensors", "compressed-tensors", "tqdm"],
        extras_require={"test": ["pytest"]},
        ext_modules=ext_modules,
        cmdclass=cmdclass,
        entry_points={
            "vllm.general_plugins": ["kbit = vllm_kbit:register"],
            "console_scripts": ["vllm-kbit-convert = vllm_kbit.convert:main",
                                "vllm-kbit-check = vllm_kbit.check:main"],
        },
    )


# setuptools runs this file as __main__; tests import extension_plan without building
if __name__ == "__main__":
    main()
