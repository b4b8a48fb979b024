"""What README.md, docs/ and examples/ tell a user to type or look for exists as written.

docs/benchmarks.md is a log of past sessions (its commands name the flags of their day) and
is left out. Checked here: every `pagefleet SUBCOMMAND --flag` the docs show takes that flag,
and a default stated as "`--flag` (30 s)" is the flag's;
every other `--flag` they name is some pagefleet command's or a known other tool's; every
repository path, CRD `spec.` path and `PAGEFLEET_*` variable they name exists; every metric
they name is exported by a real daemon, gateway or the operator's registry (the last test
scrapes a running P/D fleet).
"""

from __future__ import annotations

import importlib
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pagefleet.cli import SUBCOMMANDS, cli

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [
    ROOT / "README.md",
    *(ROOT / "docs" / f"{name}.md" for name in (
        "gateway", "operator", "real-model", "reliability", "metrics", "architecture",
        "internals",
    )),
    *sorted((ROOT / "examples").iterdir()),
]  # fmt: skip

# Flags the docs name that belong to other programs, with whose they are.
OTHER_TOOLS_FLAGS = {
    "--no-deps": "pip",
    "--build-arg": "docker build",
    "--create-namespace": "helm install",
    "--set": "helm install",
    "--kube-version": "helm template",
    "--recursive": "kubectl explain",
    "--dry-run": "kubectl apply",
    "--kv-event-source": "vllm-router",
    "--quick": "the bench/*.py scripts",
    "--total-queued-requests-metric": "the Inference Extension's endpoint picker",
    "--total-running-requests-metric": "the Inference Extension's endpoint picker",
    "--kv-cache-usage-percentage-metric": "the Inference Extension's endpoint picker",
    "--lora-info-metric": "the Inference Extension's endpoint picker",
    "--cache-info-metric": "the Inference Extension's endpoint picker",
    "--daemons": "examples/real_model_chat.py",
    "--chat-template-content-format": "vLLM's server",
    "--trust-request-chat-template": "vLLM's server",
}

# `pagefleet SUB args...` up to the end of a code span, a comment, a pipe or the line.
COMMAND_RE = re.compile(r"pagefleet ([a-z]+)((?:[ \t]+[^\s`|#]+)*)")
FLAG_RE = re.compile(r"(?<![\w-])--?[a-zA-Z][a-z0-9-]*")


def _doc_texts() -> Iterator[tuple[str, str]]:
    for path in DOC_FILES:
        yield path.relative_to(ROOT).as_posix(), path.read_text()


def _options(name: str) -> set[str]:
    command: click.Command = importlib.import_module(SUBCOMMANDS[name][0]).command
    opts = {o for p in command.params for o in (*p.opts, *getattr(p, "secondary_opts", ()))}
    return opts | {"-h", "--help"}


def _flags_in(args: str) -> set[str]:
    flags = set()
    for token in args.split():
        for part in token.split("/"):  # `--standalone/--peering`
            match = FLAG_RE.fullmatch(part.split("=")[0])
            if match:
                flags.add(match.group(0))
    return flags


def test_every_flag_shown_with_a_pagefleet_command_is_one_of_its_own() -> None:
    wrong = []
    for name, text in _doc_texts():
        for sub, args in COMMAND_RE.findall(text):
            if sub in SUBCOMMANDS:
                wrong += [f"{name}: pagefleet {sub} {f}" for f in _flags_in(args) - _options(sub)]
        # A paragraph that lists a command's flags: "`pagefleet operator` flags: `--a`, ..."
        for para in re.split(r"\n\s*\n", text):
            listed = re.match(r"\s*`pagefleet ([a-z]+)` flags:", para)
            if listed:
                sub = listed.group(1)
                flags = set(FLAG_RE.findall(para.replace("`", " ")))
                wrong += [f"{name}: pagefleet {sub} {f}" for f in flags - _options(sub)]
    assert not wrong, "flags the docs show that the command does not take:\n" + "\n".join(wrong)


def _defaults(flag: str) -> list[float]:
    values = []
    for sub in SUBCOMMANDS:
        command: click.Command = importlib.import_module(SUBCOMMANDS[sub][0]).command
        for p in command.params:
            if flag in p.opts and isinstance(p.default, int | float):
                values.append(float(p.default))
    return values


def test_every_default_stated_next_to_a_flag_is_the_flag_default() -> None:
    """`--flag` (30 s): one of the commands taking --flag defaults to that (a flag two
    commands take, such as --drain-timeout, may be stated for either)."""
    scale = {"": 1, "s": 1, "ms": 1e-3, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    stated = re.compile(
        r"`(--[a-z][a-z0-9-]*)`\s*\((?:default\s*)?([0-9][0-9.]*)\s*(s|ms|[KMG]iB)?\b"
    )
    wrong = []
    for name, text in _doc_texts():
        for flag, number, unit in stated.findall(text):
            value = float(number)
            # A size flag counts bytes (--max-response-bytes) or MiB (--max-stream-backlog-mb).
            candidates = {value, value * scale[unit or ""]}
            defaults = _defaults(flag)
            if not candidates & set(defaults):
                wrong.append(f"{name}: {flag} ({number} {unit}) but the defaults are {defaults}")
    assert not wrong, "\n".join(wrong)


def test_every_other_flag_named_exists_somewhere() -> None:
    known = set().union(*(_options(sub) for sub in SUBCOMMANDS)) | set(OTHER_TOOLS_FLAGS)
    known |= {o for p in cli.params for o in p.opts}  # pagefleet --version
    unknown = [
        f"{name}: {flag}"
        for name, text in _doc_texts()
        for flag in sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)) - known)
    ]
    assert not unknown, "flags no pagefleet command (nor a known tool) takes:\n" + "\n".join(
        unknown
    )


