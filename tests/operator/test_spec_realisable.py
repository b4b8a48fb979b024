"""Specs the schema accepts must turn into children the API server accepts too (and specs
that cannot must be refused up front, with a message that says what to change)."""

from __future__ import annotations

import copy
import re
from collections import Counter
from typing import Any

import pytest
from fake_kube import REDIS
from pydantic import ValidationError

from pagefleet.api.crd import build_crd
from pagefleet.api.inferenceservice import (
    MAX_NAME_LENGTH,
    MOUNT_PATH_FREE,
    MOUNT_PATH_PLAIN,
    NAME_RULE,
    RESERVED_ENV_NAMES,
    RESERVED_MOUNT_PATHS,
    TOLERATION_RULES,
    ModelSource,
    RouterSpec,
    Toleration,
    name_problem,
    parse_spec,
)
from pagefleet.kvindex.redis_auth import USERNAME_ENV
from pagefleet.operator.builders import (
    ADMIN_TOKEN_ENV,
    API_KEYS_ENV,
    BuildSettings,
    Owner,
    build_children,
)
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
    assert rules[0]["message"] == "env: each variable name may appear only once"
    assert any("are set by the operator" in r["message"] for r in rules)


# ---------------------------------------------------------------------------- mounts


def _model_on_volume(mount: str) -> dict[str, Any]:
    source = {"path": f"{mount}/m", "mountPath": mount, "persistentVolumeClaim": {"claimName": "w"}}
    return _spec(model={"source": source})


@pytest.mark.parametrize("mount", [*RESERVED_MOUNT_PATHS, "/var/cache", "/etc", "/tmp/models", "/"])
def test_model_mount_on_or_around_an_operator_mount_is_refused(mount):
    with pytest.raises(ValidationError, match=r"must not be, contain or lie under|without empty"):
        parse_spec(_model_on_volume(mount))


@pytest.mark.parametrize("mount", ["/tmp/", "//models", "/models/../tmp", "/models/."])
def test_model_mount_path_must_be_plain(mount):
    with pytest.raises(ValidationError, match=r"without empty, '\.' or '\.\.' segments"):
        parse_spec(_model_on_volume(mount))


@pytest.mark.parametrize("mount", ["/models", "/var/cache-models", "/mnt/.weights", "/tmpfs"])
def test_model_mount_elsewhere_is_accepted(mount):
    for deploy, c in _containers(_model_on_volume(mount)).items():
        assert mount in [m["mountPath"] for m in c["volumeMounts"]], deploy


def test_reserved_mount_paths_cover_every_operator_mount():
    containers = _containers(_model_on_volume("/models"))
    mounts = {m["mountPath"] for c in containers.values() for m in c["volumeMounts"]}
    assert mounts - {"/models"} == set(RESERVED_MOUNT_PATHS)


def test_mount_cel_rules_are_the_pydantic_ones():
    rules = ModelSource.model_json_schema()["x-kubernetes-validations"]
    assert [MOUNT_PATH_PLAIN.as_schema(), MOUNT_PATH_FREE.as_schema()] == rules[-2:]
    assert "\\" not in MOUNT_PATH_PLAIN.rule  # a CEL string literal takes no regex escapes


# ----------------------------------------------------------------------------- names

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@pytest.mark.parametrize("roles", [BASE["roles"], {"unified": {}}], ids=["pd", "unified"])
def test_the_longest_allowed_name_gives_valid_child_names_and_labels(roles):
    name = "n" * MAX_NAME_LENGTH
    assert name_problem(name) is None
    owner = Owner(name=name, namespace="ml", uid="u")
    for obj in build_children(parse_spec(_spec(roles=roles)), owner, BuildSettings()):
        meta = obj["metadata"]
        assert len(meta["name"]) <= 63 and _DNS1035.match(meta["name"]), meta["name"]
        for value in meta["labels"].values():
            assert len(value) <= 63 and _LABEL_VALUE.match(value), (obj["kind"], value)


@pytest.mark.parametrize("name", ["llama.v3", "n" * (MAX_NAME_LENGTH + 1), "7b", "a-", "A"])
def test_names_children_cannot_carry_are_named_by_the_rule(name):
    assert name_problem(name) == f"{NAME_RULE.message} (got {name!r}, {len(name)} characters)"


def test_the_crd_checks_the_name_at_its_root():
    root = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert root["x-kubernetes-validations"] == [NAME_RULE.as_schema()]


def test_the_name_rule_judges_creation_only():
    # A root rule is not ratcheted: were it evaluated on updates, an object stored before
    # the rule existed could never lose its finalizer (e2e/test_operator_lifecycle.py).
    (rule,) = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
        "x-kubernetes-validations"
    ]
    assert rule["optionalOldSelf"] is True  # evaluated on create, oldSelf empty there
    assert rule["rule"].startswith("oldSelf.hasValue() || (")


# ------------------------------------------------------------------ path, tolerations


@pytest.mark.parametrize(
    ("path", "ok"),
    [("/models/llama", True), ("/models", True), ("/models-old/llama", False), ("/mod", False)],
)
def test_the_model_path_must_lie_inside_the_mounted_volume(path, ok):
    source = {"path": path, "mountPath": "/models", "persistentVolumeClaim": {"claimName": "w"}}
    if ok:
        parse_spec(_spec(model={"source": source}))
    else:
        with pytest.raises(ValidationError, match=r"must lie under model\.source\.mountPath"):
            parse_spec(_spec(model={"source": source}))


@pytest.mark.parametrize(
    ("toleration", "message"),
    [
        ({"key": "gpu", "operator": "Exists", "value": "yes"}, "value must be empty when"),
        ({"key": "gpu", "value": "yes", "tolerationSeconds": 30}, "only to effect NoExecute"),
        (
            {"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 30},
            "only to effect NoExecute",
        ),
        ({"operator": "Equal", "value": "yes"}, "an empty key needs operator Exists"),
        ({"key": "", "value": "yes"}, "an empty key needs operator Exists"),
    ],
)
def test_tolerations_the_api_server_refuses_are_refused_by_the_spec(toleration, message):
    with pytest.raises(ValidationError, match=message):
        parse_spec(_spec(roles={"unified": {"tolerations": [toleration]}}))


@pytest.mark.parametrize(
    "toleration",
    [
        {"operator": "Exists"},
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "gpu", "value": "a100"},
        {"key": "gpu", "operator": "Equal", "effect": "NoExecute", "tolerationSeconds": 60},
    ],
)
def test_valid_tolerations_reach_the_pods(toleration):
    spec = _spec(roles={"unified": {"tolerations": [toleration]}})
    (deploy,) = [
        o
        for o in build_children(parse_spec(spec), OWNER, BuildSettings())
        if o["metadata"]["name"] == "llama-unified" and o["kind"] == "Deployment"
    ]
    assert deploy["spec"]["template"]["spec"]["tolerations"] == [toleration]


def test_toleration_and_model_source_cel_rules_are_the_pydantic_ones():
    rules = Toleration.model_json_schema()["x-kubernetes-validations"]
    assert rules == [r.as_schema() for r in TOLERATION_RULES]
    source_rules = [r["rule"] for r in ModelSource.model_json_schema()["x-kubernetes-validations"]]
    assert any("self.path.startsWith(self.mountPath + '/')" in r for r in source_rules)
