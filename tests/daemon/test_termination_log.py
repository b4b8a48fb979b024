"""A fatal start-up error leaves its one-line cause where Kubernetes reads it."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from pagefleet.daemon.cli import command
from pagefleet.daemon.termination import one_line, write_termination_message


def test_cli_writes_the_cause_of_a_missing_model(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.touch()  # the kubelet creates the file; the daemon only fills it
    res = CliRunner().invoke(
        command,
        ["--model", str(tmp_path / "nope"), "--port", "0"],
        env={"PAGEFLEET_TERMINATION_LOG": str(log)},
    )
    assert res.exit_code != 0
    text = log.read_text()
    assert text.count("\n") == 1, text
    assert text.startswith("the engine failed to start: model ")
    assert str(tmp_path / "nope") in text and "neither a checkpoint directory" in text


def test_default_path_is_never_created_and_errors_are_ignored(tmp_path: Path) -> None:
    assert not Path("/dev/termination-log").exists()
    assert write_termination_message("boom") is False  # default path: only if it exists
    assert not Path("/dev/termination-log").exists()
    assert write_termination_message("boom", str(tmp_path / "no-dir" / "f")) is False
    explicit = tmp_path / "f"
    assert write_termination_message("line one\n  line two\ttab", str(explicit)) is True
    assert explicit.read_text() == "line one line two tab\n"
    assert len(one_line("é" * 5000).encode()) <= 1024
