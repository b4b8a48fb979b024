"""A daemon pointed at a broken model exits at once, non-zero, with one line that says what
is wrong and what to do, in its termination log too; and leaves nothing behind.

Each case runs the real ``pagefleet daemon`` as a subprocess on a checkpoint damaged here
(the loader-level messages are tests/engine/test_loader_errors.py). After the exit: the
last line on stderr is the cause (not a traceback's last frame), the termination log holds
exactly that line, the port binds again, and no process of the run (the engine process,
the fork server) is still alive.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagefleet.engine.tiny import PRESETS, write_random_checkpoint

SMALL = {**PRESETS["tiny"], "num_hidden_layers": 2, "max_position_embeddings": 64}
# Generous for a loaded 2-core CI machine; a failing start takes a few seconds (imports).
EXIT_WITHIN_S = 90.0


@dataclass
class Exit:
    code: int
    seconds: float
    last_line: str
    termination: str
    port_free: bool
    left_running: list[int]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _processes_with(marker: str) -> list[int]:
    """Processes whose environment carries ``marker`` (the daemon's children inherit it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker.encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def run_daemon(
    model: Path,
    tmp_path: Path,
    *args: str,
    drop_root: bool = False,
    port: int | None = None,
    env: dict[str, str] | None = None,
    during: Callable[[subprocess.Popen[bytes], str], None] | None = None,
) -> Exit:
    """Run the daemon until it exits; ``during(proc, marker)`` runs once it has started
    (``marker``: the environment entry every process of the run carries)."""
    port = port or _free_port()
    log = tmp_path / "termination-log"
    log.touch()  # the kubelet creates it; the daemon fills it
    marker = f"PAGEFLEET_TEST_RUN={tmp_path.name}-{port}"
    cmd = [sys.executable, "-m", "pagefleet.cli", "daemon", "--model", str(model),
           "--port", str(port), *args]  # fmt: skip
    if drop_root:
        # Root reads every file regardless of its mode: drop the capabilities that let it.
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PAGEFLEET_TERMINATION_LOG": str(log),
           marker.split("=")[0]: marker.split("=")[1], **(env or {})}  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    if during is not None:
        during(proc, marker)
    try:
        _, err = proc.communicate(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the daemon was still running {EXIT_WITHIN_S:.0f}s after its start")
    seconds = time.monotonic() - t0
    # The engine process sees the pipe close and exits; give it a moment, then look.
    deadline = time.monotonic() + 5.0
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _processes_with(marker)
    for pid in left:
        os.kill(pid, 9)
    lines = [ln for ln in err.decode(errors="replace").splitlines() if ln.strip()]
    return Exit(
        code=proc.returncode,
        seconds=seconds,
        last_line=lines[-1] if lines else "",
        termination=log.read_text(),
        port_free=_port_free(port),
        left_running=left,
    )


def assert_one_clear_line(result: Exit, *fragments: str, code: int = 1) -> None:
    assert result.code == code, result
    assert result.termination.count("\n") == 1, result.termination
    line = result.termination.strip()
    assert result.last_line == f"Error: {line}", result
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    assert result.port_free, "the daemon's port is still bound after its exit"
    assert result.left_running == [], f"processes left running: {result.left_running}"


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "small", SMALL, seed=7)


@pytest.fixture
def ckpt(small_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(small_dir, tmp_path / "ckpt"))


def _edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), {"format": "pt"})


def test_truncated_weights(ckpt: Path, tmp_path: Path) -> None:
    file = ckpt / "model.safetensors"
    file.write_bytes(file.read_bytes()[:5000])
    result = run_daemon(ckpt, tmp_path)
    assert_one_clear_line(result, str(file), "is not a valid safetensors file", "download")


