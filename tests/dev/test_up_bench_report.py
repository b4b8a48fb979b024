"""What `pagefleet up --bench` prints, read as a user reads it: a P/D fleet's ready line
says which daemon is which role, and each figure of the report carries its unit and
meaning. One real fleet (Redis, a prefill and a decode daemon, a gateway) for the module."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pd_up_bench(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    logs = tmp_path_factory.mktemp("logs")
    argv = [
        sys.executable, "-m", "pagefleet.cli", "up",
        "--model", "tiny", "--prefill", "1", "--decode", "1",
        "--bench", "--bench-requests", "4", "--log-dir", str(logs),
    ]  # fmt: skip
    up = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, f"stdout:\n{up.stdout}\nstderr:\n{up.stderr}"
    return up


def _flat(text: str) -> str:
    """``text`` with every run of whitespace one space: rich wraps lines at 80 columns."""
    return " ".join(text.split())


def test_pd_ready_line_says_which_daemon_is_prefill_and_which_decode(
    pd_up_bench: subprocess.CompletedProcess[str],
) -> None:
    """`up --prefill 1 --decode 1` printed "daemons http://A, http://B": nothing said
    which one prefills, so a user could not tell which log or metrics to read."""
    ready = next(ln for ln in pd_up_bench.stderr.splitlines() if "fleet ready" in ln)
    assert "prefill http://127.0.0.1:" in ready, ready
    assert "decode http://127.0.0.1:" in ready, ready
    assert "daemons http" not in ready, ready


def test_bench_report_names_its_units_and_slo(
    pd_up_bench: subprocess.CompletedProcess[str],
) -> None:
    """The report said "goodput 0.0 req/s (0% within SLO)" without the SLO, "24.3 tok/s"
    for output tokens only, TTFT/TPOT/ITL without saying what they measure, and nothing
    of the load (concurrency, output length) its throughput was measured under."""
    out = _flat(pd_up_bench.stdout)
    assert "within SLO: TTFT <= 500 ms, TPOT <= 100 ms)" in out, out
    assert "output tok/s" in out, out
    assert "TTFT: time to first token" in out and "TPOT:" in out and "ITL:" in out, out
    assert "prompt tokens served from the prefix cache" in out, out
    # Throughput means little without the load it was measured under.
    assert "load: closed loop, 8 conversations in flight" in out, out
    assert "16 output tokens per request" in out, out
    # Still there for scripts and tests that read it (`make run`).
    assert "ttft_ms" in out and "cluster prefix hit rate" in out and "\nA: " in pd_up_bench.stdout
