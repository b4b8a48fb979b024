"""`pagefleet up --prefill N --decode M`: the fleet it builds (argv only, nothing started)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from pagefleet.dev.local_fleet import Child, FleetSpec, LocalFleet, command


def test_pd_fleet_has_both_roles_and_the_gateway_gets_both_pools(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = FleetSpec(num_prefill=1, num_decode=2, use_redis=False, log_dir=tmp_path)
    fleet = LocalFleet(spec)
    fleet.daemons = [fleet._daemon(0, "prefill"), fleet._daemon(0, "decode"),
                     fleet._daemon(1, "decode")]  # fmt: skip
    roles = [d.argv[d.argv.index("--role") + 1] for d in fleet.daemons]
    assert roles == ["prefill", "decode", "decode"]
    assert fleet.role_urls("prefill") == [fleet.daemons[0].url]
    assert fleet.role_urls("decode") == [d.url for d in fleet.daemons[1:]]
    started: list[Child] = []
    monkeypatch.setattr(Child, "start", lambda self: started.append(self))
    gw = fleet.spawn_gateway()
    assert started == [gw]
    argv = gw.argv
    assert argv[argv.index("--prefill-url") + 1] == fleet.daemons[0].url
    assert argv[argv.index("--endpoints") + 1] == ",".join(d.url for d in fleet.daemons[1:])
    # A unified fleet is unchanged: no role flag, no prefill pool.
    uni = LocalFleet(FleetSpec(num_daemons=2, use_redis=False, log_dir=tmp_path))
    uni.daemons = [uni._daemon(0), uni._daemon(1)]
    assert all("--role" not in d.argv for d in uni.daemons)
    assert uni.role_urls("prefill") == []


def test_up_wants_prefill_and_decode_together() -> None:
    result = CliRunner().invoke(command, ["--prefill", "1"])
    assert result.exit_code == 2
    assert "--prefill and --decode go together" in result.output
