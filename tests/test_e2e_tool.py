"""benchmarks/e2e.py's bookkeeping on the CPU: which rows get figures, the logs kept with them,
and the wait for each engine's process group."""
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("kbit_e2e", ROOT / "benchmarks" / "e2e.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FIGURES = {"quantization": "kbit", "latency_bs1_s": 1.25, "latency_bs16_s": 2.5, "throughput_req_s": 7.0,
           "kv_cache_tokens": 123456, "gpu_mem_used_gib": 70.0, "gpu": "NVIDIA H100",
           "gpu_at_start": {"gpu_free_gib": 78.9}, "kbit_extension_here": "the CUDA kernels (vllm_kbit._C)"}
MEMORY = ["(EngineCore_DP0 pid=7) INFO 01-01 00:00:01 [gpu_model_runner.py:1] Model loading took 5.1 GiB and 3.2 s",
          "(EngineCore_DP0 pid=7) INFO 01-01 00:00:02 [gpu_worker.py:2] Available KV cache memory: 61.3 GiB",
          "(EngineCore_DP0 pid=7) INFO 01-01 00:00:02 [kv_cache_utils.py:3] GPU KV cache size: 501,984 tokens",
          "(EngineCore_DP0 pid=7) INFO 01-01 00:00:02 [kv_cache_utils.py:4] Maximum concurrency for 1,024 tokens per request: 490.22x"]


def worker_output(kbit_line, figures=FIGURES):
    lines = ["INFO 01-01 00:00:00 [llm.py:1] starting", *MEMORY[:1]]
    if kbit_line:
        lines.append(f"(EngineCore_DP0 pid=7) INFO 01-01 00:00:01 [linear.py:48] vllm_kbit: kbit layers run {kbit_line}")
    lines += MEMORY[1:] + ["E2E_PARTIAL " + json.dumps({"startup_s": 30.0})]
    if figures is not None:
        lines.append("E2E_RESULT " + json.dumps(figures))
    return lines


def test_kbit_row_with_kernels_in_the_engine_keeps_figures_and_logs(e2e):
    config = e2e.CONFIGS["kbit4"]
    row = e2e.collect_result(config, worker_output("the CUDA kernels (vllm_kbit._C)"), 0)
    assert "error" not in row and row["latency_bs1_s"] == 1.25 and row["throughput_req_s"] == 7.0
    assert row["memory_log"] == MEMORY and row["returncode"] == 0
    assert row["kbit_log"] and "the CUDA kernels" in row["kbit_log"][0]
    assert row["gpu_at_start"] == {"gpu_free_gib": 78.9}


@pytest.mark.parametrize("kbit_line", [
    "the PyTorch reference (VLLM_KBIT_REFERENCE=1)",
    "the PyTorch reference (vllm_kbit._C is not built (ModuleNotFoundError: No module named 'vllm_kbit._C'))",
    None,  # an engine that never said (an older plugin, or its log level above INFO)
])
def test_kbit_row_without_kernels_in_the_engine_gets_an_error_not_figures(e2e, kbit_line):
    for config in (e2e.CONFIGS["kbit4"], e2e.CONFIGS["kbit2_lmhead"], {}):  # {}: a kbit checkpoint
        row = e2e.collect_result(config, worker_output(kbit_line), 0)
        assert row["error"].startswith("kbit without its CUDA kernels in the engine, figures withheld")
        assert (kbit_line or "no 'vllm_kbit: kbit layers run ...' line") in row["error"]
        assert not {"latency_bs1_s", "latency_bs16_s", "throughput_req_s", "kv_cache_tokens"} & row.keys()
        assert row["memory_log"] == MEMORY  # the logs still say what happened


def test_other_rows_need_no_kbit_line(e2e):
    figures = {**FIGURES, "quantization": None}
    row = e2e.collect_result(e2e.CONFIGS["bf16"], worker_output(None, figures), 0)
    assert "error" not in row and row["latency_bs16_s"] == 2.5 and row["memory_log"] == MEMORY


def test_worker_without_a_result_gets_its_last_error(e2e):
    lines = worker_output(None, figures=None) + ["ValueError: something broke", "RuntimeError: Engine core initialization failed"]
    row = e2e.collect_result(e2e.CONFIGS["kbit3"], lines, 1)
    assert row["error"] == "RuntimeError: Engine core initialization failed" and row["returncode"] == 1
    assert row["memory_log"] == MEMORY


def test_the_report_needs_no_cuda(e2e, tmp_path, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: pytest.fail("CUDA in the parent process"))
    args = type("Args", (), {"out": tmp_path, "tag": "t", "shape": "8b"})()
    rows = {"kbit4": e2e.collect_result(e2e.CONFIGS["kbit4"], worker_output("the CUDA kernels (x)"), 0),
            "kbit2": e2e.collect_result(e2e.CONFIGS["kbit2"], worker_output(None), 0)}
    e2e.report(args, rows, final=False)
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["gpu"] == "NVIDIA H100" and saved["results"]["kbit4"]["memory_log"] == MEMORY
    md = (tmp_path / "t.md").read_text()
    assert "| kbit4 | 1.250 |" in md and "| kbit2 | error: kbit without its CUDA kernels" in md


def test_wait_group_gone(e2e):
    quick = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    quick.wait()
    assert e2e.wait_group_gone(quick.pid, timeout=30) is True
    # a worker that exits leaving a child behind (as an engine core could): killed after the timeout
    code = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); print('up', flush=True)"
    leaky = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert leaky.stdout.readline().strip() == "up"
    leaky.wait()
    assert e2e.process_group_alive(leaky.pid)
    t = time.monotonic()
    assert e2e.wait_group_gone(leaky.pid, timeout=1) is False
    assert not e2e.process_group_alive(leaky.pid) and time.monotonic() - t < 30


def test_help_runs():
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--help"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "--configs" in p.stdout
