"""The peers of kbit: other low-bit weight-only GEMMs a user could run instead, one adapter each,
for bench_gemm.py (single kernels) and bench_decode.py (a decode step in one CUDA graph).

A peer is named FAMILY-wBgG (B bits per weight, groups of G weights along the input dim). Its
adapter builds random weights in that format for an N x K layer and returns (fn, weight_bytes):
fn(x[M, K]) -> y[M, N] with x in the peer's activation dtype. Random bits suffice: every
kernel here takes the same time whatever the values.

  gemlite   GemLite (pip gemlite), Triton GEMV / GEMM on the HQQ affine format W = (q - z) * s,
            fp16 scale and zero per group; 8/4/2/1 bits, groups >= 16 (3 bits: none).
  tinygemm  torch.ops.aten._weight_int4pack_mm (in torch; torchao's int4 weight-only
            tile_packed_to_4d format calls the same op): 4 bits, groups 32/64/128/256,
            bf16 activations, bf16 scale and zero per group.
  gptq      vLLM's GPTQ linear method (AutoGPTQConfig): the kernel vLLM's
            choose_mp_linear_kernel picks for symmetric GPTQ on this GPU (Machete on Hopper at
            4 bits, g128); 2 and 3 bits are refused by vLLM 0.24 (the refusal is recorded).
  exllama   vLLM's ExLlama GPTQ kernel (_custom_ops.gptq_gemm) called directly: 2/3/4/8 bits,
            fp16 only; vLLM 0.24 no longer selects it at 2 or 3 bits, its kernels remain.

torchao is no peer of its own here: with torch 2.11 + cu130 its int4 weight-only path that runs is
the tinygemm format above (its 'plain' / 'preshuffled' formats need the mslk package, its intx
weight-only path stores int8 and calls F.linear, and its wheel's own kernels are fp8 / mxfp8).

`--peers` takes `all`, families, or full names (gemlite-w2g128); `--peer-bits` filters.
A peer that cannot be imported, built or run is recorded with its error, never dropped.
"""
from __future__ import annotations

import ast
import math
import os
import re
from dataclasses import dataclass, field

import torch

FP16, BF16 = torch.float16, torch.bfloat16


# ------------------------------------------------------------------------------ formats

def bytes_per_weight(family: str, bits: int, group: int) -> float:
    """Bytes of one weight in a format: the packed values plus its share of the metadata."""
    if family == "kbit":  # K bit planes + one E4M4 absmax byte per 32 weights
        return bits / 8 + 1 / 32
    if family in ("gemlite", "tinygemm"):  # a 16-bit scale and a 16-bit zero per group
        return bits / 8 + 4 / group
    if family in ("gptq", "marlin", "machete"):  # symmetric: a 16-bit scale per group
        return bits / 8 + 2 / group
    if family == "exllama":  # a 16-bit scale and a packed `bits`-bit zero per group
        return bits / 8 + (2 + bits / 8) / group
    if family == "fp16":
        return 2.0
    raise ValueError(f"bytes_per_weight: unknown family {family!r}")


@dataclass(frozen=True)
class Family:
    bits: tuple  # bit widths the format has
    groups: tuple  # group sizes the kernel takes
    default: tuple  # (bits, group) run when the family is named alone
    dtype: torch.dtype
    doc: str


FAMILIES = {
    "gemlite": Family((8, 4, 2, 1), (16, 32, 64, 128, 256), ((4, 64), (2, 64)), FP16,
                      "GemLite Triton kernels, HQQ affine format"),
    "tinygemm": Family((4,), (32, 64, 128, 256), ((4, 32), (4, 64), (4, 128)), BF16,
                       "torch.ops.aten._weight_int4pack_mm"),
    "gptq": Family((8, 4, 3, 2), (32, 64, 128), ((4, 128), (3, 128), (2, 128)), FP16,
                   "what vLLM's GPTQ linear method runs"),
    "exllama": Family((8, 4, 3, 2), (32, 64, 128), ((4, 128), (3, 128), (2, 128)), FP16,
                      "vLLM's gptq_gemm (ExLlama) kernel"),
}


@dataclass(frozen=True)
class Peer:
    family: str
    bits: int
    group: int

    @property
    def name(self) -> str:
        return f"{self.family}-w{self.bits}g{self.group}"

    @property
    def dtype(self) -> torch.dtype:
        return FAMILIES[self.family].dtype

    @property
    def bpw(self) -> float:
        return bytes_per_weight(self.family, self.bits, self.group)


