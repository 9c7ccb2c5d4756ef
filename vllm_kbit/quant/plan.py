"""What `convert` runs per weight for each `--method`, and the work done before streaming:

  * rtn / mse: data-free, tensor by tensor while the shards are written;
  * gptq: the sequential calibration run (calibrate.py) over the whole model first, keeping
    the (qweight, absmax) of every selected weight in host memory (about bits/8 + 1/32 bytes
    per weight), then streamed out like the others;
  * fit_codebook: one Lloyd-Max codebook per fused group (q/k/v, gate/up, whose vLLM layer is
    one kernel call with one codebook) or per single linear, fitted before quantizing it;
  * bits_of (mixed K, quant/mixed.py): each weight's own K and that K's codebook.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch

from vllm_kbit import format as kf
from vllm_kbit.quant import calibrate, codebooks, rounding

DEFAULT_CALIB_SAMPLES, DEFAULT_CALIB_LEN = 128, 512


def fused_group(module: str) -> str:
    """The name of the vLLM layer a checkpoint linear belongs to (its first shard's name)."""
    parent, _, leaf = module.rpartition(".")
    for g in kf.FUSED_GROUPS:
        if leaf in g:
            return f"{parent}.{g[0]}" if parent else g[0]
    return module


def _note(msg: str) -> None:
    print(f"vllm_kbit.convert: {msg}", file=sys.stderr)


class Plan:
    """Quantizes one selected weight at a time: `plan(name, tensor)` ->
    (qweight, absmax, codebook or None when the config's codebook applies)."""

    def __init__(self, method: str, bits: int, codebook: torch.Tensor, device: torch.device,
                 fit: bool = False, search: int = rounding.DEFAULT_SEARCH,
                 bits_of: dict[str, int] | None = None, codebooks_of: dict[int, torch.Tensor] | None = None):
        if method not in rounding.METHODS:
            raise ValueError(f"unknown method {method!r} (choose from {', '.join(rounding.METHODS)})")
        self.method, self.bits, self.codebook, self.device = method, bits, codebook, device
        # mixed K: weight name -> K, K -> codebook (weights not listed use bits / codebook)
        self.bits_of, self.codebooks_of = bits_of or {}, codebooks_of or {}
        self.fit, self.search = fit, search
        self.group_codebooks: dict[str, torch.Tensor] = {}
        self.done: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def k(self, name: str) -> int:
        return self.bits_of.get(name, self.bits)

    def base_codebook(self, name: str) -> torch.Tensor:
        return self.codebooks_of.get(self.k(name), self.codebook)

    def fit_codebooks(self, names: list[str], read: Callable[[str], torch.Tensor], progress: bool) -> None:
        """Fit one codebook per fused group of the selected weights `names` (reading each
        group's tensors with `read(name)`)."""
        from tqdm import tqdm

        groups: dict[str, list[str]] = {}
        for n in names:
            groups.setdefault(fused_group(n[:-len(".weight")]), []).append(n)
        for g, members in tqdm(groups.items(), desc="fit codebooks", unit="layer", disable=not progress,
                               file=sys.stderr):
            ws = [read(n).to(self.device, torch.float32) for n in members]
            self.group_codebooks[g] = codebooks.fit_codebook(ws, self.k(members[0]), init=self.base_codebook(members[0]),
                                                             scale_search=self.search).cpu()

    def codebook_for(self, name: str) -> torch.Tensor | None:
        return self.group_codebooks.get(fused_group(name[:-len(".weight")])) if self.fit else None

    def run_gptq(self, src: Path, names: set[str], calib: str | None, progress: bool,
                 samples: int = DEFAULT_CALIB_SAMPLES, seqlen: int = DEFAULT_CALIB_LEN) -> None:
        """Load SRC with transformers, calibrate and quantize every selected decoder linear."""
        import transformers

        # use_kernels=False: transformers releases that default to Hub kernels stop here without
        # the `kernels` package, and calibration needs the plain PyTorch modules anyway
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype="auto", use_kernels=False).eval()
        batches = calibration_batches(model, src, calib, samples, seqlen, self.device, progress)
        dev = self.device

        def quantize(full: list[str], weights: list[torch.Tensor], hessian: torch.Tensor):
            picked = [i for i, f in enumerate(full) if f"{f}.weight" in names]
            if not picked:
                return [None] * len(full)
            cbs = []
            for i in picked:
                cb = self.codebook_for(f"{full[i]}.weight")
                cbs.append((self.base_codebook(f"{full[i]}.weight") if cb is None else cb).to(dev))
            bits = self.k(f"{full[picked[0]]}.weight")  # a fused group shares K (mixed.py)
            res = rounding.gptq_shared_input([weights[i].to(dev) for i in picked], hessian, bits,
                                             cbs, self.search)
            new: list = [None] * len(full)
            for i, cb, (q, a) in zip(picked, cbs, res):
                self.done[f"{full[i]}.weight"] = (q.cpu(), a.cpu())
                new[i] = kf.dequantize(q, a, bits, cb)
            return new

        calibrate.quantize_sequential(model, batches, quantize, dev, progress)
        missing = sorted(names - self.done.keys())
        if missing:
            _note(f"gptq reached no calibration input for {len(missing)} weight(s) "
                  f"({missing[0]}, ...): they are quantized with mse")

    def __call__(self, name: str, tensor: torch.Tensor):
        cb = self.codebook_for(name)
        if name in self.done:
            q, a = self.done.pop(name)
            return q, a, cb
        use = self.base_codebook(name) if cb is None else cb
        method = "mse" if self.method == "gptq" else self.method
        q, a = rounding.quantize_weight(tensor.to(self.device), self.k(name), use.to(self.device), method,
                                        search=self.search)
        return q.cpu(), a.cpu(), cb


