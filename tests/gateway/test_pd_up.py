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


def test_each_fleet_gives_its_daemons_and_gateway_one_secret_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemons of a `pagefleet up` fleet, reached directly on their ports, pulled KV
    from any host a request named: each fleet now shares a P/D secret of its own between
    its daemons and its gateway (in their environment, never on a command line)."""
    from pagefleet.httpauth import ENV_KV_SECRET, ENV_KV_SECRET_FILE

    monkeypatch.delenv(ENV_KV_SECRET, raising=False)
    monkeypatch.delenv(ENV_KV_SECRET_FILE, raising=False)
    monkeypatch.setattr(Child, "start", lambda self: None)
    secrets = []
    for _ in range(2):
        fleet = LocalFleet(
            FleetSpec(num_prefill=1, num_decode=1, use_redis=False, log_dir=tmp_path)
        )
        children = [fleet._daemon(0, "prefill"), fleet._daemon(0, "decode")]
        fleet.daemons = children
        children.append(fleet.spawn_gateway())
        got = {c.env.get(ENV_KV_SECRET) for c in children}
        assert len(got) == 1 and None not in got, got
        secret = got.pop()
        assert len(secret) >= 32
        assert all(secret not in " ".join(c.argv) for c in children)
        secrets.append(secret)
    assert secrets[0] != secrets[1]
    # A secret the caller's environment names is the one the children inherit.
    monkeypatch.setenv(ENV_KV_SECRET, "chosen")
    fleet = LocalFleet(FleetSpec(num_prefill=1, num_decode=1, use_redis=False, log_dir=tmp_path))
    assert ENV_KV_SECRET not in fleet._daemon(0, "decode").env
