"""The image's Dockerfile installs pagefleet with the install line CI runs (Makefile `setup`).

The image cannot be built here (no container engine, no registry); this keeps what it would
install identical to what the test suite passed with."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _makefile_install() -> list[str]:
    text = (ROOT / "Makefile").read_text()
    pip_flags = re.search(r"^PIP_FLAGS \?= (.+)$", text, re.M)
    assert pip_flags, "PIP_FLAGS missing from the Makefile"
    lines = [ln.strip() for ln in text.splitlines() if "pip install" in ln and "-e " in ln]
    assert len(lines) == 1, lines
    line = lines[0].replace("$(PIP_FLAGS)", pip_flags.group(1)).replace("$(VENV)/bin/", "")
    return shlex.split(line)


def _dockerfile_installs() -> list[list[str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    cmds = []
    for run in re.findall(r"^RUN (.+)$", text, re.M):
        for part in run.split("&&"):
            argv = shlex.split(part)
            if "pip" in argv[0] and "install" in argv:
                cmds.append([a.replace("/opt/venv/bin/", "") for a in argv])
    return cmds


def test_dockerfile_installs_what_ci_installs() -> None:
    installs = _dockerfile_installs()
    assert _makefile_install() in installs, (installs, _makefile_install())


def test_dockerfile_variants_and_user() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG TORCH_VARIANT=cpu" in text
    assert "download.pytorch.org/whl/${TORCH_VARIANT}" in text
    assert "USER 65532" in text  # the chart's runAsUser
    assert 'ENTRYPOINT ["pagefleet"]' in text


def test_chart_and_examples_run_the_dockerfiles_image() -> None:
    import yaml

    from pagefleet.api.inferenceservice import DEFAULT_IMAGE

    repo, tag = DEFAULT_IMAGE.rsplit(":", 1)
    values = yaml.safe_load((ROOT / "helm" / "pagefleet" / "values.yaml").read_text())
    chart = yaml.safe_load((ROOT / "helm" / "pagefleet" / "Chart.yaml").read_text())
    assert values["operator"]["image"]["repository"] == repo
    assert chart["appVersion"] == tag  # the operator's default tag
    images = [
        doc["spec"]["image"]
        for path in sorted((ROOT / "examples").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc and "image" in doc.get("spec", {})
    ]
    assert images and set(images) <= {DEFAULT_IMAGE, f"{DEFAULT_IMAGE}-cuda"}
    assert "-cuda" in (ROOT / "examples" / "llama-disaggregated.yaml").read_text()
