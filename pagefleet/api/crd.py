"""Generate the InferenceService CRD from the pydantic models (``pagefleet crd``).

Pydantic emits JSON Schema (draft 2020-12); the API server wants a *structural* OpenAPI
v3.0 schema. The conversion therefore inlines every ``$ref``, turns ``Optional[X]``
(``anyOf: [X, null]``) into plain ``X`` (absent means unset, and the operator never writes
nulls), rewrites numeric ``exclusiveMinimum: n`` into the v3.0 boolean form, drops titles
and ``additionalProperties: false`` (pruning already rejects unknown fields), and keeps
descriptions, defaults, enums, bounds and the CEL rules. The committed ``crds/`` file is
this module's output; a unit test fails when they differ.
"""

from __future__ import annotations

from typing import Any

import click
import yaml
from pydantic.json_schema import GenerateJsonSchema

from pagefleet.api.inferenceservice import (
    GROUP,
    KIND,
    NAME_RULE,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    InferenceServiceSpec,
    InferenceServiceStatus,
)

CRD_FILENAME = f"{PLURAL}.{GROUP}.yaml"

_PRINTER_COLUMNS: list[dict[str, Any]] = [
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
        "description": "Every role and the gateway have their desired pods ready.",
    },
    {
        "name": "Roles",
        "type": "string",
        "jsonPath": ".status.readyRoles",
        "description": "Ready roles over roles.",
    },
    {
        "name": "Replicas",
        "type": "string",
        "jsonPath": ".status.replicas",
        "description": "Ready/desired pods per role.",
    },
    {
        "name": "URL",
        "type": "string",
        "jsonPath": ".status.url",
        "description": "OpenAI-compatible base URL of the gateway.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


class _WithFactoryDefaults(GenerateJsonSchema):
    """Emit ``default`` for ``default_factory`` fields too.

    The API server applies nested defaults only when the parent object exists, so an
    omitted ``spec.engine`` must default to ``{}`` (or the factory's value) for
    ``spec.engine.blockSize`` to get its default.
    """

    def default_schema(self, schema: Any) -> Any:
        factory = schema.get("default_factory")
        if factory is not None and not schema.get("default_factory_takes_data"):
            value = factory()
            if hasattr(value, "model_dump"):
                value = value.model_dump(by_alias=True, exclude_defaults=True, mode="json")
            schema = {k: v for k, v in schema.items() if k != "default_factory"}
            schema["default"] = value
        return super().default_schema(schema)


def _strip_nones(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_nones(v) for v in value]
    return value


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Convert one pydantic JSON-schema node into a structural OpenAPI v3.0 node."""
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        # Field-level keys (description, default) win over the referenced model's.
        node = {**target, **node}
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        variants = [v for v in node.pop("anyOf") if v.get("type") != "null"]
        if len(variants) != 1:
            raise ValueError(f"cannot express a union in a structural schema: {variants}")
        node = {**_structural(variants[0], defs), **node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("title", "$defs"):
            continue
        if key == "additionalProperties" and value is False:
            continue
        if key == "description":
            # Attribute docstrings keep their line breaks; kubectl explain re-wraps anyway.
            out[key] = " ".join(str(value).split())
        elif key == "default":
            if value is None:
                continue
            out[key] = _strip_nones(value)
        elif key == "exclusiveMinimum" and not isinstance(value, bool):
            # (an Optional field's variant arrives here already converted: keep it)
            out["minimum"] = value
            out["exclusiveMinimum"] = True
        elif key == "properties":
            out[key] = {name: _structural(sub, defs) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = _structural(value, defs)
        else:
            out[key] = value
    if out.get("x-kubernetes-int-or-string"):
        out.pop("anyOf", None)
        out.pop("type", None)
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "properties" in out:
        out.setdefault("type", "object")
    # type and description first: the YAML reads like `kubectl explain`.
    head = {k: out[k] for k in ("type", "description") if k in out}
    return {**head, **{k: v for k, v in out.items() if k not in head}}


def model_openapi_schema(model: type) -> dict[str, Any]:
    """Structural OpenAPI v3.0 schema of a pydantic model (aliases, defaults, CEL)."""
    raw = model.model_json_schema(by_alias=True, schema_generator=_WithFactoryDefaults)
    defs = raw.pop("$defs", {})
    return _structural(raw, defs)


def build_crd() -> dict[str, Any]:
    """The complete CustomResourceDefinition object (apiextensions.k8s.io/v1)."""
    spec_schema = model_openapi_schema(InferenceServiceSpec)
    status_schema = model_openapi_schema(InferenceServiceStatus)
    status_schema = {
        "type": "object",
        "description": "Observed state, written by the operator.",
        **{k: v for k, v in status_schema.items() if k not in ("type", "description")},
    }
    root = {
        "type": "object",
        "description": (
            "An LLM served by pagefleet: daemon pods running the paged-KV engine (unified, "
            "or prefill + decode roles), a cache-aware gateway, and a Redis prefix index."
        ),
        "required": ["spec"],
        # Only the root may look at metadata.name (the children's names derive from it).
        "x-kubernetes-validations": [NAME_RULE.as_schema()],
        "properties": {
            "apiVersion": {"type": "string", "description": "API version of this object."},
            "kind": {"type": "string", "description": "Kind of this object."},
            # The API server forbids anything but `type` here (metadata is its own schema).
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/part-of": "pagefleet"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["pagefleet", "all"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": _PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


class _NoAliasDumper(yaml.SafeDumper):
    """Repeated sub-schemas (the three roles) are written out, never as YAML anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_crd() -> str:
    """The CRD as the YAML text committed under crds/ (stable key order)."""
    header = "# Generated by `pagefleet crd` from pagefleet/api/inferenceservice.py; do not edit.\n"
    return header + yaml.dump(build_crd(), Dumper=_NoAliasDumper, sort_keys=False, width=100)


@click.command("crd")
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Write to this file instead of stdout.",
)
def command(output: str | None) -> None:
    """Print the InferenceService CRD generated from the spec (pipe into kubectl apply -f -)."""
    text = render_crd()
    if output is None:
        click.echo(text, nl=False)
    else:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(text)
