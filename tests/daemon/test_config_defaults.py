"""The daemon's chunked-prefill default, and that every way of starting one agrees on it."""

from __future__ import annotations

from click.testing import CliRunner

from pagefleet.api.inferenceservice import EngineSpec
from pagefleet.daemon.cli import command
from pagefleet.daemon.config import DEFAULT_LONG_PREFILL_TOKENS, DaemonConfig


def test_daemon_chunks_long_prefills_by_default() -> None:
    # A daemon started with no flag, the CLI's help and an InferenceService's pods (the
    # operator passes the CRD's value) all cap one request's prefill per step alike.
    assert DEFAULT_LONG_PREFILL_TOKENS > 0
    cfg = DaemonConfig()
    assert cfg.long_prefill_token_threshold == DEFAULT_LONG_PREFILL_TOKENS
    eng = cfg.engine_config()
    assert eng.enable_chunked_prefill
    assert eng.long_prefill_token_threshold == DEFAULT_LONG_PREFILL_TOKENS
    assert EngineSpec().long_prefill_token_threshold == DEFAULT_LONG_PREFILL_TOKENS
    help_text = CliRunner().invoke(command, ["--help"], terminal_width=200).output
    assert (
        f"[default: {DEFAULT_LONG_PREFILL_TOKENS}]"
        in help_text.split("--long-prefill-token-threshold")[1].split("--")[0]
    )
    # 0 still turns it off (one-step prefills up to the step budget).
    assert (
        DaemonConfig(long_prefill_token_threshold=0).engine_config().long_prefill_token_threshold
        == 0
    )