def calibration_batches(model, src: Path, calib: str | None, samples: int, seqlen: int, device,
                        progress: bool) -> list[torch.Tensor]:
    """Token batches [1, seqlen]: consecutive windows of the plain-text file `calib`, or, with
    none, text the model samples itself from its BOS token (no data set needed; it follows
    what the model has learnt, which is what its Hessians should weigh)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(src)
    if calib is not None:
        path = Path(calib)
        if not path.is_file():
            raise calibrate.CalibrationError(f"--calib {calib}: no such file")
        # verbose=False: the file is cut into seqlen windows below, so its length is no problem
        ids = tok(path.read_text(errors="replace"), return_tensors="pt", verbose=False).input_ids[0]
        n = min(samples, ids.numel() // seqlen)
        if n == 0:
            raise calibrate.CalibrationError(f"--calib {calib}: fewer than {seqlen} tokens")
        if n < samples:
            _note(f"--calib {calib} holds {n} windows of {seqlen} tokens (of {samples} wanted)")
        return [ids[i * seqlen:(i + 1) * seqlen].unsqueeze(0) for i in range(n)]
    bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    _note(f"no --calib file: sampling {samples} x {seqlen} calibration tokens from the model")
    model.to(device)
    from tqdm import tqdm

    out, batch = [], 16
    gen = torch.Generator(device="cpu").manual_seed(0)
    bar = tqdm(total=samples, unit="window", desc="gptq sampling", disable=not progress, file=sys.stderr)
    try:
        for s in range(0, samples, batch):
            b = min(batch, samples - s)
            torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
            start = torch.full((b, 1), bos, device=device)
            # the explicit mask says the BOS column is a token, not right padding (pad_token_id is BOS)
            ids = model.generate(start, attention_mask=torch.ones_like(start), do_sample=True, top_k=0,
                                 top_p=1.0, max_new_tokens=seqlen - 1, min_new_tokens=seqlen - 1,
                                 pad_token_id=bos)
            out += [ids[i:i + 1, :seqlen].cpu() for i in range(b)]
            bar.update(b)
    finally:
        bar.close()
        model.to("cpu")
    return out
