"""Specs the schema accepts must turn into children the API server accepts too (and specs
that cannot must be refused up front, with a message that says what to change)."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
from fake_kube import REDIS
from pydantic import ValidationError

from pagefleet.api.inferenceservice import RESERVED_ENV_NAMES, RouterSpec, parse_spec
from pagefleet.operator.builders import (
    ADMIN_TOKEN_ENV,
    API_KEYS_ENV,
    BuildSettings,
    Owner,
    build_children,
)
from pagefleet.kvindex.redis_auth import USERNAME_ENV
from pagefleet.operator.hardening import cache_env

OWNER = Owner(name="llama", namespace="ml", uid="uid-1")

BASE: dict[str, Any] = {
    "model": {"source": {"path": "tiny"}},
    "roles": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
    "index": {"redisURL": REDIS},
}


def _spec(**over: Any) -> dict[str, Any]:
    spec = copy.deepcopy(BASE)
    spec.update(over)
    return spec


def _containers(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for obj in build_children(parse_spec(spec), OWNER, BuildSettings()):
        if obj["kind"] == "Deployment":
            (container,) = obj["spec"]["template"]["spec"]["containers"]
            out[obj["metadata"]["name"]] = container
    return out


def _repeated(values: list[str]) -> list[str]:
    return sorted(v for v, n in Counter(values).items() if n > 1)


# ---------------------------------------------------------------------------------- env


@pytest.mark.parametrize("name", [e["name"] for e in cache_env()])
def test_user_env_overrides_an_operator_default_in_place(name):
    roles = {"prefill": {"env": [{"name": name, "value": "/data/x"}]}, "decode": {}}
    spec = _spec(roles=roles, router={"env": [{"name": name, "value": "/gw"}]})
    containers = _containers(spec)
    for deploy, c in containers.items():
        names = [e["name"] for e in c["env"]]
        assert _repeated(names) == [], deploy
    default = next(e["value"] for e in cache_env() if e["name"] == name)
    values = {d: {e["name"]: e.get("value") for e in c["env"]} for d, c in containers.items()}
    assert values["llama-prefill"][name] == "/data/x"
    assert values["llama-decode"][name] == default
    assert values["llama-gateway"][name] == "/gw"


@pytest.mark.parametrize("name", RESERVED_ENV_NAMES)
def test_env_the_operator_owns_is_refused(name):
    with pytest.raises(ValidationError, match="are set by the operator"):
        parse_spec(_spec(router={"env": [{"name": name, "value": "x"}]}))


def test_a_name_twice_in_env_is_refused():
    env = [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]
    with pytest.raises(ValidationError, match=r"may appear only once \(repeated: A\)"):
        parse_spec(_spec(roles={"unified": {"env": env}}))


def test_reserved_env_names_cover_what_the_operator_sets_from_identity_and_secrets():
    spec = _spec(
        index={"redisURL": REDIS, "username": "u", "passwordSecretRef": {"name": "r"}},
        router={"apiKeysSecret": {"name": "k"}},
        adminTokenSecret={"name": "a"},
    )
    owned = {API_KEYS_ENV, ADMIN_TOKEN_ENV}
    for c in _containers(spec).values():
        owned |= {e["name"] for e in c["env"] if "valueFrom" in e or e["name"] == USERNAME_ENV}
    assert owned <= set(RESERVED_ENV_NAMES)


def test_env_cel_rules_match_the_pydantic_validator():
    rules = RouterSpec.model_json_schema()["properties"]["env"]["x-kubernetes-validations"]
    assert [r["message"] for r in rules][0] == "env: each variable name may appear only once"
    assert any("are set by the operator" in r["message"] for r in rules)
