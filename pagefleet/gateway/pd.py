"""Gateway side of prefill/decode disaggregation: one remote prefill before the decode pod.

For each generation request the gateway has already ranked the decode pool (cache-aware +
load). Then:

1. Conditional disaggregation: when the best decode pod's cached prefix leaves fewer than
   ``min_uncached_tokens`` to compute, or the prompt is unknown (no tokenizer), or the
   prefill pool is saturated or empty, the decode pod prefills locally: the body goes as
   is. Saturated: every prefill pod already has ``max_prefill_inflight`` requests in
   flight, counting this gateway's own (exact, instant) plus what the pod's last Redis
   heartbeat reported beyond them (other gateway replicas, direct clients): the router's
   ``queue`` figure, the same one the cache-aware policy balances on.
2. Otherwise the prompt goes to the best prefill pod (cache-aware over the prefill pool)
   that is not saturated
   with ``max_tokens=1``, ``n=1``, no streaming and ``kv_transfer_params.do_remote_decode``
   under a handle the gateway names (``remote_request_id``). At the same time (``early``,
   the default) the original body goes to the decode pods with ``kv_transfer_params``
   pointing at that handle and ``remote_pending``: the decode pod reserves its blocks and
   reads the request while the prefill runs, waits for the handle and pulls it the moment
   it exists -- the hand-over through the gateway and the reservation are off the long
   prompt's path. (Without ``early``, the gateway waits for the prefill's answer and adds
   its ``kv_transfer_params`` to the body.) On a decode failure before the first byte, the
   next decode pod gets the same handle.
3. A prefill pod that fails or times out costs nothing but time: the decode pod prefills
   locally (told by the prefill pod, which settles the handle as never exported, or by the
   gateway's release of it when the prefill pod never got the request). A decode pod
   told early waits for the handle at most ``prefill_timeout_s`` (``remote_wait_s``): a
   frozen prefill pod answers neither the prefill nor the release.
4. When the gateway gives up on a request that carries a handle (every decode pod failed,
   a decode pod answered an error, or the client went away first), it releases the handle
   on the prefill pod (``POST /v1/kv/release``) in the background: its blocks are unpinned
   at once instead of at the handle's deadline. A handle already pulled answers 404, which
   is harmless.

Every request to a daemon here (prefill, release) carries the headers the gateway gives
``prepare`` and ``release_later``: with ``PAGEFLEET_UPSTREAM_API_KEY`` set, its
``Authorization`` (a release carries nothing else of the client's request). A prefill
pod that answers 401 is logged once, with the setting to fix.

With the fleet's P/D secret (``PAGEFLEET_KV_TRANSFER_SECRET``, httpauth.py) every
``kv_transfer_params`` the gateway sends a decode pod is signed: the handle it names
early, and the prefill pod's answer once its address is rewritten to the one the gateway
reached (the prefill pod's own signature covers the address it advertised). Decode pods
with the secret refuse unsigned params.

The client sees one ordinary OpenAI response from the decode pod (usage included), since
the decode pod serves the original request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from prometheus_client import Counter, Histogram

from pagefleet.gateway.router import Router, RoutingDecision
from pagefleet.httpauth import (
    TransferClaims,
    TransferSigner,
    kv_secret_from_env,
    upstream_refused_hint,
)

logger = logging.getLogger(__name__)

# How long, and how many, released handles are remembered so that a handle is released
# (and counted) once: its early prefill's failure and the decode request's end release it
# within the request's life, which the proxy's timeouts bound far below this.
_RELEASED_TTL_S = 600.0
_RELEASED_KEEP = 100_000
# How long params the gateway signs stay valid past its prefill timeout: a decode pod
# checks them as the request arrives (also a retry on the next decode pod), never later.
_SIGNED_FOR_S = 120


def _fleet_signer() -> TransferSigner | None:
    secret = kv_secret_from_env()
    return None if secret is None else TransferSigner(secret)


@dataclass(slots=True)
class PDSettings:
    # Disaggregate only when the decode pod would compute at least this many prompt tokens.
    min_uncached_tokens: int = 256
    # A prefill pod with this many requests in flight (ours plus those its heartbeat
    # reports beyond ours) takes no more; when all do, the decode pod prefills locally.
    max_prefill_inflight: int = 8
    prefill_timeout_s: float = 30.0
    # Bound on one release request (best effort: the handle's deadline frees it otherwise).
    release_timeout_s: float = 2.0
    # Send the decode request while the prefill runs (the decode pod reserves and waits for
    # the handle), instead of after the prefill's answer.
    early: bool = True
    # The fleet's P/D secret (default: PAGEFLEET_KV_TRANSFER_SECRET(_FILE)); None: unsigned.
    signer: TransferSigner | None = field(default_factory=_fleet_signer)


@dataclass(slots=True)
class PDPrepared:
    """What ``prepare`` decided: the body for the decode pool, and the prefill pod's
    ``kv_transfer_params`` when a remote prefill made a handle (None: local prefill)."""

    body: bytes
    params: dict[str, Any] | None = None


@dataclass(slots=True)
class PDOrchestrator:
    """Runs the remote prefill for the gateway; ``prepare`` returns the decode body."""

    prefill_router: Router
    settings: PDSettings = field(default_factory=PDSettings)
    registry: Any = None
    _decisions: Any = None
    _prefill_seconds: Any = None
    _released: Any = None
    _releases: set[asyncio.Task[None]] = field(default_factory=set)
    # Early prefills running, by handle (a release of one waits for it: a handle released
    # before its prefill exported it would stay pinned until its deadline).
    _prefills: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    # Handles released already, with when (oldest first): a handle whose early prefill
    # failed was released then, and one that no decode pod served is released again after
    # it; the second release would find nothing and count the handle twice.
    _released_at: dict[str, float] = field(default_factory=dict)
    _warned_refused: bool = False

    def __post_init__(self) -> None:
        kw = {"registry": self.registry} if self.registry is not None else {"registry": None}
        self._decisions = Counter(
            "pagefleet_gateway_pd_requests",
            "Generation requests by P/D path: remote (prefilled on a prefill pod; reason "
            "early: sent to the decode pod while the prefill runs) or local (decode pod "
            "prefills), with the reason; an early one whose prefill fails counts as "
            "local/prefill_failed too.",
            ["path", "reason"],
            **kw,
        )
        self._prefill_seconds = Histogram(
            "pagefleet_gateway_pd_prefill_seconds",
            "Wall time of the remote prefill request (gateway to prefill pod and back).",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            **kw,
        )
        self._released = Counter(
            "pagefleet_gateway_pd_handles_released",
            "Prefill handles the gateway released (their prefill failed, or no decode pod "
            "served the request), each handle once, by result: released, gone (already "
            "pulled or expired), failed (unreachable).",
            ["result"],
            **kw,
        )

    async def start(self) -> None:
        await self.prefill_router.start()

    async def close(self) -> None:
        """Stop routing; wait for releases in flight (each bounded by its own timeout).
        Call before the session the releases use is closed."""
        if self._prefills:  # early prefills still running (each bounded by its timeout)
            await asyncio.gather(*self._prefills.values(), return_exceptions=True)
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)
        await self.prefill_router.close()

    def _count(self, path: str, reason: str) -> None:
        self._decisions.labels(path=path, reason=reason).inc()

    def _refused(self, pod: str, headers: dict[str, str]) -> None:
        """A daemon answered 401: say once what to set (every P/D request prefills locally
        until then, which is otherwise silent)."""
        if self._warned_refused:
            return
        self._warned_refused = True
        sent = any(k.lower() == "authorization" for k in headers)
        logger.warning(
            "prefill pod %s refused the gateway's P/D request (401), so every request "
            "prefills on its decode pod: %s",
            pod, upstream_refused_hint("gateway", sent),
        )  # fmt: skip

    async def prepare(
        self,
        session: aiohttp.ClientSession,
        path: str,
        body: bytes,
        token_ids: list[int] | None,
        decision: RoutingDecision,
        headers: dict[str, str],
    ) -> PDPrepared:
        """The body to send to the decode pool: with ``kv_transfer_params`` after a
        successful remote prefill (``params`` set: the caller must ``release_later`` it if
        no decode pod serves the request), else unchanged (local prefill)."""
        original, reason = self._eligible(body, token_ids, decision)
        if original is not None and token_ids:
            params, reason = await self._remote_prefill(session, path, original, token_ids, headers)
            if params is not None:
                original["kv_transfer_params"] = params
                # An early hand-over is counted when sent (its prefill still running); one
                # whose prefill then fails counts as local/prefill_failed as well.
                self._count("remote", "early" if params.get("remote_pending") else "ok")
                return PDPrepared(json.dumps(original, separators=(",", ":")).encode(), params)
        self._count("local", reason)
        return PDPrepared(body)

    def _eligible(
        self, body: bytes, token_ids: list[int] | None, decision: RoutingDecision
    ) -> tuple[dict[str, Any] | None, str]:
        """The parsed body when a remote prefill is worth trying, else None and why not."""
        if not token_ids:
            return None, "prompt_unknown"
        cached = decision.ranked[0].matched_tokens if decision.ranked else 0
        if len(token_ids) - cached < self.settings.min_uncached_tokens:
            return None, "short_uncached"
        try:
            original = json.loads(body)
        except ValueError:
            return None, "bad_body"
        if not isinstance(original, dict) or "kv_transfer_params" in original:
            return None, "caller_params"
        prompt = original.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
            # A transfer handle carries one prompt's KV: the prefill pod refuses the batch.
            return None, "multi_prompt"
        if original.get("prompt_logprobs") is not None or (
            original.get("echo") and original.get("logprobs") is not None
        ):
            # Scoring the prompt needs its logits, which pulled KV does not carry: the
            # decode engine would refuse the import and prefill it again anyway.
            return None, "prompt_logprobs"
        return original, ""

    async def _remote_prefill(
        self,
        session: aiohttp.ClientSession,
        path: str,
        original: dict[str, Any],
        token_ids: list[int],
        headers: dict[str, str],
    ) -> tuple[dict[str, Any] | None, str]:
        """The prefill pod's transfer params, or None and why the decode pod prefills."""
        pre = await self.prefill_router.route(token_ids)
        if not pre.ranked:
            return None, "no_prefill_pods"
        ep = next(
            (s.endpoint for s in pre.ranked if s.queue < self.settings.max_prefill_inflight),
            None,
        )
        if ep is None:
            return None, "prefill_saturated"
        if not self.settings.early:
            return await self._prefill(session, ep, path, original, headers), "prefill_failed"
        handle = f"pd-{uuid.uuid4().hex}"
        url = urlsplit(ep.url)
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "remote_pending": True,
            "remote_engine_id": ep.pod,
            "remote_host": url.hostname,
            "remote_port": url.port,
            "remote_request_id": handle,
            # The decode pod waits for this prefill no longer than the gateway does: a
            # frozen prefill pod would otherwise hold it to its own transfer timeout.
            "remote_wait_s": self.settings.prefill_timeout_s,
        }
        self._sign(params, int(time.time() + self.settings.prefill_timeout_s) + _SIGNED_FOR_S)
        task = asyncio.get_running_loop().create_task(
            self._early_prefill(session, ep, path, original, headers, params)
        )
        self._prefills[handle] = task
        task.add_done_callback(lambda _: self._prefills.pop(handle, None))
        return params, ""

    async def _early_prefill(
        self,
        session: aiohttp.ClientSession,
        ep: Any,
        path: str,
        original: dict[str, Any],
        headers: dict[str, str],
        params: dict[str, Any],
    ) -> None:
        """The prefill of an early hand-over, beside the decode request. When it fails the
        handle is released on the prefill pod, so a decode pod waiting for it stops (a
        prefill pod that got the request says so itself; this covers one that did not)."""
        handle = params["remote_request_id"]
        got = await self._prefill(session, ep, path, original, headers, handle)
        if got is None:
            self._count("local", "prefill_failed")
            # A task of its own: a client that leaves now cancels this prefill task, and
            # a release awaited here was cancelled with it -- after it had claimed the
            # handle's one release, so the handle was neither released nor counted.
            self._track(self._release(session, params, headers, wait=False))

    def _track(self, release: Any) -> None:
        """Run ``release`` in the background; ``close`` waits for it."""
        task = asyncio.get_running_loop().create_task(release)
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def release_later(
        self,
        session: aiohttp.ClientSession,
        params: dict[str, Any],
        headers: dict[str, str],
        cancel_prefill: bool = False,
    ) -> None:
        """Free ``params``' handle on its prefill pod in the background: no decode pod will
        pull it. ``headers``: those the request's other calls to daemons carried (only
        their ``Authorization`` goes). ``cancel_prefill`` (the client went away): an early
        prefill still running is cancelled, as a unified pod aborts the request; it ran to
        its end before, holding a prefill slot for nobody. Never raises; ``close`` waits
        for it."""
        early = self._prefills.get(str(params.get("remote_request_id")))
        if cancel_prefill and early is not None and not early.done():
            early.cancel()  # the prefill pod sees the disconnect and frees the handle
        self._track(self._release(session, params, headers))

    async def _release(
        self,
        session: aiohttp.ClientSession,
        params: dict[str, Any],
        headers: dict[str, str],
        wait: bool = True,
    ) -> None:
        host, port = params.get("remote_host"), params.get("remote_port")
        handle = params.get("remote_request_id")
        early = self._prefills.get(str(handle)) if wait else None
        if early is not None:  # its prefill may export it yet: release it after that
            await asyncio.gather(early, return_exceptions=True)
        if not self._first_release(str(handle)):
            return  # released (and counted) already: one handle, one release, one count
        if ":" in str(host) and not str(host).startswith("["):
            host = f"[{host}]"  # IPv6 literal
        url = f"http://{host}:{port}/v1/kv/release"
        auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
        try:
            async with asyncio.timeout(self.settings.release_timeout_s):
                async with session.post(url, json={"handle": handle}, headers=auth) as resp:
                    result = {200: "released", 404: "gone"}.get(resp.status, "failed")
                    if resp.status == 401:
                        self._refused(f"{host}:{port}", auth)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            logger.info("releasing prefill handle %s at %s failed: %s", handle, url, exc)
            result = "failed"
        self._released.labels(result=result).inc()

    def _first_release(self, handle: str) -> bool:
        """Record ``handle`` as released; False when it was already (within
        ``_RELEASED_TTL_S``, the longest a request holding a handle lives past its
        prefill's failure). Records older than that, or beyond ``_RELEASED_KEEP``, are
        forgotten (amortised O(1) a call: the dict is in release order)."""
        now = time.monotonic()
        if handle in self._released_at:
            return False
        self._released_at[handle] = now
        while self._released_at:
            oldest, at = next(iter(self._released_at.items()))
            if at >= now - _RELEASED_TTL_S and len(self._released_at) <= _RELEASED_KEEP:
                break
            del self._released_at[oldest]
        return True

    async def _prefill(
        self,
        session: aiohttp.ClientSession,
        ep: Any,
        path: str,
        original: dict[str, Any],
        headers: dict[str, str],
        handle: str | None = None,
    ) -> dict[str, Any] | None:
        """Run the remote prefill (under ``handle`` when given); its transfer params, or
        None when it failed."""
        req = dict(original)
        for k in ("stream", "stream_options", "logprobs", "top_logprobs", "echo",
                  "max_completion_tokens", "min_tokens", "best_of", "use_beam_search",
                  "length_penalty", "early_stopping"):  # fmt: skip
            req.pop(k, None)
        kvp: dict[str, Any] = {"do_remote_decode": True}
        if handle is not None:
            kvp["remote_request_id"] = handle
        req.update(max_tokens=1, n=1, kv_transfer_params=kvp)
        self.prefill_router.acquire(ep)
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.settings.prefill_timeout_s):
                async with session.post(ep.url + path, json=req, headers=headers) as resp:
                    if resp.status == 401:
                        self._refused(ep.pod, headers)
                    if resp.status != 200:
                        logger.info(
                            "prefill pod %s answered %d; the decode pod prefills locally",
                            ep.pod, resp.status,
                        )  # fmt: skip
                        if resp.status >= 500 or resp.status == 429:
                            # The pod is failing or full; a 4xx is about this request and
                            # says nothing of the pod (the unified path does not eject).
                            self.prefill_router.mark_failed(ep)
                        return None
                    data = await resp.json()
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            logger.info("prefill pod %s failed (%s); the decode pod prefills locally", ep.pod, exc)
            self.prefill_router.mark_failed(ep)
            return None
        finally:
            self.prefill_router.release(ep)
        self._prefill_seconds.observe(time.perf_counter() - t0)
        self.prefill_router.mark_ok(ep)
        params = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if not isinstance(params, dict) or not params.get("remote_request_id"):
            return None
        # The address the gateway reached is the one that works from the fleet's network.
        url = urlsplit(ep.url)
        if url.hostname:
            params["remote_host"] = url.hostname
        if url.port:
            params["remote_port"] = url.port
        expires = params.get("remote_expires_at")
        if not isinstance(expires, int) or isinstance(expires, bool):
            expires = int(time.time()) + _SIGNED_FOR_S
        self._sign(params, expires)
        return params

    def _sign(self, params: dict[str, Any], expires_at: int) -> None:
        """Sign ``params`` (as a decode pod checks them) when the fleet has a secret."""
        signer = self.settings.signer
        if signer is None:
            return
        # As a decode pod reads them; a value of the wrong type (from a faulty prefill pod)
        # signs as absent, never raises here: the decode pod then refuses the params (400).
        ids, port, engine = (params.get(k) for k in
                             ("remote_block_ids", "remote_port", "remote_engine_id"))  # fmt: skip
        claims = TransferClaims(
            handle=str(params.get("remote_request_id") or ""),
            host=str(params.get("remote_host") or ""),
            port=port if isinstance(port, int) else 0,
            engine_id=engine if isinstance(engine, str) else None,
            block_ids=list(ids) if isinstance(ids, list) else None,
            namespace=self.prefill_router.kv_namespace,
            expires_at=expires_at,
        )
        params["remote_expires_at"] = expires_at
        params["remote_signature"] = signer.sign(claims)
