"""A throwaway local Prometheus and a small HTTP API client: for tests and the PNG renderer.

Uses the ``prometheus`` binary on PATH (Debian/Ubuntu: ``apt-get install prometheus``). The
server listens on 127.0.0.1 on a free port, keeps its TSDB in a temp dir and is stopped
(and the dir removed) by ``stop()``. Targets are static: each ``ScrapeTarget`` carries the
labels the chart's PodMonitor would add in a cluster (``namespace``, ``inferenceservice``),
and scraping honours the targets' own labels (``pod``, ``role``) as the PodMonitor does.

    with LocalPrometheus([ScrapeTarget("127.0.0.1:8001", {"namespace": "ns"})]) as prom:
        prom.query("up")
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from pagefleet.dev import process
from pagefleet.dev.process import free_port


class PrometheusError(RuntimeError):
    """The API answered with an error (bad PromQL, bad range): ``error_type`` says which."""

    def __init__(self, message: str, error_type: str = "") -> None:
        super().__init__(message)
        self.error_type = error_type


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    address: str  # host:port serving /metrics
    labels: dict[str, str] = field(default_factory=dict)


def find_prometheus() -> str:
    found = shutil.which("prometheus")
    if not found:
        raise RuntimeError(
            "no prometheus binary on PATH: install it (apt-get install prometheus); "
            ".ci/run does this for CI"
        )
    return found


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=1) as r:
        return bool(r.status == 200)


def scrape_config(
    targets: list[ScrapeTarget], interval_s: float, rule_files: list[Path]
) -> dict[str, Any]:
    """prometheus.yml for these targets: one job, each target with its own labels."""
    interval = f"{interval_s:g}s"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [
            {
                "job_name": "pagefleet",
                "honor_labels": True,
                "scrape_timeout": interval,
                "static_configs": [{"targets": [t.address], "labels": t.labels} for t in targets],
            }
        ],
    }


class PrometheusAPI:
    """The few HTTP API calls we need (instant and range queries, metadata, targets)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _get(self, path: str, params: dict[str, str] | None = None) -> Any:
        query = "?" + urllib.parse.urlencode(params) if params else ""
        try:
            with urllib.request.urlopen(self.url + path + query, timeout=self.timeout_s) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:  # 400/422 carry a JSON error body
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(
                f"{path} {params}: {body.get('errorType')}: {body.get('error')}",
                body.get("errorType", ""),
            )
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; the result as a list of {metric, value} (vectors and scalars)."""
        data = self._get("/api/v1/query", {"query": expr})
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_range(
        self, expr: str, start: float, end: float, step_s: float
    ) -> list[dict[str, Any]]:
        data = self._get(
            "/api/v1/query_range",
            {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}"},
        )
        result: list[dict[str, Any]] = data["result"]
        return result

    def metadata(self) -> dict[str, list[dict[str, str]]]:
        """Metric family name -> metadata, for every family some target exposes."""
        data: dict[str, list[dict[str, str]]] = self._get("/api/v1/metadata")
        return data

    def targets_up(self) -> int:
        return sum(t["health"] == "up" for t in self._get("/api/v1/targets")["activeTargets"])

    def rules(self) -> list[dict[str, Any]]:
        groups: list[dict[str, Any]] = self._get("/api/v1/rules")["groups"]
        return groups


class LocalPrometheus:
    """A prometheus child process; ``api`` is valid between ``start()`` and ``stop()``."""

    def __init__(
        self,
        targets: list[ScrapeTarget],
        rule_files: list[Path] | None = None,
        interval_s: float = 1.0,
        executable: str | None = None,
        startup_timeout_s: float = 30.0,
    ) -> None:
        self.targets = targets
        self.rule_files = rule_files or []
        self.interval_s = interval_s
        self.executable = executable or find_prometheus()
        self.startup_timeout_s = startup_timeout_s
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api(self) -> PrometheusAPI:
        return PrometheusAPI(self.url)

    @property
    def log_path(self) -> Path:
        assert self._dir is not None, "not started"
        return self._dir / "prometheus.log"

    def start(self) -> PrometheusAPI:
        self._dir = Path(tempfile.mkdtemp(prefix="pagefleet-prom-"))
        config = self._dir / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(scrape_config(self.targets, self.interval_s, self.rule_files))
        )
        self.port = free_port()
        self._proc = process.spawn(
            [
                self.executable,
                f"--config.file={config}",
                f"--storage.tsdb.path={self._dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1d",
            ],
            self.log_path,
        )
        try:
            process.wait_until(
                "prometheus",
                lambda: _http_ok(self.url + "/-/ready"),
                self.startup_timeout_s,
                proc=self._proc,
                context=lambda: process.tail(self.log_path),
            )
        except (TimeoutError, ChildProcessError):
            self.stop()
            raise
        return self.api

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 10 s) and remove its files."""
        proc, self._proc = self._proc, None
        if proc is not None:
            process.stop(proc, grace_s=10.0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> LocalPrometheus:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
