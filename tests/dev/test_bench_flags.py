"""`pagefleet bench` refuses out-of-range flags as usage errors naming the flag, before it
sends a request (not a pydantic traceback)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pagefleet.dev.loadgen import command


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["-n", "0"], "--num-requests"),
        (["-c", "0"], "--concurrency"),
        (["--max-tokens", "-1"], "--max-tokens"),
        (["--request-rate", "0"], "--request-rate"),
        (["--replicas", "0"], "--replicas"),
    ],
)
def test_out_of_range_flags_are_usage_errors(args: list[str], flag: str) -> None:
    # Port 9 (discard): nothing is ever sent, the flags are refused first.
    result = CliRunner().invoke(command, ["--url", "http://127.0.0.1:9", "--no-progress", *args])
    assert result.exit_code == 2, result.output
    assert flag in result.output


def test_model_help_points_at_the_served_name() -> None:
    """--model's help said `pagefleet up` serves its --model under that name: wrong for a
    .gguf path (served under its stem). It points at /v1/models, which is always right."""
    help_text = " ".join(CliRunner().invoke(command, ["--help"]).output.split())
    model_help = help_text.split("--model TEXT")[1].split("-n, --num-requests")[0]
    assert "/v1/models" in model_help, model_help


def test_without_model_an_unreachable_url_names_the_way_out() -> None:
    """Without --model the bench asks --url for its model first; when nothing answers, the
    error names the URL and --model (not 48 identical connection errors)."""
    result = CliRunner().invoke(command, ["--url", "http://127.0.0.1:9", "--no-progress"])
    assert result.exit_code == 1, result.output
    assert "http://127.0.0.1:9/v1/models" in result.output and "--model" in result.output
