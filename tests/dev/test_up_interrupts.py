"""`pagefleet up` interrupted the way people interrupt it: a second Ctrl-C while the fleet
stops hurries the stop (SIGKILL) but still leaves no process and no temporary files."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _processes_with_env(marker: str) -> list[str]:
    """Live processes whose environment holds ``marker`` (pid and command line)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() not in Path(f"/proc/{pid}/environ").read_bytes():
                continue
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            found.append(f"{pid}: {cmd.decode(errors='replace')[:200]}")
        except OSError:
            continue
    return found


def test_a_second_ctrl_c_while_stopping_still_cleans_up(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with _reaped(_start_up(tmp)) as up:
        assert list(tmp.glob("pagefleet-redis-*")), "the fleet's Redis keeps its files in TMPDIR"
        up.send_signal(signal.SIGINT)
        time.sleep(0.3)  # stopping now: the gateway and the daemon drain
        up.send_signal(signal.SIGINT)
        _, err = up.communicate(timeout=60)
    deadline = time.monotonic() + 5
    while _processes_with_env(f"TMPDIR={tmp}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _processes_with_env(f"TMPDIR={tmp}")
    assert not list(tmp.glob("pagefleet-redis-*")), err


def test_an_interrupted_start_up_is_not_a_success(tmp_path: Path) -> None:
    """Interrupted before the fleet was ready, `up` (and `up --bench`, as `make run` calls
    it) stops what it started and exits non-zero: a script must not read exit status 0 as
    'the bench ran'. A Ctrl-C once the fleet serves stays the normal way out (status 0)."""
    up = subprocess.Popen(
        [sys.executable, "-m", "pagefleet.cli", "up", "--model", "tiny", "-n", "1", "--bench",
         "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    with _reaped(up):
        assert up.stderr is not None
        assert up.stderr.readline().startswith("starting Redis")
        time.sleep(0.5)  # inside the start-up now (Redis, the daemon loading)
        up.send_signal(signal.SIGTERM)
        _, err = up.communicate(timeout=60)
    assert "interrupted during start-up" in err
    assert up.returncode == 128 + signal.SIGINT, (up.returncode, err)


@contextlib.contextmanager
def _reaped(up: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """``up``, killed and waited for on the way out if a failed step left it running."""
    try:
        yield up
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def _start_up(tmp: Path, ignore_hup: bool = False) -> subprocess.Popen[str]:
    up = subprocess.Popen(
        [sys.executable, "-m", "pagefleet.cli", "up", "--model", "tiny", "-n", "1",
         "--port", "0", "--log-dir", str(tmp / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
        # As `nohup pagefleet up` starts it, or as a terminal does: SIGHUP at its default
        # even when this test itself runs under nohup (which the child would inherit).
        preexec_fn=lambda: signal.signal(
            signal.SIGHUP, signal.SIG_IGN if ignore_hup else signal.SIG_DFL
        ),
    )  # fmt: skip
    assert up.stdout is not None and up.stderr is not None
    line = up.stdout.readline()  # blocks until the fleet is ready
    assert line.startswith("gateway: "), line + up.stderr.read()
    # Then `up` waits for a signal (a signal before that, while it prints, is Aborted!).
    while (line := up.stderr.readline()) and not line.startswith("Ctrl-C to stop"):
        pass
    return up


def test_a_closed_terminal_stops_the_fleet_cleanly(tmp_path: Path) -> None:
    """SIGHUP (the terminal running `up` closed) stops the fleet as Ctrl-C does. Left to
    Python's default it killed `up` at once: the owner-watchers SIGKILLed the children (no
    drain) and the embedded Redis's files stayed in TMPDIR."""
    with _reaped(_start_up(tmp_path)) as up:
        up.send_signal(signal.SIGHUP)
        _, err = up.communicate(timeout=60)
    assert up.returncode == 0 and "fleet stopped" in err, (up.returncode, err)
    assert not list(tmp_path.glob("pagefleet-redis-*"))
    assert not _processes_with_env(f"TMPDIR={tmp_path}")


def test_nohup_keeps_the_fleet_running(tmp_path: Path) -> None:
    with _reaped(_start_up(tmp_path, ignore_hup=True)) as up:
        up.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert up.poll() is None, "SIGHUP ignored by the caller (nohup) must stay ignored"
        up.send_signal(signal.SIGINT)
        _, err = up.communicate(timeout=60)
    assert up.returncode == 0 and "fleet stopped" in err, err


class _Bench:
    """`up --bench` on two tiny daemons, its stderr gathered by a thread (the progress bar
    writes no newline until it ends)."""

    def __init__(self, tmp_path: Path, requests: int) -> None:
        self.up = subprocess.Popen(
            [sys.executable, "-m", "pagefleet.cli", "up", "--model", "tiny", "-n", "2",
             "--bench", "--bench-requests", str(requests), "--log-dir", str(tmp_path / "logs")],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.err = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.up.stderr is not None
        while chunk := self.up.stderr.read(1):
            self.err += chunk

    def wait_for(self, text: str, timeout_s: float = 120.0) -> str:
        """The first stderr line holding ``text``, once written."""
        deadline = time.monotonic() + timeout_s
        while True:
            ended = self.up.poll() is not None
            for line in self.err.splitlines():
                if text in line:
                    return line
            if ended or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        pytest.fail(f"no {text!r} on stderr (status {self.up.poll()}):\n{self.err}")

    def finish(self, timeout_s: float = 180.0) -> int:
        rc = self.up.wait(timeout_s)
        self._reader.join(10)
        return rc


def test_a_ctrl_c_during_the_bench_says_so_and_is_not_a_success(tmp_path: Path) -> None:
    """Interrupted mid-bench, `up` said only click's "Aborted!" (status 1)."""
    bench = _Bench(tmp_path, requests=2000)
    with _reaped(bench.up):
        bench.wait_for("fleet ready")
        bench.wait_for("requests:")  # the bench's progress: it runs
        bench.up.send_signal(signal.SIGINT)
        rc = bench.finish()
    assert rc == 128 + signal.SIGINT, (rc, bench.err)
    assert "interrupted during the bench; stopping the fleet" in bench.err
    assert bench.err.rstrip().endswith("fleet stopped"), bench.err
    assert "Aborted!" not in bench.err


def _daemon_pid(port: str) -> int:
    """The daemon process (not its watching shell) serving on ``port``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0] != b"sh" and b"daemon" in argv and port.encode() in argv:
            return int(pid)
    pytest.fail(f"no daemon process on port {port}")


def test_a_daemon_crash_during_the_bench_is_reported_restarted_and_fails_the_run(
    tmp_path: Path,
) -> None:
    """A daemon SIGKILLed mid-bench (the OOM killer) went unmentioned: nobody watched the
    fleet during the bench, `up` exited 0 and only the report's error count hinted at it."""
    bench = _Bench(tmp_path, requests=400)
    with _reaped(bench.up):
        ready = bench.wait_for("fleet ready")
        port = ready.split("daemons http://127.0.0.1:")[1].split(",")[0]
        os.kill(_daemon_pid(port), signal.SIGKILL)
        bench.wait_for("daemon-0 exited with status -9; restarting it in 1s")
        rc = bench.finish()
    assert rc == 1, (rc, bench.err)
    last = bench.err.rstrip().splitlines()[-1]
    assert last.startswith("Error: during the bench 1 crash(es): daemon-0 (status -9, log "), last