def test_every_repository_path_named_exists() -> None:
    top = "pagefleet|tests|e2e|bench|crds|helm|deploy|docs|examples|scripts|ci"
    path_re = re.compile(rf"(?:`|\]\()((?:{top})/[\w./-]*\w/?)[`)]")
    missing = [
        f"{name}: {p}"
        for name, text in _doc_texts()
        for p in path_re.findall(text)
        if not (ROOT / p).exists() and not (ROOT / "docs" / p).exists()
    ]
    for path in DOC_FILES:  # markdown links and images, relative to their page
        for link in re.findall(r"\]\(([^)#\s]+)", path.read_text()):
            if "://" not in link and not (path.parent / link).exists():
                missing.append(f"{path.relative_to(ROOT)}: link {link}")
    assert not missing, "paths the docs name that do not exist:\n" + "\n".join(missing)


def _crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservices.pagefleet.io.yaml").read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_every_crd_spec_path_named_exists() -> None:
    wrong = []
    for name, text in _doc_texts():
        for dotted in set(re.findall(r"\bspec(?:\.[a-zA-Z]+)+", text)):
            node = _crd_schema()
            for part in dotted.split("."):
                props = node.get("properties", {})
                if part not in props:
                    wrong.append(f"{name}: {dotted} ({part!r} is not a field)")
                    break
                node = props[part]
    assert not wrong, "\n".join(wrong)


def test_every_environment_variable_named_is_read_somewhere() -> None:
    sources = "".join(
        f.read_text(errors="replace")
        for top in ("pagefleet", "helm", "deploy")
        for f in (ROOT / top).rglob("*")
        if f.is_file() and f.suffix in {".py", ".yaml", ".tpl", ".txt", ""}
    )
    unread = [
        f"{name}: {var}"
        for name, text in _doc_texts()
        for var in sorted(set(re.findall(r"\bPAGEFLEET_[A-Z_]*[A-Z]", text)))
        if var not in sources
    ]
    assert not unread, "environment variables nothing reads:\n" + "\n".join(unread)


# --- metrics: scraped from a running fleet -------------------------------------------------

METRIC_RE = re.compile(r"\b(?:vllm|pagefleet):[a-z][a-z0-9_]*|\bpagefleet_[a-z][a-z0-9_]*")


def _family_names(text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names |= {sample.name for sample in family.samples}
        if family.type == "counter":  # a labelled counter with no child yet has no sample
            names.add(family.name + "_total")
    return names


def _registry_names(registry: CollectorRegistry) -> set[str]:
    from prometheus_client import generate_latest

    return _family_names(generate_latest(registry).decode())


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return str(resp.read().decode())


def _without_daemon_labels(text: str) -> set[str]:
    """Daemon series missing a label docs/metrics.md says every series carries."""
    return {
        sample.name
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(("vllm:", "pagefleet:"))
        and not {"model_name", "role", "pod"} <= set(sample.labels)
    }


def _documented_metrics() -> dict[str, set[str]]:
    named: dict[str, set[str]] = {}
    for name, text in _doc_texts():
        for metric in METRIC_RE.findall(text):
            if metric.endswith("_"):  # a family written with a wildcard: `vllm:gpu_prefix_cache_*`
                continue
            named.setdefault(metric, set()).add(name)
    return named


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_metric_named_is_exported(tmp_path: Path) -> None:
    """A P/D fleet (1 prefill + 1 decode daemon, the gateway with both pools) with a price
    per hour serves one request; every daemon and gateway series the docs name must then be
    in a scrape, every operator series in the operator's registry."""
    import openai

    from pagefleet.dev.local_fleet import FleetSpec, LocalFleet
    from pagefleet.operator.metrics import OperatorMetrics

    spec = FleetSpec(
        model="tiny",
        use_redis=False,
        num_prefill=1,
        num_decode=1,
        daemon_args=["--cost-per-hour", "1.5"],
        log_dir=tmp_path,
    )
    with LocalFleet(spec) as fleet:
        client = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key="none")
        client.completions.create(model="tiny", prompt="hello " * 40, max_tokens=2)
        daemon_texts = [_scrape(url) for url in fleet.daemon_urls]
        gateway = _family_names(_scrape(fleet.gateway_url))
    daemons = set().union(*map(_family_names, daemon_texts))
    unlabelled = set().union(*map(_without_daemon_labels, daemon_texts))
    assert not unlabelled, f"daemon series without model_name, role and pod: {unlabelled}"
    operator = _registry_names(OperatorMetrics().registry)
    missing = []
    for metric, where in sorted(_documented_metrics().items()):
        if metric.startswith("pagefleet_gateway_"):
            exported = gateway
        elif metric.startswith("pagefleet_operator_"):
            exported = operator
        else:
            exported = daemons
        if metric not in exported:
            missing.append(f"{metric} (named in {', '.join(sorted(where))})")
    assert not missing, "metrics the docs name that nothing exports:\n" + "\n".join(missing)
