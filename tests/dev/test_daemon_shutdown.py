"""`pagefleet daemon` stopped by hand or by systemd, where no kubelet SIGKILLs it after a
grace period: a stuck stream or a hung engine must not keep it alive, a second signal ends
it at once, and its default deadline fits inside the pods' termination grace.

Real daemon processes on the tiny model; a "stuck" stream is one whose engine process is
stopped (SIGSTOP), as a hung GPU kernel looks from the HTTP side.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from pagefleet.daemon.cli import command as daemon_command
from pagefleet.dev.process import free_port, wait_until

pytestmark = pytest.mark.slow

LONG_STREAM = {
    "prompt": "The quick brown fox",
    "max_tokens": 3500,
    "stream": True,
    "ignore_eos": True,
}


@dataclass(slots=True)
class RunningDaemon:
    proc: subprocess.Popen[bytes]
    base: str
    engine_pid: int
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def _daemon(tmp_path: Path, *args: str) -> Iterator[RunningDaemon]:
    """A tiny-model daemon process (engine in its own process) with ``args``, ready; on the
    way out whatever is left of it and its engine is killed."""
    port = free_port()
    log = tmp_path / "daemon.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagefleet.cli", "daemon", "--model", "tiny",
             "--port", str(port), "--max-model-len", "4000", "--block-size", "8",
             "--num-gpu-blocks", "520", "--engine-process", *args],
            stdout=out, stderr=out, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    engine_pid = None
    try:
        wait_until(
            "daemon ready",
            lambda: urllib.request.urlopen(f"{base}/ready", timeout=1).status == 200,
            120,
            proc=proc,
            context=lambda: log.read_text(errors="replace")[-2000:],
        )
        with urllib.request.urlopen(f"{base}/server_info", timeout=5) as r:
            engine_pid = int(json.load(r)["engine_pid"])
        yield RunningDaemon(proc, base, engine_pid, log)
    finally:
        if engine_pid is not None and _alive(engine_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine_pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the fork server too
        proc.wait(10)


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@contextlib.contextmanager
def _stream(base: str) -> Iterator[urllib.request.Request]:
    """A long completion stream, its first chunk read; yields the open response."""
    req = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(LONG_STREAM).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.readline().startswith(b"data: ")
        yield resp


def _exit_within(proc: subprocess.Popen[bytes], seconds: float) -> tuple[int, float]:
    """Wait for ``proc``; returns its status and how long it took (fails past ``seconds``)."""
    t0 = time.monotonic()
    try:
        rc = proc.wait(seconds)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the daemon was still running {seconds:.0f}s later")
    return rc, time.monotonic() - t0


def test_drain_timeout_aborts_a_stream_with_a_clear_finish_reason(tmp_path: Path) -> None:
    """The ordinary bound: past --drain-timeout the open stream ends in-band with
    finish_reason "abort" and [DONE], and the daemon exits 0."""
    with _daemon(tmp_path, "--drain-timeout", "1") as d, _stream(d.base) as resp:
        d.proc.send_signal(signal.SIGTERM)
        rest = resp.read()
        rc, _ = _exit_within(d.proc, 20)
        assert b'"finish_reason":"abort"' in rest, rest[-300:]
        assert rest.rstrip().endswith(b"data: [DONE]")
        assert rc == 0, d.output()


def test_a_drain_longer_than_the_deadline_still_ends_streams_in_band(tmp_path: Path) -> None:
    """--drain-timeout past --shutdown-timeout: the deadline's exit would cut the stream
    with no word. Open requests are aborted early enough for their clients to read
    finish_reason "abort", and the daemon exits 0 before the deadline."""
    args = ("--drain-timeout", "120", "--shutdown-timeout", "10.5")  # aborts after 0.5 s
    with _daemon(tmp_path, *args) as d, _stream(d.base) as resp:
        d.proc.send_signal(signal.SIGTERM)
        rest = resp.read()
        rc, took = _exit_within(d.proc, 20)
        assert b'"finish_reason":"abort"' in rest, rest[-300:]
        assert rest.rstrip().endswith(b"data: [DONE]")
        assert rc == 0 and took < 10.5, (rc, took, d.output())


def test_a_stuck_stream_cannot_outlive_the_shutdown_deadline(tmp_path: Path) -> None:
    """Engine hung mid-stream, drain long: the daemon must still be gone by
    --shutdown-timeout, say why in its log, and take its engine process with it."""
    args = ("--drain-timeout", "120", "--shutdown-timeout", "3")
    with _daemon(tmp_path, *args) as d, _stream(d.base):
        os.kill(d.engine_pid, signal.SIGSTOP)
        d.proc.send_signal(signal.SIGTERM)
        rc, took = _exit_within(d.proc, 15)
        assert rc == 1, d.output()
        assert 2.5 < took < 8, took
        assert "--shutdown-timeout" in d.output()
        wait_until("engine process gone", lambda: not _alive(d.engine_pid), 5)


def test_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    """SIGTERM starts a long drain; a second SIGTERM (or Ctrl-C) must not wait for it."""
    with _daemon(tmp_path, "--drain-timeout", "120") as d, _stream(d.base):
        os.kill(d.engine_pid, signal.SIGSTOP)  # the stream cannot finish on its own
        d.proc.send_signal(signal.SIGTERM)
        wait_until("draining", lambda: b"draining" in d.log.read_bytes(), 10, proc=d.proc)
        time.sleep(0.5)
        assert d.proc.poll() is None, "the first SIGTERM must drain, not exit"
        d.proc.send_signal(signal.SIGINT)
        rc, _ = _exit_within(d.proc, 5)
        assert rc == 128 + signal.SIGINT, d.output()
        wait_until("engine process gone", lambda: not _alive(d.engine_pid), 5)


def test_the_default_deadline_fits_the_operators_pods() -> None:
    """The daemon's own deadline ends it before the kubelet's SIGKILL (stacks logged), and
    leaves the drain its full time plus the abort and cleanup after it."""
    from pagefleet.api.inferenceservice import parse_spec
    from pagefleet.operator.builders import BuildSettings, Owner, build_children

    spec = parse_spec(
        {
            "model": {"source": {"path": "tiny"}},
            "roles": {"unified": {}},
            "index": {"redisURL": "redis://redis:6379/0"},
        }
    )
    objs = build_children(spec, Owner(name="m", namespace="ns", uid="u"), BuildSettings())
    (pod,) = [
        o["spec"]["template"]["spec"]
        for o in objs
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "m-unified"
    ]
    params = {p.name: p.default for p in daemon_command.params}
    deadline, drain = params["shutdown_timeout_s"], params["drain_timeout_s"]
    assert isinstance(deadline, float) and isinstance(drain, float)
    assert drain + 20 <= deadline < pod["terminationGracePeriodSeconds"]
    help_text = CliRunner().invoke(daemon_command, ["--help"], terminal_width=200).output
    assert "--shutdown-timeout" in help_text
