"""get_backend: the default per device, explicit names, and the clear errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagefleet.kernels import TorchAttentionBackend, default_backend_name, get_backend
from pagefleet.kernels.cpu_attention import CpuAttentionBackend


def test_defaults_per_device():
    assert default_backend_name(torch.device("cuda")) == "triton"
    assert default_backend_name(torch.device("cpu")) == "cpu"
    # g++ is part of the test setup (.ci/run), so the compiled kernel must build here.
    assert isinstance(get_backend(None, "cpu"), CpuAttentionBackend)
    assert isinstance(get_backend("auto", torch.device("cpu")), CpuAttentionBackend)


def test_cpu_backend_without_a_compiler_warns_once_and_runs_torch(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PAGEFLEET_KERNEL_CACHE", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with caplog.at_level("WARNING", logger="pagefleet.kernels.backend"):
        backend = get_backend("cpu", "cpu")
    assert isinstance(backend, TorchAttentionBackend)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "using the slower torch attention" in warnings[0].getMessage()
    assert "no-such-g++" in warnings[0].getMessage()


def test_cpu_backend_refuses_cuda():
    with pytest.raises(ValueError, match="'cpu' runs on the CPU"):
        get_backend("cpu", "cuda")


def test_explicit_name_is_honoured():
    assert get_backend("torch", "cpu").name == "torch"
    assert get_backend("cpu", "cpu").name == "cpu"
    if torch.cuda.is_available():
        assert get_backend(None, "cuda").name == "triton"
    else:
        # conftest turned the interpreter on, so triton on CPU is allowed here.
        assert os.environ.get("TRITON_INTERPRET") == "1"
        assert get_backend("triton", "cpu").name == "triton"


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*cpu, torch, triton"):
        get_backend("flash", "cpu")


def test_triton_on_cpu_without_interpreter_says_what_to_do(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError) as info:
        get_backend("triton", "cpu")
    msg = str(info.value)
    assert "needs a CUDA device" in msg
    assert "--attention-backend torch" in msg
    assert "TRITON_INTERPRET=1" in msg


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_triton_is_imported_only_on_demand_and_late_interpret_is_caught():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    code = """
import os, sys
import pagefleet.kernels as K
import torch
assert "triton" not in sys.modules, "pagefleet.kernels imported triton eagerly"
K.get_backend(None, "cpu")
assert "triton" not in sys.modules, "the torch backend imported triton"
import pagefleet.kernels.triton_attention  # compiled-for-GPU kernels
os.environ["TRITON_INTERPRET"] = "1"
try:
    K.get_backend("triton", "cpu")
except ValueError as exc:
    print("ERR", exc)
"""
    proc = _python(code, env)
    assert proc.returncode == 0, proc.stderr
    assert "ERR TRITON_INTERPRET=1 was set after" in proc.stdout