_NAME = re.compile(r"^([a-z]+)-w(\d+)g(\d+)$")


def add_arguments(ap) -> None:
    """The peer options bench_gemm.py and bench_decode.py share (read back by from_args)."""
    ap.add_argument("--peers", default="", help="other low-bit kernels beside kbit: 'all', families (gemlite, "
                    "tinygemm, gptq, exllama) or FAMILY-wBgG names, comma separated (benchmarks/peers.py)")
    ap.add_argument("--peer-bits", default="2,3,4", help="bit widths of the peer families' defaults")
    ap.add_argument("--gemlite-tune", default="borrow", choices=("borrow", "fast"),
                    help="GemLite's launch configs: its shipped H100 table + borrowed 4-bit entries, or its "
                         "own autotuning (minutes per shape set)")


def from_args(args) -> list[Peer]:
    """The peers add_arguments' options select, with GemLite's tuning mode set."""
    GEMLITE.mode = args.gemlite_tune
    return select(args.peers, [int(b) for b in args.peer_bits.split(",") if b])


def select(spec: str, bits=None) -> list[Peer]:
    """Peers named by `spec` ('all', 'none', families or FAMILY-wBgG, comma separated), the
    families' defaults filtered to `bits` (an iterable of ints; None keeps all)."""
    out = []
    for tok in (t.strip().lower() for t in (spec or "").split(",")):
        if not tok or tok == "none":
            continue
        if tok == "all":
            names = list(FAMILIES)
        else:
            names = [tok]
        for nm in names:
            m = _NAME.match(nm)
            if m:
                fam, b, g = m.group(1), int(m.group(2)), int(m.group(3))
                if fam not in FAMILIES:
                    raise ValueError(f"--peers: unknown family {fam!r} in {nm!r} (known: {', '.join(FAMILIES)})")
                f = FAMILIES[fam]
                if b not in f.bits or g not in f.groups:
                    raise ValueError(f"--peers: {nm!r}: {fam} has bits {f.bits} and groups {f.groups}")
                cands = [Peer(fam, b, g)]  # an explicit name is kept whatever --peer-bits says
            elif nm in FAMILIES:
                cands = [Peer(nm, b, g) for b, g in FAMILIES[nm].default if bits is None or b in set(bits)]
            else:
                raise ValueError(f"--peers: unknown peer {nm!r} (families: {', '.join(FAMILIES)}; "
                                 f"or FAMILY-wBgG, e.g. gemlite-w2g64)")
            out += [p for p in cands if p not in out]
    return out


