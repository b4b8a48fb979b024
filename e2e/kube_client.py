"""A minimal Kubernetes REST client over urllib3, reading the kubeconfigs e2e/cluster.py writes.

The node agent and the tests work on plain JSON dicts (what the apiserver actually sends),
which keeps status patches exact and avoids model (de)serialisation of every watch event.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import urllib3
import yaml

logger = logging.getLogger(__name__)

JSON = dict[str, Any]


class KubeAPIError(RuntimeError):
    """A non-2xx answer from the apiserver; `status` is the HTTP code, `body` its Status."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        self.status = status
        self.body = body
        try:
            message = json.loads(body).get("message", body)
        except ValueError:
            message = body
        super().__init__(f"{method} {path} -> HTTP {status}: {message}")


@dataclass(slots=True, frozen=True)
class KubeConfig:
    """The parts of a kubeconfig a bearer-token client needs."""

    server: str
    token: str
    ca_path: str

    @classmethod
    def load(cls, path: Path) -> KubeConfig:
        """Read the current context of a token-authenticated kubeconfig."""
        cfg = yaml.safe_load(path.read_text())
        ctx_name = cfg["current-context"]
        ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
        if "token" not in user or "certificate-authority" not in cluster:
            raise ValueError(
                f"{path}: only token + certificate-authority kubeconfigs are supported "
                "(the ones e2e/cluster.py writes)"
            )
        return cls(cluster["server"], user["token"], cluster["certificate-authority"])


class KubeClient:
    """Blocking JSON calls against one apiserver; safe to share between threads."""

    def __init__(self, config: KubeConfig, timeout_s: float = 10.0) -> None:
        self.config = config
        self._timeout_s = timeout_s
        self._http = urllib3.PoolManager(
            num_pools=2, maxsize=4, cert_reqs="CERT_REQUIRED", ca_certs=config.ca_path
        )

    @classmethod
    def from_kubeconfig(cls, path: Path) -> KubeClient:
        return cls(KubeConfig.load(path))

    def request(
        self,
        method: str,
        path: str,
        body: JSON | None = None,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> JSON:
        """One call; returns the decoded JSON body or raises KubeAPIError on non-2xx."""
        url = self.config.server + path + (f"?{urlencode(query)}" if query else "")
        headers = {"Authorization": f"Bearer {self.config.token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        resp = self._http.request(
            method, url, body=data, headers=headers, timeout=self._timeout_s, retries=False
        )
        text = resp.data.decode(errors="replace")
        if resp.status >= 300:
            raise KubeAPIError(method, path, resp.status, text)
        return json.loads(text) if text else {}

    def get(self, path: str, query: dict[str, str] | None = None) -> JSON:
        return self.request("GET", path, query=query)

    def get_or_none(self, path: str) -> JSON | None:
        """GET that maps 404 to None."""
        try:
            return self.get(path)
        except KubeAPIError as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, path: str, body: JSON) -> JSON:
        return self.request("POST", path, body)

    def merge_patch(self, path: str, body: JSON) -> JSON:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")

    def delete(self, path: str, body: JSON | None = None) -> JSON:
        return self.request("DELETE", path, body)

    def watch(self, path: str, query: dict[str, str], timeout_s: int) -> Iterator[JSON]:
        """Yield watch events ({type, object}) until the server closes the stream.

        `timeout_s` is passed as timeoutSeconds, so the stream ends on its own and the caller
        re-watches from the last resourceVersion it saw.
        """
        q = {**query, "watch": "1", "timeoutSeconds": str(timeout_s), "allowWatchBookmarks": "1"}
        url = f"{self.config.server}{path}?{urlencode(q)}"
        resp = self._http.request(
            "GET",
            url,
            headers={"Authorization": f"Bearer {self.config.token}"},
            preload_content=False,
            timeout=urllib3.Timeout(connect=self._timeout_s, read=timeout_s + 10),
            retries=False,
        )
        try:
            if resp.status >= 300:
                raise KubeAPIError("WATCH", path, resp.status, resp.read().decode())
            buf = b""
            for chunk in resp.stream(65536):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
        finally:
            resp.release_conn()
