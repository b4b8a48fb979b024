"""The fleet's P/D transfer secret reaches every daemon and the gateway of a service."""

from __future__ import annotations

from pagefleet.api.inferenceservice import parse_spec
from pagefleet.httpauth import ENV_KV_SECRET
from pagefleet.operator.builders import BuildSettings, Owner, build_children


def test_every_daemon_and_the_gateway_read_one_kv_transfer_secret(pd_spec) -> None:
    objs = build_children(parse_spec(pd_spec), Owner("llama", "ml", "uid-1"), BuildSettings())
    refs = {}
    for o in objs:
        if o["kind"] != "Deployment":
            continue
        (c,) = o["spec"]["template"]["spec"]["containers"]
        refs[o["metadata"]["name"]] = next(
            e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == ENV_KV_SECRET
        )
    assert sorted(refs) == ["llama-decode", "llama-gateway", "llama-prefill"]
    # One Secret per service (the operator makes it); optional: a pod started before it
    # exists runs unsigned, as before, and says so in its log.
    want = {"name": "llama-kv-transfer", "key": "secret", "optional": True}
    assert all(ref == want for ref in refs.values()), refs