def describe_error(e: BaseException) -> str:
    """One line for a results file: the exception's type and the first line of its message."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}".rstrip(": ")


def try_make(peer: Peer, n: int, k: int):
    """(fn, weight_bytes, None), or (None, 0, error line) when the peer cannot be built."""
    try:
        fn, wb = make(peer, n, k)
        return fn, wb, None
    except Exception as e:  # noqa: BLE001  (any failure is a result to report)
        return None, 0, describe_error(e)


def make(peer: Peer, n: int, k: int):
    if k % peer.group:
        raise ValueError(f"{peer.name}: K = {k} is not a multiple of the group size {peer.group}")
    return {"gemlite": _gemlite, "tinygemm": _tinygemm, "gptq": _gptq, "exllama": _exllama}[peer.family](
        n, k, peer.bits, peer.group)


# ------------------------------------------------------------------------------ GemLite

@dataclass
class _GemliteState:
    mode: str = "borrow"  # borrow | fast (see gemlite_setup)
    ms: tuple = (1, 16, 64, 256)  # the batch sizes to borrow configs for
    loaded: str = ""
    borrowed: list = field(default_factory=list)
    base: dict = field(default_factory=dict)  # kind -> keys of the table gemlite ships
    shipped: dict = field(default_factory=dict)  # kind -> keys before any borrowing (+ tuned files)
    templates: dict = field(default_factory=dict)


GEMLITE = _GemliteState()
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def gemlite_tuned_file(gpu_name: str, folder: str = RESULTS) -> str:
    """Where a `fast` run leaves gemlite's autotuned configs (only those its shipped table lacks);
    committed to benchmarks/results, later runs on that GPU load it."""
    return os.path.join(folder, f"gemlite_configs_{gpu_tag(gpu_name)}.json")


def gemlite_setup(mode: str = "borrow"):
    """Import gemlite and choose how its Triton kernels get their launch configs.

    gemlite autotunes every (M, N, K, group, bits) it has no stored config for, compiling each
    candidate (N and K are compile-time constants): minutes per shape set. `borrow` loads the
    configs gemlite ships for the H100 (on any Hopper GPU) and, for keys they lack (2 bits, the
    70B shapes), copies the stored 4-bit config of the nearest M bucket and shape at the same
    group; the record says how many were borrowed. `fast` runs gemlite's own fast autotuning
    instead (slow the first time on a machine) and gemlite_save keeps what it found. Either
    mode first loads benchmarks/results/gemlite_configs_<gpu>.json, an earlier `fast` run's."""
    import gemlite
    from gemlite.core import GEMLITE_TRITON_CONFIG_CACHE, GemLiteLinear
    if mode not in ("borrow", "fast"):
        raise ValueError(f"--gemlite-tune: {mode!r} (borrow | fast)")
    GEMLITE.mode = mode
    h100 = os.path.join(os.path.dirname(gemlite.__file__), "configs", "h100.json")
    name = torch.cuda.get_device_name()
    if torch.cuda.get_device_capability()[0] == 9 and "h100" not in name.lower() and os.path.exists(h100):
        GemLiteLinear.load_config(h100)  # gemlite picks its table by GPU name; Hopper GPUs share it
        GEMLITE.loaded = f"h100.json (loaded for {name})"
    else:
        GEMLITE.loaded = f"gemlite's own table for {name}"
    GEMLITE.base = {kind: set(t) for kind, t in GEMLITE_TRITON_CONFIG_CACHE.items()}
    tuned = gemlite_tuned_file(name)
    if os.path.exists(tuned) and GemLiteLinear.load_config(tuned):
        GEMLITE.loaded += f" + {os.path.relpath(tuned, os.path.dirname(RESULTS))}"
    GEMLITE.shipped = {kind: set(t) for kind, t in GEMLITE_TRITON_CONFIG_CACHE.items()}
    return gemlite


def gemlite_save(folder: str) -> str:
    """After a `fast` run: the configs gemlite tuned that its shipped table lacks, as
    FOLDER/gemlite_configs_<gpu>.json (merged with what that file held); returns the path."""
    import json
    import tempfile
    from gemlite.core import GemLiteLinear
    path = gemlite_tuned_file(torch.cuda.get_device_name(), folder)
    with tempfile.TemporaryDirectory() as tmp:
        everything = os.path.join(tmp, "all.json")
        GemLiteLinear.cache_config(everything)  # gemlite's table + what its autotuner found
        with open(everything) as f:
            table = json.load(f)
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    borrowed = {b.split(" ", 1)[1].split(" <- ")[0] for b in GEMLITE.borrowed}
    out = {kind: {**old.get(kind, {}), **{key: cfg for key, cfg in entries.items()
                                         if key not in GEMLITE.base.get(kind, ()) and key not in borrowed}}
           for kind, entries in table.items()}
    with open(path, "w") as f:
        json.dump({kind: entries for kind, entries in out.items() if entries}, f, indent=0, sort_keys=True)
    return path


def _gemlite_borrow(n, k, bits, group, elements, type_id, ms):
    """Stored configs for the keys (M bucket, n, k, group, elements, type_id) that gemlite's
    table lacks, copied from its 4-bit entry of the nearest M bucket, then the nearest shape,
    at the same group size (see gemlite_setup)."""
    from gemlite.core import GEMLITE_TRITON_CONFIG_CACHE as cache
    from gemlite.triton_kernels import utils as gu
    from gemlite.core import get_matmul_type
    for m in ms:
        kind = get_matmul_type(m, bits)
        table = cache.get(kind, {})
        mb = gu.get_closest_m(m)
        sig = str((mb, n, k, group, elements, type_id))
        if sig in table:
            continue
        shipped = GEMLITE.shipped.get(kind, set())  # borrow from stored entries only, never from a borrowed one
        best = None  # the same M bucket if the table has it (it lacks M = 64 for GEMM), else the nearest
        for key, cfg in table.items():
            if key not in shipped:
                continue
            km, kn, kk, kg, ke, kt = ast.literal_eval(key)  # gemlite's table keys: tuples of ints
            if kt % 100 != 4 or kg != group:
                continue
            d = (abs(math.log(km / mb)), abs(math.log(kn / n)) + abs(math.log(kk / k)))
            if best is None or d < best[0]:
                best = (d, key, cfg)
        if best is None:
            continue
        cfg = dict(best[2])
        if kind.startswith("GEMV"):  # a GEMV tile holds whole packed words, and 2 K-splits share a group
            cfg["BLOCK_SIZE_K"] = max(cfg["BLOCK_SIZE_K"], elements)
            if kind == "GEMV_REVSPLITK" and cfg["BLOCK_SIZE_K"] * 2 > group:
                continue
        table[sig] = cfg
        cache[kind] = table
        GEMLITE.borrowed.append(f"{kind} {sig} <- {best[1]}")


