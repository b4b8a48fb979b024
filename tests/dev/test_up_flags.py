"""`pagefleet up` refuses bad flags up front with a usage error naming the flag: no
traceback, and nothing started (no Redis, no daemon) before the refusal."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pagefleet.dev.local_fleet import command


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["-n", "0"], "--num-daemons"),
        (["-n", "-1"], "--num-daemons"),
        (["--prefill", "-1", "--decode", "1"], "--prefill"),
        (["--prefill", "1", "--decode", "-2"], "--decode"),
        (["--port", "70000"], "--port"),
        (["--port", "-5"], "--port"),
        (["--kv-cache-memory-mb", "0"], "--kv-cache-memory-mb"),
        (["--bench", "--bench-requests", "0"], "--bench-requests"),
    ],
)
def test_bad_counts_and_ports_are_usage_errors(args: list[str], flag: str) -> None:
    result = CliRunner().invoke(command, ["--model", "tiny", *args])
    assert result.exit_code == 2, result.output
    assert flag in result.output and "Traceback" not in result.output
    assert "starting Redis" not in result.output


def test_a_log_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    result = CliRunner().invoke(command, ["--model", "tiny", "--log-dir", str(not_a_dir)])
    assert result.exit_code == 2, result.output
    assert "--log-dir" in result.output and "Traceback" not in result.output
    assert "starting Redis" not in result.output


# Without the refusal, `up` started and served until interrupted: the timeout ends that.
@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [["--plot", "plots"], ["--bench-requests", "8"]])
def test_bench_options_without_bench_are_refused(args: list[str]) -> None:
    """`up --plot DIR` (or --bench-requests) without --bench started a fleet and never wrote
    a plot: the user waited for files that could not come. Refused, naming --bench."""
    result = CliRunner().invoke(command, ["--model", "tiny", "--port", "0", *args])
    assert result.exit_code == 2, result.output
    assert "--bench" in result.output and args[0] in result.output
    assert "starting Redis" not in result.output


def test_every_up_option_says_what_it_does() -> None:
    """`pagefleet up --help` listed -n, --served-model-name, --policy and --bench-requests
    with no word on what they do (--served-model-name: nothing on its default)."""
    ctx = click.Context(command)
    bare = [
        p.opts[-1] for p in command.get_params(ctx) if isinstance(p, click.Option) and not p.help
    ]
    assert bare == []
    help_text = " ".join(CliRunner().invoke(command, ["--help"]).output.split())
    assert "a .gguf file's stem" in help_text
