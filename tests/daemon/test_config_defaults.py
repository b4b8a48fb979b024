"""The daemon's defaults (chunked prefill, the served model name), and that every way of
starting a fleet agrees on them."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from pagefleet.api.inferenceservice import EngineSpec
from pagefleet.daemon.cli import command
from pagefleet.daemon.config import DEFAULT_LONG_PREFILL_TOKENS, DaemonConfig
from pagefleet.dev.local_fleet import FleetSpec, LocalFleet
from pagefleet.gateway.cli import GatewayConfig


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


GGUF = "/srv/models/Qwen2.5-0.5B-Instruct.Q4_K_M.gguf"


@pytest.mark.parametrize(
    ("model", "served"),
    [
        # A GGUF file: its stem, not a path of the server's disk for clients to send.
        (GGUF, "Qwen2.5-0.5B-Instruct.Q4_K_M"),
        ("models/model.gguf", "model"),
        # A preset, and a checkpoint directory (its path, as vLLM serves one), as given.
        ("smollm2-135m", "smollm2-135m"),
        ("/srv/models/Qwen2.5-0.5B-Instruct", "/srv/models/Qwen2.5-0.5B-Instruct"),
    ],
)
def test_daemon_gateway_and_up_serve_a_model_under_one_default_name(
    model: str, served: str, tmp_path: Path
) -> None:
    """`--model /dir/model.gguf` was served as "/dir/model.gguf" (every client had to send
    the path). The daemon, the gateway and `pagefleet up` agree on the stem, and on the
    block-key namespace that follows the served name."""
    daemon = DaemonConfig(model=model)
    gateway = GatewayConfig(model=model, endpoints=["http://127.0.0.1:1"])
    fleet = LocalFleet(FleetSpec(model=model, log_dir=tmp_path))
    assert daemon.model_name == gateway.model_name == fleet.served_model_name == served
    assert daemon.namespace == gateway.namespace_key == fleet.namespace == served


def test_served_model_name_overrides_the_gguf_stem(tmp_path: Path) -> None:
    assert DaemonConfig(model=GGUF, served_model_name="qwen").model_name == "qwen"
    gateway = GatewayConfig(model=GGUF, served_model_name="qwen", endpoints=["http://a:1"])
    assert gateway.model_name == "qwen"
    spec = FleetSpec(model=GGUF, served_model_name="qwen", log_dir=tmp_path)
    assert LocalFleet(spec).served_model_name == "qwen"