def test_mistyped_config_field_in_the_engine_thread(ckpt: Path, tmp_path: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_hidden_layers"] = None
    (ckpt / "config.json").write_text(json.dumps(cfg))
    result = run_daemon(ckpt, tmp_path, "--no-engine-process")
    assert_one_clear_line(result, "config.json: num_hidden_layers must be a positive integer")


def test_max_model_len_past_the_models_positions(small_dir: Path, tmp_path: Path) -> None:
    result = run_daemon(small_dir, tmp_path, "--max-model-len", "4096")
    assert_one_clear_line(result, "exceeds the model's max_position_embeddings 64")


def test_kv_pool_too_small_for_max_model_len(small_dir: Path, tmp_path: Path) -> None:
    result = run_daemon(small_dir, tmp_path, "--max-model-len", "64", "--num-gpu-blocks", "2")
    assert_one_clear_line(result, "max_model_len 64 does not fit the KV pool", "--num-gpu-blocks")


def test_nan_weights(ckpt: Path, tmp_path: Path) -> None:
    def poison(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.o_proj.weight"][1, 2] = float("nan")

    _edit_tensors(ckpt, poison)
    result = run_daemon(ckpt, tmp_path)
    assert_one_clear_line(result, "'model.layers.0.self_attn.o_proj.weight'", "NaN or Inf")


def test_tokenizer_of_another_model(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "m", {**SMALL, "vocab_size": 100})
    result = run_daemon(path, tmp_path)
    assert_one_clear_line(result, "has 1024 tokens but the model's vocab_size is 100")


def test_unreadable_weights(ckpt: Path, tmp_path: Path) -> None:
    """safetensors reported a file it may not read as "No such file or directory"."""
    file = ckpt / "model.safetensors"
    file.chmod(0)
    result = run_daemon(ckpt, tmp_path, drop_root=os.geteuid() == 0)
    assert_one_clear_line(result, f"cannot read weights file {file}: permission denied")


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (
            ["--max-model-len", "1", "--block-size", "0"],
            ["--max-model-len 1: must be >= 2", "--block-size 0: must be >= 1"],
        ),
        (["--device", "tpu"], ["--device tpu: pagefleet runs on cpu or cuda"]),
    ],
)
def test_invalid_flag_is_one_line_in_the_flags_own_name(
    small_dir: Path, tmp_path: Path, args: list[str], fragments: list[str]
) -> None:
    result = run_daemon(small_dir, tmp_path, *args)
    assert_one_clear_line(result, *fragments, code=2)
    assert "pydantic" not in result.termination


def test_cuda_without_a_gpu(small_dir: Path, tmp_path: Path) -> None:
    """torch's "Found no NVIDIA driver on your system" named neither the flag nor the pod."""
    result = run_daemon(small_dir, tmp_path, "--device", "cuda", env={"CUDA_VISIBLE_DEVICES": ""})
    assert_one_clear_line(result, "sees no CUDA GPU", "--device cpu")


def test_port_in_use(small_dir: Path, tmp_path: Path) -> None:
    """A traceback ending in asyncio's "error while attempting to bind on address" was the
    message (and the termination log held "OSError: [Errno 98] ...")."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_daemon(small_dir, tmp_path, port=port)
        result.port_free = True  # ours holds it: what counts is that the daemon left
    assert_one_clear_line(
        result, f"cannot listen on 127.0.0.1:{port}: Address already in use", "--port"
    )


def _kill_the_engine_in_its_load(fifo: Path) -> Callable[[subprocess.Popen[bytes], str], None]:
    """SIGKILL the engine process (as the OOM killer does) while it reads ``fifo`` as its
    weights: opening the FIFO's write end returns once the engine has opened it to load,
    and its read then waits for bytes that never come, so the kill lands mid-load."""

    def during(proc: subprocess.Popen[bytes], marker: str) -> None:
        opened: list[int] = []
        opener = threading.Thread(target=lambda: opened.append(os.open(fifo, os.O_WRONLY)))
        opener.start()
        opener.join(EXIT_WITHIN_S)
        assert opened, f"nothing opened {fifo} within {EXIT_WITHIN_S:.0f}s"
        try:
            readers = [
                pid for pid in _processes_with(marker)
                if any(os.path.realpath(fd) == str(fifo)
                       for fd in Path(f"/proc/{pid}/fd").iterdir())
            ]  # fmt: skip
            assert len(readers) == 1 and readers[0] != proc.pid, readers
            os.kill(readers[0], signal.SIGKILL)
        finally:
            os.close(opened[0])

    return during


def test_engine_killed_while_loading_says_so_and_what_to_do(ckpt: Path, tmp_path: Path) -> None:
    """An engine process the OOM killer ended in its load was "the engine failed to start:
    the engine process died (exit code -9)": neither the signal, nor the model, nor a fix."""
    fifo = ckpt / "model.safetensors"
    fifo.unlink()
    os.mkfifo(fifo)
    result = run_daemon(ckpt, tmp_path, during=_kill_the_engine_in_its_load(fifo))
    assert_one_clear_line(
        result,
        f"died while loading {ckpt}: killed by signal 9 (SIGKILL), probably out of memory",
        "--max-model-len",
        "--kv-cache-memory-mb",
        "smaller model",
    )