def _gemlite(n, k, bits, group):
    if not GEMLITE.loaded:
        gemlite_setup(GEMLITE.mode)
    from gemlite.core import forward_functional
    key = (n, k, bits, group)
    if key not in GEMLITE.templates:
        from gemlite.helper import A16Wn
        wq = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, device="cuda")
        s = (torch.rand(n, k // group, device="cuda", dtype=FP16) * 1e-2)
        z = torch.full((n, k // group), 2 ** (bits - 1), device="cuda", dtype=FP16)
        layer = A16Wn(device="cuda", dtype=FP16).from_weights(wq, s, z, bits, group)
        del wq
        meta = layer.get_meta_args()
        if GEMLITE.mode == "borrow":
            from gemlite import DType  # type_id as gemlite's forward computes it (bf16 shares fp16's)
            _gemlite_borrow(n, k, bits, group, meta[4], DType.FP16.value * 100 + bits, GEMLITE.ms)
        GEMLITE.templates[key] = (layer.get_tensor_args(), meta)
    targs, meta = GEMLITE.templates[key]
    args = [t.clone() for t in targs]  # each layer its own weights (as the decode step needs)
    wbytes = sum(t.numel() * t.element_size() for t in args[:3])

    def run(x):
        return forward_functional(x, None, args, meta)
    return run, wbytes


def gemlite_record():
    """What the results file says about gemlite's configs."""
    return {"gemlite_tune": GEMLITE.mode, "gemlite_configs": GEMLITE.loaded or "gemlite not imported",
            "gemlite_borrowed": len(GEMLITE.borrowed), "gemlite_borrowed_keys": GEMLITE.borrowed[:200]}


# ------------------------------------------------------------------------------ tinygemm

def _tinygemm(n, k, bits, group, inner_k_tiles=8):
    # [n][k/2] uint8 (two 4-bit values a byte) -> [n/8][k/(8*16)][32][4] int32; x must be bf16
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    wp = torch.ops.aten._convert_weight_to_int4pack(w, inner_k_tiles)
    del w
    sz = (torch.rand(k // group, n, 2, device="cuda") * 1e-2).to(BF16)  # [groups][n][scale, zero]

    def run(x):
        return torch.ops.aten._weight_int4pack_mm(x, wp, group, sz)
    return run, wp.numel() * 4 + sz.numel() * 2


# ------------------------------------------------------------------------------ vLLM GPTQ

def gptq_kernel_choice(bits, group, n, k, act=FP16):
    """The MPLinearKernel class vLLM 0.24 would run for a symmetric GPTQ layer, or raises the
    error vLLM raises (its GPTQ config has 4 and 8 bits only)."""
    from vllm.model_executor.kernels.linear import choose_mp_linear_kernel
    from vllm.model_executor.kernels.linear.mixed_precision import MPLinearLayerConfig
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
    cfg = AutoGPTQConfig(weight_bits=bits, group_size=group, desc_act=False, is_sym=True,
                         lm_head_quantized=False, dynamic={}, full_config={})
    mp = MPLinearLayerConfig(full_weight_shape=(k, n), partition_weight_shape=(k, n),
                             weight_type=cfg.quant_type, act_type=act, group_size=group,
                             zero_points=False, has_g_idx=False)
    return choose_mp_linear_kernel(mp)


def cublas_method(n, k):
    w = torch.randn(n, k, dtype=torch.float16, device="cuda")
    return (lambda x: torch.matmul(x, w.t())), w.numel() * 2


def marlin_method(n, k, group):
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        marlin_make_empty_g_idx, marlin_make_workspace_new, marlin_permute_scales)
    from vllm.scalar_type import scalar_types
    try:
        from vllm.model_executor.layers.quantization.utils.marlin_utils import should_use_atomic_add_reduce
    except ImportError:
        should_use_atomic_add_reduce = None
    dev = torch.device("cuda", torch.cuda.current_device())
    qt = scalar_types.uint4b8
    q = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), dtype=torch.int32, device=dev)
    empty = marlin_make_empty_g_idx(dev)
    q_m = ops.gptq_marlin_repack(q, empty, k, n, qt.size_bits)
    s_m = marlin_permute_scales(torch.rand(k // group, n, dtype=torch.float16, device=dev) * 1e-2, k, n, group)
    ws = marlin_make_workspace_new(dev)

    def run(x):
        m = x.shape[0]
        atomic = bool(should_use_atomic_add_reduce(m=m, n=n, k=k, device=dev, dtype=torch.float16)) \
            if should_use_atomic_add_reduce else False
        return ops.marlin_gemm(x, None, q_m, None, s_m, None, None, empty, empty, empty, ws, qt, size_m=m, size_n=n,
                               size_k=k, is_k_full=True, use_atomic_add=atomic, use_fp32_reduce=True,
                               is_zp_float=False)
    return run, k * n // 2 + (k // group) * n * 2


def machete_method(n, k, group=128):
    from vllm import _custom_ops as ops
    from vllm.scalar_type import scalar_types
    qt = scalar_types.uint4b8
    q = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), dtype=torch.int32, device="cuda")
    b = ops.machete_prepack_B(q.t().contiguous().t(), a_type=torch.float16, b_type=qt, group_scales_type=torch.float16)
    s = (torch.rand(k // group, n, dtype=torch.float16, device="cuda") * 1e-2).contiguous()

    def run(x):
        return ops.machete_mm(a=x, b_q=b, b_type=qt, b_group_scales=s, b_group_zeros=None, b_group_size=group)
    return run, k * n // 2 + (k // group) * n * 2


def _gptq(n, k, bits, group):
    kernel = gptq_kernel_choice(bits, group, n, k).__name__
    if kernel == "MacheteLinearKernel":
        fn, wb = machete_method(n, k, group)
    elif kernel == "MarlinLinearKernel":
        fn, wb = marlin_method(n, k, group)
    elif kernel == "ExllamaLinearKernel":
        fn, wb = _exllama(n, k, bits, group)
    else:
        raise NotImplementedError(f"vLLM picks {kernel}; no adapter here")
    fn.kernel = kernel
    return fn, wb


def _exllama(n, k, bits, group):
    from vllm import _custom_ops as ops
    if not hasattr(torch.ops._C, "gptq_gemm"):
        raise RuntimeError("this vLLM build has no _C.gptq_gemm")
    g = k // group
    q = torch.randint(-2 ** 31, 2 ** 31 - 1, (k * bits // 32, n), dtype=torch.int32, device="cuda")
    zeros = torch.randint(-2 ** 31, 2 ** 31 - 1, (g, n * bits // 32), dtype=torch.int32, device="cuda")
    scales = (torch.rand(g, n, dtype=FP16, device="cuda") * 1e-2)
    g_idx = torch.empty((0,), dtype=torch.int32, device="cuda")  # no act-order: the ExLlama path
    ops.gptq_shuffle(q, g_idx, bits)  # once at load, as vLLM's ExllamaLinearKernel does

    def run(x):
        return ops.gptq_gemm(x, q, zeros, scales, g_idx, True, False, bits)
    run.kernel = "gptq_gemm"
    return run, q.numel() * 4 + zeros.numel() * 4 + scales.numel() * 2


# ------------------------------------------------------------------------------ result files

def gpu_tag(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200'; else the name, filename-safe."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    if m:
        return m.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"


def label(method: str, record: dict) -> str:
    """A table's row label: the method, and for a peer that delegates, the kernel it ran."""
    kernel = record.get("kernel")
    return f"{method} ({kernel.removesuffix('LinearKernel')})" if kernel and kernel != "gptq_gemm" else method


def table(rows, cols, row_label="method"):
    """Text table, columns right-aligned to their widest cell: rows = [(label, {col: cell})];
    a missing cell prints as '-'."""
    width = max([len(row_label)] + [len(r[0]) for r in rows]) + 1
    cw = {c: max([len(str(c))] + [len(str(cells.get(c, "-"))) for _, cells in rows]) + 2 for c in cols}
    lines = [row_label.ljust(width) + "".join(str(c).rjust(cw[c]) for c in cols)]
    for label, cells in rows:
        lines.append(label.ljust(width) + "".join(str(cells.get(c, "-")).rjust(cw[c]) for c in cols))
    return "\n".join(lines)
