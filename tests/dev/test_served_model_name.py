"""A GGUF file given by path is served under its stem, by a real fleet (`pagefleet up`'s
LocalFleet: Redis, a daemon and a gateway as processes), through the official client."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from pagefleet.dev.local_fleet import FleetSpec, LocalFleet
from pagefleet.presets.gguf_presets import gguf_preset_path

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_a_gguf_path_is_served_under_its_stem_by_daemon_and_gateway(tmp_path: Path) -> None:
    """`--model /some/dir/SmolLM2-135M-Instruct.Q4_1.gguf` was served as that whole path:
    /v1/models listed it and a client had to send it as its model name. Now both the
    daemon and the gateway serve the file's stem; the path is one name no client sees in
    /v1/models, so it is refused like any other (the 404 names the served model)."""
    preset = gguf_preset_path("smollm2-135m")
    assert preset is not None and preset.is_file()
    gguf = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.symlink_to(preset)
    stem = "SmolLM2-135M-Instruct.Q4_1"
    spec = FleetSpec(model=str(gguf), num_daemons=1, log_dir=tmp_path / "logs")
    with LocalFleet(spec) as fleet:
        gateway = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key="x", max_retries=0)
        daemon = openai.OpenAI(base_url=fleet.daemon_urls[0] + "/v1", api_key="x", max_retries=0)
        for client in (gateway, daemon):
            assert [m.id for m in client.models.list()] == [stem]
        reply = gateway.chat.completions.create(
            model=stem,
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=2,
            temperature=0,
        )
        assert reply.model == stem and reply.choices[0].message.content
        for client in (gateway, daemon):
            with pytest.raises(openai.NotFoundError, match=stem):
                client.completions.create(model=str(gguf), prompt="Hi", max_tokens=1)
