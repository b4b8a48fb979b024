"""Command-line surfaces: flag validation and the bench report's arithmetic."""

from __future__ import annotations

import math

from click.testing import CliRunner

from pagefleet.cli import cli
from pagefleet.dev.loadgen import RequestResult, summarize, trim
from pagefleet.dev.workload import (
    WorkloadSpec,
    build_conversations,
    ideal_hit_rate,
    single_prompt_trace,
)
from pagefleet.gateway.cli import GatewayConfig


def test_gateway_flags_are_validated_with_actionable_messages() -> None:
    runner = CliRunner()
    r = runner.invoke(cli, ["gateway", "--discovery", "static"])
    assert r.exit_code != 0 and "--endpoints" in r.output
    r = runner.invoke(cli, ["gateway", "--discovery", "k8s"])
    assert r.exit_code != 0 and "--service" in r.output
    r = runner.invoke(cli, ["gateway", "--endpoints", "127.0.0.1:1", "--weights", "speed=3"])
    assert r.exit_code != 0 and "unknown weight 'speed'" in r.output
    r = runner.invoke(cli, ["gateway", "--policy", "random"])
    assert r.exit_code != 0 and "cache_aware" in r.output


def test_gateway_namespace_defaults_to_the_served_model_name_like_the_daemon() -> None:
    c = GatewayConfig(endpoints=["127.0.0.1:1"], model="tiny", served_model_name="llama")
    assert c.namespace_key == "llama"
    c = GatewayConfig(endpoints=["127.0.0.1:1"], model="tiny", kv_namespace="svc-a")
    assert c.namespace_key == "svc-a"
    assert GatewayConfig(discovery="k8s", service="s", target_port="8000").target_port_value == 8000


def test_workload_is_seeded_and_turns_grow() -> None:
    spec = WorkloadSpec(num_conversations=20, num_tenants=4, max_turns=3, seed=7)
    a, b = build_conversations(spec), build_conversations(spec)
    assert [t.messages for c in a for t in c.turns] == [t.messages for c in b for t in c.turns]
    assert build_conversations(WorkloadSpec(num_conversations=20, seed=8)) != a
    for c in a:
        for prev, nxt in zip(c.turns, c.turns[1:], strict=False):
            assert nxt.messages[: len(prev.messages)] == prev.messages
    assert sum(len(c.turns) for c in trim(a, 11)) == 11
    salted = build_conversations(
        WorkloadSpec(num_conversations=20, num_tenants=4, max_turns=3, seed=7, salt="x ")
    )
    assert salted[0].turns[0].messages[0][1] == "x " + a[0].turns[0].messages[0][1]
    single = single_prompt_trace(5)
    assert len({c.turns[0].messages for c in single}) == 1


def test_ideal_hit_rate_counts_whole_blocks_of_repeated_prefixes() -> None:
    p = list(range(64))  # 4 blocks of 16
    q = list(range(48)) + [999] * 16  # shares 3 blocks with p
    # p: miss; p again: 4 blocks cached but the last token is recomputed -> 63; q: 48.
    assert math.isclose(ideal_hit_rate([p, p, q], 16), (0 + 63 + 48) / 192)


def test_summary_percentiles_goodput_and_shares() -> None:
    rs = [
        RequestResult(
            0,
            0,
            0,
            True,
            pod="a",
            ttft=0.1,
            e2e=0.4,
            itls=[0.1, 0.1, 0.1],
            prompt_tokens=100,
            cached_tokens=50,
            completion_tokens=4,
        ),
        RequestResult(
            1,
            0,
            0,
            True,
            pod="b",
            ttft=0.9,
            e2e=1.2,
            itls=[0.1, 0.1, 0.1],
            prompt_tokens=100,
            cached_tokens=0,
            completion_tokens=4,
        ),
        RequestResult(2, 0, 0, False, error="boom"),
    ]
    r = summarize(rs, wall_s=2.0, slo_ttft_ms=500, slo_tpot_ms=200)
    assert r["failed"] == 1 and r["requests"] == 3
    assert r["prefix_hit_rate"] == 0.25
    assert r["pod_share"] == {"a": 0.5, "b": 0.5}
    assert r["goodput_req_s"] == 0.5  # only the first meets TTFT <= 500 ms
    assert r["ttft_ms_p50"] == 500.0 and r["tpot_ms_p50"] == 100.0
    assert r["errors"] == ["boom"]


def test_a_gateway_whose_port_is_taken_says_so_in_one_line() -> None:
    # A traceback ending in "[Errno 98] error while attempting to bind on address", then
    # "Unclosed client session" from the upstream session, was the message.
    import socket
    import subprocess
    import sys

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        argv = [sys.executable, "-m", "pagefleet.cli", "gateway", "--host", "127.0.0.1",
                "--port", str(port), "--endpoints", "127.0.0.1:1", "--model", "tiny"]  # fmt: skip
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1] == (
        f"Error: cannot listen on 127.0.0.1:{port}: Address already in use; another process "
        "holds the port (a second daemon or gateway?): stop it or choose another --port"
    ), r.stderr
    assert "Traceback" not in r.stderr and "Unclosed" not in r.stderr, r.stderr


def test_the_gateways_default_length_of_a_yarn_checkpoint_is_the_engines(tmp_path) -> None:
    # The engine serves original_max_position_embeddings x factor for YaRN (as vLLM); the
    # gateway read max_position_embeddings alone and refused prompts the daemons serve.
    import json

    from pagefleet.engine.model_config import ModelConfig
    from pagefleet.gateway.cli import checkpoint_max_len

    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
           "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 64}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = ModelConfig.from_dict(cfg).max_exact_len
    assert engine == 256
    assert checkpoint_max_len(tmp_path) == engine
