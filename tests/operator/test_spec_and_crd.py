"""The pydantic spec, the generated CRD, and the committed crds/ file."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from pydantic import ValidationError

from pagefleet.api.crd import CRD_FILENAME, build_crd, command, render_crd
from pagefleet.api.inferenceservice import (
    AutoscalingSpec,
    ModelSource,
    RoleSpec,
    RolesSpec,
    parse_spec,
)

ROOT = Path(__file__).resolve().parents[2]


def _schema() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node: Any, path: str = ""):
    if isinstance(node, dict):
        yield path, node
        for key, sub in node.get("properties", {}).items():
            yield from _walk(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            yield from _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_committed_crd_matches_the_generator():
    committed = (ROOT / "crds" / CRD_FILENAME).read_text()
    assert committed == render_crd(), (
        "crds/ drifted from pagefleet/api/inferenceservice.py; regenerate with "
        f"`pagefleet crd -o crds/{CRD_FILENAME}`"
    )


def test_helm_chart_ships_the_same_crd():
    chart_crd = ROOT / "helm" / "pagefleet" / "crds" / CRD_FILENAME
    assert chart_crd.read_text() == render_crd()


def test_cli_prints_the_crd():
    result = CliRunner().invoke(command, [])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.output)["metadata"]["name"] == "inferenceservices.pagefleet.io"


def test_crd_identity_and_subresources():
    crd = build_crd()
    spec = crd["spec"]
    assert spec["group"] == "pagefleet.io" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "InferenceService"
    assert "infsvc" in spec["names"]["shortNames"] and "isvc" not in spec["names"]["shortNames"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["storage"] and version["served"]
    assert version["subresources"] == {"status": {}}
    cols = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert cols["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert {"Roles", "Replicas", "URL", "Age"} <= cols.keys()


def test_schema_is_structural_and_every_field_is_described():
    forbidden = {"$ref", "anyOf", "oneOf", "allOf", "nullable", "title", "$defs"}
    for path, node in _walk(_schema()):
        assert not forbidden & node.keys(), (path, forbidden & node.keys())
        if path == ".metadata":
            assert node == {"type": "object"}  # the API server refuses anything more
            continue
        if path and path.count(".") and not path.endswith("{}") and not path.endswith("[]"):
            assert node.get("description"), f"{path} has no description (kubectl explain)"
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node
        elif not node.get("x-kubernetes-preserve-unknown-fields"):  # quantities: any JSON
            assert "type" in node, path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True  # OpenAPI v3.0 form
        for bound in ("minimum", "maximum"):  # numbers (an Optional field once got `true`)
            assert not isinstance(node.get(bound, 0), bool), (path, bound)
        assert node.get("additionalProperties") is not False


def test_resource_quantities_take_numbers_as_a_pods_do():
    # `cpu: 0.5` is what a Pod takes; the CRD's int-or-string refused it on the API server.
    role = {"replicas": 1, "resources": {"requests": {"cpu": 0.5, "memory": "1Gi"},
                                         "limits": {"cpu": 2}}}  # fmt: skip
    spec = parse_spec({"model": {"source": {"path": "tiny"}}, "roles": {"unified": role}})
    assert spec.roles.unified is not None
    assert spec.roles.unified.resources.requests == {"cpu": 0.5, "memory": "1Gi"}
    nodes = dict(_walk(_schema()))
    leaf = nodes[".spec.roles.unified.resources.requests{}"]
    assert leaf == {"x-kubernetes-preserve-unknown-fields": True}
    for bad in (float("nan"), float("inf"), [1], {"a": 1}):
        role = {"resources": {"requests": {"cpu": bad}}}
        with pytest.raises(ValidationError):
            parse_spec({"model": {"source": {"path": "tiny"}}, "roles": {"unified": role}})


def test_defaults_reach_nested_fields():
    props = _schema()["properties"]["spec"]["properties"]
    assert props["engine"]["default"] == {}
    assert props["engine"]["properties"]["blockSize"]["default"] == 16
    assert props["roles"]["default"] == {"unified": {}}
    assert props["router"]["properties"]["policy"]["default"] == "cache_aware"


@pytest.mark.parametrize(
    ("model", "path"),
    [
        (ModelSource, ".spec.model.source"),
        (RoleSpec, ".spec.roles.unified"),
        (AutoscalingSpec, ".spec.roles.decode.autoscaling"),
        (RolesSpec, ".spec.roles"),
    ],
)
def test_cel_rules_match_the_pydantic_validators(model, path):
    nodes = dict(_walk(_schema()))
    rules = nodes[path]["x-kubernetes-validations"]
    expected = model.model_json_schema()["x-kubernetes-validations"]
    assert rules == expected and rules


def test_minimal_spec_gets_defaults():
    spec = parse_spec({"model": {"source": {"path": "tiny"}}})
    assert [r for r, _ in spec.roles.items()] == ["unified"]
    assert spec.engine.block_size == 16 and spec.engine.enable_prefix_caching
    assert spec.command == ["pagefleet"]
    assert spec.router.policy.value == "cache_aware"


BASE = {"model": {"source": {"path": "tiny"}}}


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (
            {"roles": {"unified": {"replicas": 1, "autoscaling": {"maxReplicas": 3}}}},
            "either replicas or autoscaling, not both",
        ),
        (
            {"roles": {"unified": {"autoscaling": {"minReplicas": 4, "maxReplicas": 3}}}},
            "minReplicas must not exceed",
        ),
        ({"roles": {"prefill": {}}}, "prefill and decode must be set together"),
        (
            {"roles": {"unified": {}, "prefill": {}, "decode": {}}},
            "either unified, or prefill and decode",
        ),
        ({"roles": {}}, "either unified, or prefill and decode"),
        (
            {
                "model": {
                    "source": {
                        "path": "/x",
                        "hostPath": "/data",
                        "persistentVolumeClaim": {"claimName": "w"},
                    }
                }
            },
            "at most one of persistentVolumeClaim and hostPath",
        ),
        ({"model": {"source": {"path": "/data/m", "hostPath": "/d"}}}, "must lie under"),
        ({"index": {"redisURL": "http://x"}}, "should match pattern"),
        ({"engine": {"blockSize": 0}}, "greater than or equal to 1"),
        ({"engine": {"blokSize": 8}}, "Extra inputs are not permitted"),
    ],
)
def test_invalid_specs_are_rejected_with_a_clear_message(patch, message):
    spec = copy.deepcopy(BASE)
    spec.update(patch)
    with pytest.raises(ValidationError, match=message):
        parse_spec(spec)


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    services = [d for d in docs if d.get("kind") == "InferenceService"]
    assert services, f"{path.name} holds no InferenceService"
    for doc in services:
        assert doc["apiVersion"] == "pagefleet.io/v1alpha1"
        parse_spec(doc["spec"])


def test_an_omitted_slo_stays_unset_and_an_empty_one_takes_the_defaults():
    # The API server fills a missing field's default, then the defaults inside it: a default
    # on spec.slo would make every stored object have an SLO, and SLOMissing unreachable.
    slo = _schema()["properties"]["spec"]["properties"]["slo"]
    assert "default" not in slo
    assert slo["properties"]["ttftMs"]["default"] == 2000
    assert parse_spec(BASE).slo is None
    targets = parse_spec({**BASE, "slo": {}}).slo
    assert targets is not None and (targets.ttft_ms, targets.tpot_ms) == (2000, 100)
