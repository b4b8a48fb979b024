"""Prefill -> decode KV transfer: the ``KVTransfer`` interface and its TCP implementation.

The decode pod *pulls*: it asks the prefill pod that holds a transfer handle for a range of
the prompt's blocks and receives them in one binary response on the daemon's own HTTP port
(``POST /v1/kv/pull``):

    4 bytes   big-endian length of the header
    header    JSON: layout (layers, block_size, num_kv_heads, head_dim, dtype), the block
              range, each block's key (null for the prompt's partial last block), the
              chain key over that partial block when the range holds it (``tail_hash``,
              else null) and the token ids of the range
    payload   for each layer in the header's layer range: K then V of the blocks, as
              ``[num_blocks, block_size, num_kv_heads, head_dim]`` in C order

A decode pod may be told of a handle before its prefill ends (``remote_pending``: the
gateway sent the prompt to both pods at once, so the decode pod reserves its blocks while
the prefill runs); it then waits for the handle with ``POST /v1/kv/wait`` (``{"handle",
"wait_s"}``), which answers 200 once the prefill has exported it, 404 once it never will
(the prefill failed or was released), 408 at ``wait_s``.

A prefill pod that requires API keys (``PAGEFLEET_API_KEYS``) serves these paths to those
keys only, as any other (KV bytes are tenant data): the decode pod presents its upstream key
(``PAGEFLEET_UPSTREAM_API_KEY``, the one the gateway sends) on every call, and says once in
its log what to set when a prefill pod answers 401.

A decode pod that will not pull a handle after all (its own cache holds every block, or it
prefills locally) says so with ``POST /v1/kv/release`` (``{"handle": ...}``): the prefill
pod unpins the blocks at once instead of at the handle's deadline. A release that arrives
before the handle's prefill request is remembered (as long as settled outcomes are): that
prefill's export is freed as its request ends, never pinned for nobody.

The bytes come straight out of the KV tensors (one gather per layer, no per-element Python);
on CUDA the gather is staged through pinned host memory (``ModelRunner.read_kv_blocks``).
On the decode side they are received from the socket straight into the shared-memory stage
the engine process reads (kv_wire.py): no intermediate chunk per read.

Integrity: the decode side only uses a pull whose header matches its own view of the prompt
-- every block key equals the key its own chain gives (same namespace, same tokens: a handle
of another model or another prompt fails), and so does the partial last block's
(``tail_hash``: a range of that block alone, e.g. a prompt shorter than a block, has no
full block to carry the namespace and adapter), and the token ids equal its prompt's --
and whose layout equals its own. Any failure is a ``KVPullError`` with a reason; the
caller falls back to prefilling locally. The prefill side checks the same before it sends
a byte: a pull names the keys it expects, and the ``tail_hash`` when its range holds the
partial last block; another key, or no ``tail_hash`` then, is a 409 (the KV is another
tenant's data: it goes only to a pod that already knows the prompt under that model).

At most ``_MAX_PULLS_PER_HANDLE`` pulls of one handle are served at once; more are a 429
(the decode pod prefills locally, ``busy``): each took a stage of its own, and one handle
named by many callers at once could hold the whole read budget.

Room for RDMA/NIXL: another ``KVTransfer`` implementation can move the same blocks by
registered memory instead of a byte stream; the export/import bookkeeping in the engine
(pagefleet/engine/kv_export.py) and the verification below do not change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagefleet.daemon import kv_wire
from pagefleet.daemon.kv_stage import ByteBudget, KVStage, StagePool
from pagefleet.httpauth import bearer_header, upstream_refused_hint

logger = logging.getLogger(__name__)

PULL_PATH = "/v1/kv/pull"
RELEASE_PATH = "/v1/kv/release"
WAIT_PATH = "/v1/kv/wait"
# How long a wait for a handle the prefill pod has not heard of waits for its request to
# arrive (the gateway sends it and the decode request at once; it is normally first, and
# a gateway whose prefill request failed releases the handle, which ends the wait).
_UNKNOWN_GRACE_S = 10.0
# How long a settled handle's outcome is remembered for waits that arrive after it.
_SETTLED_TTL_S = 120.0
# ... and how many of them at most, and of handles released early: anyone who may call
# /v1/kv/release can name any handle, and each adds an entry for the TTL.
_MAX_REMEMBERED = 100_000
_HEADER_LEN = struct.Struct(">I")
_MAX_HANDLE = 256  # characters of a transfer handle in a pull, wait or release request
# Pulls of one handle served at once: a decode pod's and a gateway's retry on the next
# decode pod while the first pull still runs. Each took a read stage of its own (up to the
# whole read budget: 64 stalled pulls of one 100-token handle held 64 stages, 512 MiB of
# tmpfs, 211 fds); more are refused (429), and their pod prefills locally.
_MAX_PULLS_PER_HANDLE = 2


class KVTransferParams(BaseModel):
    """Request/response field ``kv_transfer_params``, named as vLLM's P/D connectors name it.

    To a prefill pod: ``do_remote_decode=true`` (keep the KV for a decode pod). From it, on
    the response: ``do_remote_prefill=true`` plus where and what to pull. To a decode pod:
    that object as received.
    """

    model_config = ConfigDict(extra="ignore")

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = Field(default=None, ge=1, le=65535)
    remote_request_id: str | None = None  # the transfer handle
    remote_num_tokens: int | None = Field(default=None, ge=0)  # the prompt the handle holds
    # To a prefill pod with do_remote_decode: the handle to export under (the caller's
    # choice, so it can tell a decode pod before the prefill ends); 1-128 characters.
    # To a decode pod with do_remote_prefill: ``remote_pending`` says the prefill may still
    # be running (reserve now, wait for the handle, then pull).
    remote_pending: bool = False
    # With remote_pending: the longest the sender will wait for that prefill, counted from
    # when it sent the request (a gateway's prefill timeout). Past it the sender has given
    # up on the prefill pod, so the decode pod stops waiting and prefills locally then,
    # rather than at its own kv_transfer_timeout_s (a frozen prefill pod never says "no").
    remote_wait_s: float | None = Field(default=None, gt=0, le=600)
    # From a fleet with a P/D secret (httpauth.TransferSigner): when the signature below
    # stops being accepted (unix seconds), and the signature itself (hex HMAC-SHA256 of
    # the handle, host, port, engine id, block ids, KV namespace and this expiry). A decode
    # pod with the secret pulls nothing without them.
    remote_expires_at: int | None = Field(default=None, ge=0)
    remote_signature: str | None = Field(default=None, max_length=128)


@dataclass(slots=True)
class PulledKV:
    """A pull's payload as received: for each layer K then V of the blocks, each
    ``shape`` in C order, back to back in ``buf`` (torch-free: the daemon's HTTP process
    hands it on to an engine process as bytes or as a shared-memory stage)."""

    buf: memoryview
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, int, int, int]  # [num_blocks, block_size, num_kv_heads, head_dim]
    num_layers: int

    @property
    def part_bytes(self) -> int:
        """Bytes of K (or of V) of one layer."""
        return len(self.buf) // (2 * self.num_layers)

    def parts(self) -> list[tuple[memoryview, memoryview]]:
        """Per layer (K, V) views of ``buf``."""
        n = self.part_bytes
        b = self.buf
        return [
            (b[2 * i * n : (2 * i + 1) * n], b[(2 * i + 1) * n : (2 * i + 2) * n])
            for i in range(self.num_layers)
        ]

    def tensors(self) -> list[tuple[Any, Any]]:
        """Per layer (K, V) tensor views of ``buf``, what ``commit_import`` takes (imports
        torch: call it where the engine runs)."""
        import torch

        dt = getattr(torch, self.dtype)
        return [
            (torch.frombuffer(k, dtype=dt).view(self.shape),
             torch.frombuffer(v, dtype=dt).view(self.shape))
            for k, v in self.parts()
        ]  # fmt: skip


class KVPullError(Exception):
    """A pull that cannot be used; ``reason`` is a short label for metrics and logs."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class KVTransferMetrics:
    """Transfer series of one daemon (docs/metrics.md), in the daemon's registry."""

    def __init__(
        self,
        registry: CollectorRegistry,
        labels: tuple[str, ...],
        values: list[str],
        expired_total: Callable[[], float],
        active: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self._values = values
        self.bytes = Counter(
            "pagefleet:kv_transfer_bytes",
            "KV bytes moved between prefill and decode pods, by direction (sent, received).",
            [*labels, "direction"],
            registry=registry,
        )
        self.blocks = Counter(
            "pagefleet:kv_transfer_blocks",
            "KV blocks moved between prefill and decode pods, by direction.",
            [*labels, "direction"],
            registry=registry,
        )
        self.seconds = Histogram(
            "pagefleet:kv_transfer_seconds",
            "Wall time of one KV pull, request to last byte verified (decode side).",
            labels,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=registry,
        ).labels(*values)
        self._failed = Counter(
            "pagefleet:kv_transfer_pulls_failed",
            "KV pulls that failed and fell back to local prefill, by reason.",
            [*labels, "reason"],
            registry=registry,
        )
        self._remote_prefill = Counter(
            "pagefleet:kv_transfer_requests",
            "Requests that carried kv_transfer_params, by outcome (pulled, local_hit, "
            "fallback, exported).",
            [*labels, "outcome"],
            registry=registry,
        )
        registry.register(_ExpiredCollector(labels, values, expired_total, active))

    def moved(self, direction: str, nbytes: int, nblocks: int) -> None:
        self.bytes.labels(*self._values, direction).inc(nbytes)
        self.blocks.labels(*self._values, direction).inc(nblocks)

    def failed(self, reason: str) -> None:
        self._failed.labels(*self._values, reason).inc()

    def outcome(self, outcome: str) -> None:
        self._remote_prefill.labels(*self._values, outcome).inc()


class _ExpiredCollector(Collector):
    """Handles expired and live, read from the engine's own registry at scrape time (never
    drifts)."""

    def __init__(
        self,
        labels: tuple[str, ...],
        values: list[str],
        total: Callable[[], float],
        active: Callable[[], float],
    ) -> None:
        self._labels, self._values, self._total, self._active = labels, values, total, active

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily(
            "pagefleet:kv_transfer_handles_expired",
            "Transfer handles freed at their deadline without being pulled.",
            labels=list(self._labels),
        )
        c.add_metric(self._values, float(self._total()))
        yield c
        g = GaugeMetricFamily(
            "pagefleet:kv_transfer_handles_active",
            "Transfer handles whose KV blocks are pinned, waiting to be pulled or released.",
            labels=list(self._labels),
        )
        g.add_metric(self._values, float(self._active()))
        yield g


class PullRequest(BaseModel):
    """Body of ``POST /v1/kv/pull``."""

    model_config = ConfigDict(extra="forbid")

    handle: str = Field(min_length=1, max_length=_MAX_HANDLE)
    first_block: int = Field(ge=0)
    num_blocks: int = Field(ge=1)
    # The keys the puller expects for the full blocks of the range: a mismatch is refused
    # before any byte moves (another model, another prompt, a forged handle).
    block_hashes: list[int | None]
    layout: dict[str, Any]
    # The chain key the puller expects for the prompt's partial last block when the range
    # holds it (``expected_tail_hash``): that block has no key of its own, so without this
    # a range of it alone is tied to no model, adapter or prompt. Required then: a pull
    # that does not name it is refused (409), as one that names another.
    tail_hash: int | None = None


def layout_dict(layout: Any) -> dict[str, Any]:
    return {
        "num_layers": layout.num_layers,
        "block_size": layout.block_size,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "dtype": layout.dtype,
    }


def expected_hashes(plan: Any) -> list[int | None]:
    """The key of each block a plan pulls (None where the prompt's block is partial)."""
    n_full = len(plan.block_hashes)
    return [
        plan.block_hashes[i] if i < n_full else None
        for i in range(plan.first_block, plan.num_blocks)
    ]


def expected_tail_hash(plan: Any) -> int | None:
    """The partial last block's chain key when a plan pulls that block, else None."""
    return plan.tail_hash if plan.num_blocks > len(plan.block_hashes) else None


def header_limit(plan: Any, layout: Any) -> int:
    """The most bytes a truthful pull header for ``plan`` takes: the layout and range in
    far less than 4 KiB, then one key per block and one token id per position, each a JSON
    integer of at most 20 digits (64 bits) or ``null``, and a comma."""
    return 4096 + 24 * plan.num_pull_blocks * (1 + layout.block_size)


def _json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` decoded as a JSON object; KVPullError("protocol") for anything else,
    including nesting past the decoder's depth (a RecursionError, not a ValueError)."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise KVPullError("protocol", f"the KV pull header is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise KVPullError(
            "protocol", f"the KV pull header is a JSON {type(obj).__name__}, not an object"
        )
    return obj


def check_header(header: dict[str, Any], plan: Any, layout: Any) -> None:
    """Raise KVPullError unless ``header`` describes exactly the blocks ``plan`` expects:
    same layout, same range, every key equal to this pod's chain, token ids equal to the
    prompt's (so the KV was computed from these tokens under this model's namespace)."""
    if header.get("layout") != layout_dict(layout):
        raise KVPullError(
            "layout_mismatch",
            f"the prefill pod's KV layout {header.get('layout')} differs from this pod's "
            f"{layout_dict(layout)}: different model or dtype",
        )
    if (header.get("first_block"), header.get("num_blocks")) != (
        plan.first_block,
        plan.num_pull_blocks,
    ):
        raise KVPullError("protocol", "the prefill pod sent another block range than asked")
    if header.get("block_hashes") != expected_hashes(plan):
        raise KVPullError(
            "hash_mismatch",
            "the pulled blocks' keys do not match this prompt's hash chain (another model, "
            "another prompt, or a forged handle)",
        )
    if header.get("tail_hash") != expected_tail_hash(plan):
        raise KVPullError(
            "hash_mismatch",
            "the pulled partial last block was computed under another model or adapter, or "
            "from another prompt (or the prefill pod predates tail_hash)",
        )
    bs = layout.block_size
    lo = plan.first_block * bs
    hi = min(plan.num_blocks * bs, len(plan.token_ids))
    if header.get("token_ids") != plan.token_ids[lo:hi]:
        raise KVPullError("hash_mismatch", "the pulled blocks were computed from other token ids")


class ReleaseRequest(BaseModel):
    """Body of ``POST /v1/kv/release``: the decode side will not pull ``handle``."""

    model_config = ConfigDict(extra="forbid")

    handle: str = Field(min_length=1, max_length=_MAX_HANDLE)


class WaitRequest(BaseModel):
    """Body of ``POST /v1/kv/wait``: answer when ``handle`` is exported or never will be."""

    model_config = ConfigDict(extra="forbid")

    handle: str = Field(min_length=1, max_length=_MAX_HANDLE)
    wait_s: float = Field(gt=0, le=600)


class KVTransfer(ABC):
    """Moves a prompt's KV blocks from a prefill pod into a decode pod's reservation."""

    name: str

    @abstractmethod
    async def release(self, params: KVTransferParams) -> bool:
        """Tell the prefill pod that holds ``params``' handle to free it now (this pod will
        not pull it). Best effort: True when the prefill pod freed it; never raises (the
        handle's deadline frees it otherwise)."""

    async def wait_ready(self, params: KVTransferParams, wait_s: float) -> None:
        """Return once the prefill pod has exported ``params``' handle (its prefill ran);
        KVPullError when it never will, cannot be reached, or ``wait_s`` passes."""
        raise KVPullError("unsupported", f"{type(self).__name__} cannot wait for a handle")

    @abstractmethod
    async def pull(
        self, params: KVTransferParams, plan: Any, layout: Any, into: Any = None
    ) -> PulledKV:
        """Fetch blocks ``plan.first_block .. plan.num_blocks - 1`` of the handle in
        ``params``: per layer K and V of ``[plan.num_pull_blocks, block_size,
        num_kv_heads, head_dim]``, verified against ``plan``. Raises KVPullError.

        ``into``: a ``KVStage`` (kv_stage.py) of the payload's size to land the bytes in
        (the result's ``buf`` is a view of it), so an engine in another process reads
        them from shared memory."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections."""


class TcpKVTransfer(KVTransfer):
    """Pull over HTTP/TCP from the prefill daemon's ``/v1/kv/pull`` (runs everywhere).

    ``api_key``: presented (``Authorization: Bearer``) on every call to a prefill pod, for
    prefill pods that require one; None sends no credentials."""

    name = "tcp"

    def __init__(
        self,
        timeout_s: float = 10.0,
        metrics: KVTransferMetrics | None = None,
        api_key: str | None = None,
    ):
        self.timeout_s = timeout_s
        self.metrics = metrics
        self._auth = bearer_header(api_key)
        self._warned_refused = False
        self._session: ClientSession | None = None

    def _refused(self, url: str) -> None:
        """A prefill pod answered 401: say once what to set (the request falls back to a
        local prefill, which would otherwise go unexplained, on every P/D request)."""
        if self._warned_refused:
            return
        self._warned_refused = True
        logger.warning(
            "the prefill pod refused this decode pod's KV call %s (401), so P/D requests "
            "prefill locally: %s",
            url, upstream_refused_hint("decode daemons", bool(self._auth)),
        )  # fmt: skip

    def _client(self) -> ClientSession:
        if self._session is None or self._session.closed:
            self._session = ClientSession(
                timeout=ClientTimeout(total=self.timeout_s, sock_connect=min(self.timeout_s, 3))
            )
        return self._session

    @staticmethod
    def _url(params: KVTransferParams, path: str) -> str:
        if not params.remote_host or not params.remote_port or not params.remote_request_id:
            raise KVPullError(
                "bad_params",
                "kv_transfer_params needs remote_host, remote_port and remote_request_id",
            )
        if len(params.remote_request_id) > _MAX_HANDLE:  # no request could carry it
            raise KVPullError(
                "bad_params",
                f"kv_transfer_params.remote_request_id has {len(params.remote_request_id)} "
                f"characters; a transfer handle has at most {_MAX_HANDLE}",
            )
        host = params.remote_host
        try:  # as the resolver will: a label over 63 characters or an empty one fails
            host.strip("[]").encode("idna")
        except UnicodeError:
            raise KVPullError(
                "bad_params", f"kv_transfer_params.remote_host {host[:80]!r} is no host name"
            ) from None
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6 literal
        return f"http://{host}:{params.remote_port}{path}"

    async def release(self, params: KVTransferParams) -> bool:
        try:
            url = self._url(params, RELEASE_PATH)
            body = ReleaseRequest(handle=params.remote_request_id or "").model_dump()
            async with asyncio.timeout(min(self.timeout_s, 2.0)):
                async with self._client().post(url, json=body, headers=self._auth) as resp:
                    if resp.status == 401:
                        self._refused(url)
                    return resp.status == 200
        except (KVPullError, TimeoutError, ClientError, OSError, ValueError) as exc:
            logger.debug("releasing KV handle %s failed: %s", params.remote_request_id, exc)
            return False

    async def wait_ready(self, params: KVTransferParams, wait_s: float) -> None:
        url = self._url(params, WAIT_PATH)
        body = WaitRequest(handle=params.remote_request_id or "", wait_s=wait_s).model_dump()
        try:
            # The pod answers 408 at ``wait_s``; a frozen one answers nothing, so the
            # slack past it (for that answer to arrive) is kept short.
            async with asyncio.timeout(wait_s + min(self.timeout_s, 1.0)):
                async with self._client().post(
                    url, json=body, headers=self._auth,
                    timeout=ClientTimeout(total=None, sock_connect=3.0),
                ) as resp:  # fmt: skip
                    if resp.status == 200:
                        return
                    # Only the start, to quote: the peer chooses how long the body is.
                    text = (await resp.content.read(4096)).decode(errors="replace")[:300]
        except TimeoutError:
            raise KVPullError("timeout", f"no KV handle at {url} within {wait_s}s") from None
        except (ClientError, OSError) as exc:
            raise KVPullError("unreachable", f"cannot wait for KV at {url}: {exc}") from None
        if resp.status == 401:
            self._refused(url)
        reason = {404: "not_found", 408: "timeout", 400: "bad_params"}.get(
            resp.status, f"http_{resp.status}"
        )
        raise KVPullError(reason, f"the prefill pod answered {resp.status}: {text}")

    async def pull(
        self, params: KVTransferParams, plan: Any, layout: Any, into: Any = None
    ) -> PulledKV:
        url = self._url(params, PULL_PATH)
        body = PullRequest(
            handle=params.remote_request_id,
            first_block=plan.first_block,
            num_blocks=plan.num_pull_blocks,
            block_hashes=expected_hashes(plan),
            layout=layout_dict(layout),
            tail_hash=expected_tail_hash(plan),
        ).model_dump_json()
        t0 = time.monotonic()
        resp = None
        try:
            async with asyncio.timeout(self.timeout_s):
                # The payload lands in ``into`` (or one buffer) straight from the socket.
                resp = await kv_wire.post(
                    params.remote_host or "", params.remote_port or 0, PULL_PATH,
                    body.encode(), min(self.timeout_s, 3.0), self._auth,
                )  # fmt: skip
                if resp.status == 401:
                    self._refused(url)
                if resp.status != 200:
                    raw = await resp.read_exactly(min(resp.remaining, 4096))
                    text = raw.decode(errors="replace")[:300]
                    reason = {404: "not_found", 409: "hash_mismatch", 400: "bad_params",
                              429: "busy"}.get(resp.status, f"http_{resp.status}")  # fmt: skip
                    raise KVPullError(reason, f"the prefill pod answered {resp.status}: {text}")
                (hlen,) = _HEADER_LEN.unpack(await resp.read_exactly(4))
                # Refused before its bytes are allocated: the peer chooses the length.
                if hlen > (limit := header_limit(plan, layout)):
                    raise KVPullError(
                        "protocol", f"a KV pull header of {hlen} bytes; one for this range "
                        f"takes at most {limit}"
                    )  # fmt: skip
                header = _json_object(await resp.read_exactly(hlen))
                check_header(header, plan, layout)
                lo, hi = header["layers"]
                if (lo, hi) != (0, layout.num_layers):
                    raise KVPullError("protocol", "partial layer ranges are not supported")
                shape = (plan.num_pull_blocks, layout.block_size, layout.num_kv_heads,
                         layout.head_dim)  # fmt: skip
                nbytes = plan.num_pull_blocks * layout.block_bytes_per_layer
                total = 2 * nbytes * (hi - lo)
                if resp.remaining != total:
                    raise KVPullError(
                        "protocol", f"the KV stream carries {resp.remaining} payload bytes, "
                        f"its header describes {total}"
                    )  # fmt: skip
                if into is not None and into.nbytes != total:
                    raise ValueError(f"a stage of {into.nbytes} bytes for {total}")
                buf = into.view() if into is not None else memoryview(bytearray(total))
                await resp.read_into(buf)
                out = PulledKV(buf, layout.dtype, shape, hi - lo)
        except KVPullError:
            raise
        except asyncio.IncompleteReadError as exc:
            raise KVPullError("protocol", f"the KV stream ended early: {exc}") from None
        except TimeoutError:
            raise KVPullError(
                "timeout", f"the KV pull from {url} took over {self.timeout_s}s"
            ) from None
        except OSError as exc:
            raise KVPullError("unreachable", f"cannot pull KV from {url}: {exc}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise KVPullError("protocol", f"malformed KV pull response: {exc}") from None
        finally:
            if resp is not None:
                resp.close()
        if self.metrics is not None:
            self.metrics.seconds.observe(time.monotonic() - t0)
            self.metrics.moved("received", 2 * nbytes * (hi - lo), plan.num_pull_blocks)
        return out

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class KVSource(ABC):
    """Where a prefill pod's exported KV is read: the engine in this process (``LocalKVSource``)
    or in the daemon's engine process (``engine_client.ClientKVSource``)."""

    @abstractmethod
    def layout(self) -> Any:
        """The engine's KVLayout (fixed once loaded)."""

    @abstractmethod
    async def acquire(self, handle: str) -> Any:
        """Start reading ``handle`` (an ExportedKV) or None; pair with ``release``.
        Cancel-safe: a cancelled acquire leaves no reader counted (a handle with readers
        never expires)."""

    @abstractmethod
    async def read_layer(self, block_ids: list[int], layer: int) -> tuple[Any, Any]:
        """K and V of ``block_ids`` in ``layer`` as bytes-like objects, C order."""

    @abstractmethod
    def release(self, handle: str, consumed: bool) -> None:
        """End a read started by ``acquire`` (never blocks; safe in a ``finally``)."""


class LocalKVSource(KVSource):
    """An engine in this process: its ``exports`` registry is thread-safe and its runner's
    ``read_kv_blocks`` reads pinned blocks from a worker thread, so a pull never waits for an
    engine step."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def layout(self) -> Any:
        return self.engine.runner.kv_layout()

    async def acquire(self, handle: str) -> Any:
        # No await: cancelled before it runs or not at all, so it is cancel-safe.
        return self.engine.exports.acquire(handle, time.monotonic())

    async def read_layer(self, block_ids: list[int], layer: int) -> tuple[Any, Any]:
        runner = self.engine.runner
        ((k, v),) = await asyncio.get_running_loop().run_in_executor(
            None, runner.read_kv_blocks, block_ids, range(layer, layer + 1)
        )
        return _bytes_view(k), _bytes_view(v)

    def release(self, handle: str, consumed: bool) -> None:
        self.engine.exports.release(handle, consumed=consumed)


class KVExportServer:
    """Serves ``POST /v1/kv/pull`` from a prefill engine's transfer handles.

    ``source()`` returns a KVSource, or a loaded engine (read in this process), or None
    while loading. ``release()`` asks the engine thread to free handles once their bytes
    are out.
    """

    def __init__(
        self,
        source: Callable[[], Any],
        release: Callable[[], None],
        metrics: KVTransferMetrics | None = None,
        stage_ttl_s: float = 30.0,
    ) -> None:
        self._source = source
        self._release = release
        self.metrics = metrics
        # Stages are reused (a new one per export cost ~17 ms of zero-fill and page faults
        # on the prefill core, as on the decode side: kv_stage.StagePool).
        self.stages = StagePool(keep=_MAX_STAGED)
        # Bytes of the stages gathered for pulls of handles not staged at export, at once:
        # each pull took one of its whole range, however many ran (a few slow decode pods
        # pulling many handles held as many stages). Beyond it a pull streams layer by layer.
        self.read_budget = ByteBudget(_READ_STAGING_BYTES)
        # Handle -> the stage its engine fills with every layer of its blocks as the prefill
        # finishes (``stage_export``), so that a pull never waits for a forward to gather
        # them; dropped after ``stage_ttl_s`` unpulled.
        self._staged: dict[str, _Staged] = {}
        self.stage_ttl_s = stage_ttl_s
        # The longest one pull may take to send (its handle is pinned meanwhile): as long as
        # a handle waits for its pull.
        self.send_timeout_s = stage_ttl_s
        # Handles waited for (``/v1/kv/wait``) or expected (their prefill is running), and
        # how recently settled ones ended (True: exported), for waits that come after.
        self._awaited: dict[str, _Awaited] = {}
        self._settled: dict[str, tuple[bool, float]] = {}
        # Handles released before anything was exported under them (a release and its
        # prefill request travel separately; the release may come first), with when: their
        # prefill, should it come, is never handed out (``expect`` keeps the outcome).
        self._released: dict[str, float] = {}
        self.unknown_grace_s = _UNKNOWN_GRACE_S
        self.max_remembered = _MAX_REMEMBERED
        # Pulls being served, by handle (``_MAX_PULLS_PER_HANDLE`` each at most).
        self._pulling: dict[str, int] = {}

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(PULL_PATH, self.pull)
        app.router.add_post(RELEASE_PATH, self.release)
        app.router.add_post(WAIT_PATH, self.wait)

    # -- handles announced before their prefill ends ----------------------------------------

    def in_use(self, handle: str) -> bool:
        """Whether ``handle`` names an export this pod runs, holds staged, or answered as
        exported within the settled record: a new export under it would clobber that one."""
        entry = self._awaited.get(handle)
        if entry is not None and entry.expected:
            return True
        return handle in self._staged or self._settled.get(handle, (False, 0.0))[0]

    def expect(self, handle: str) -> None:
        """``handle``'s prefill was admitted here: a wait for it waits for ``settle``.
        A handle released before (``release``) stays settled as never exported: its export
        is freed when its request ends instead of pinned for nobody."""
        if handle not in self._released:
            self._settled.pop(handle, None)
        entry = self._awaited.setdefault(handle, _Awaited(asyncio.Event(), time.monotonic()))
        entry.expected = True

    def settle(self, handle: str, exported: bool) -> None:
        """``handle``'s prefill ended: exported (pullable now) or not (failed, released).
        The first call counts; waits answer at once. Idempotent."""
        now = time.monotonic()
        if handle not in self._settled:
            self._settled[handle] = (exported, now)
        entry = self._awaited.pop(handle, None)
        if entry is not None:
            entry.event.set()
        self._forget_old(now)

    def _forget_old(self, now: float) -> None:
        """Forget outcomes and early releases older than _SETTLED_TTL_S, and the oldest
        beyond ``max_remembered``: both dicts are in insertion order, so the oldest are
        first (amortised O(1) a call)."""
        cutoff = now - max(_SETTLED_TTL_S, self.stage_ttl_s + 10.0)
        for record in (self._settled, self._released):
            while record:
                oldest = next(iter(record))
                when = record[oldest]
                at = when[1] if isinstance(when, tuple) else when
                if at >= cutoff and len(record) <= self.max_remembered:
                    break
                del record[oldest]

    async def wait(self, request: web.Request) -> web.Response:
        """Answer when a handle is exported (200) or never will be (404), or at ``wait_s``
        (408). A handle this pod has not heard of is waited for a short grace only (its
        prefill request is normally here first)."""
        try:
            req = WaitRequest.model_validate_json(await request.read())
        except ValidationError as exc:
            return _error(400, f"bad KV wait request: {exc.errors()[:3]}")
        t0 = time.monotonic()
        deadline = t0 + req.wait_s
        entry = None
        try:
            while req.handle not in self._settled:
                entry = self._awaited.get(req.handle)
                if entry is None:
                    entry = self._awaited[req.handle] = _Awaited(asyncio.Event(), t0)
                now = time.monotonic()
                grace = entry.since + self.unknown_grace_s
                end = deadline if entry.expected else min(deadline, grace)
                if now >= end:
                    break
                # Re-checked at least every 0.5 s: the handle may become expected meanwhile.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(end - now, 0.5)):
                        await entry.event.wait()
        finally:
            # Nobody announced it: forget the wait, also when its caller went away mid-wait
            # (else each such handle stayed in _awaited for the life of the pod).
            if entry is not None and not entry.expected and self._awaited.get(req.handle) is entry:
                del self._awaited[req.handle]
        settled = self._settled.get(req.handle)
        if settled is None:
            if time.monotonic() >= deadline:
                return _error(408, f"KV handle {req.handle!r} not ready within {req.wait_s}s")
            return _error(
                404, f"no transfer handle {req.handle!r} is being prefilled here; prefill locally"
            )
        if not settled[0]:
            return _error(404, f"the prefill of {req.handle!r} ended without a transfer handle")
        return web.json_response({"ready": req.handle})

    async def release(self, request: web.Request) -> web.Response:
        """Free a handle nobody will pull (its blocks are unpinned at the engine's next
        collect, posted now); a handle being read is freed when its read ends."""
        try:
            req = ReleaseRequest.model_validate_json(await request.read())
        except ValidationError as exc:
            return _error(400, f"bad KV release request: {exc.errors()[:3]}")
        src = self._kv_source()
        self._drop_staged(req.handle)
        # A decode pod waiting for it stops waiting (e.g. the gateway gave up its prefill).
        self.settle(req.handle, exported=False)
        if src is None or await src.acquire(req.handle) is None:
            if not self.exported(req.handle):
                # Its prefill may not have arrived yet: remembered, so that it is not
                # exported for nobody (``expect``). Pruned with the settled outcomes.
                self._released.pop(req.handle, None)
                self._released[req.handle] = now = time.monotonic()
                self._forget_old(now)
            return _error(404, f"no live transfer handle {req.handle!r}")
        src.release(req.handle, consumed=True)
        self._release()
        return web.json_response({"released": req.handle})

    # -- export stages: the gather off the pull's path --------------------------------------

    def stage_export(self, handle: str, nbytes: int, create: Callable[[int], Any]) -> Any:
        """A stage for the engine to fill with ``handle``'s prompt KV (``nbytes``) when its
        prefill finishes, or None (no shared memory, or ``_MAX_STAGED`` held already: the
        pull gathers on demand). Pending until ``staged(handle, True)``."""
        self.expire_staged()
        if handle in self._staged or len(self._staged) >= _MAX_STAGED:
            return None
        stage = self.stages.take(nbytes, create)
        if stage is not None:
            self._staged[handle] = _Staged(stage, time.monotonic())
        return stage

    def exported(self, handle: str) -> bool:
        """Whether ``handle`` settled as exported (its parameters were handed out)."""
        return self._settled.get(handle, (False, 0.0))[0]

    def forget_stage(self, handle: str) -> None:
        """Drop ``handle``'s export stage, if any: no pull will read it."""
        self._drop_staged(handle)

    def staged(self, handle: str, filled: bool) -> None:
        """The engine says whether it filled ``handle``'s stage (it never writes it after
        the request's finish reached this process)."""
        entry = self._staged.get(handle)
        if entry is None:
            return
        if filled:
            entry.filled = True
        else:
            self._drop_staged(handle)

    def _drop_staged(self, handle: str) -> None:
        entry = self._staged.pop(handle, None)
        if entry is not None:
            self._dispose(entry)

    def _dispose(self, entry: _Staged) -> None:
        if entry.filled:  # the engine is done with it
            self.stages.give_back(entry.stage)
        else:  # it may still write it (a request still running): never reused
            entry.stage.close()

    def expire_staged(self, now: float | None = None) -> None:
        """Drop the stages of handles nobody pulled within ``stage_ttl_s`` (the handles
        expired on the engine meanwhile, or their requests failed)."""
        now = time.monotonic() if now is None else now
        for handle in [h for h, e in self._staged.items() if now - e.since > self.stage_ttl_s]:
            self._drop_staged(handle)

    def close(self) -> None:
        """Close every staged and idle stage (daemon shutdown)."""
        while self._staged:
            self._staged.popitem()[1].stage.close()
        self.stages.close()

    def _kv_source(self) -> KVSource | None:
        src = self._source()
        if src is None or isinstance(src, KVSource):
            return src
        if getattr(src, "exports", None) is None:
            return None  # an engine that keeps no transfer handles
        return LocalKVSource(src)

    async def _read_stage(
        self, src: KVSource, ids: list[int], nbytes: int
    ) -> tuple[KVStage | None, int]:
        """A stage the engine process gathered ``ids`` into (``nbytes``) and the bytes of
        ``read_budget`` it holds (give them back with the stage); (None, 0): the pull reads
        layer by layer -- an engine in this process, no shared memory, or the budget held
        by other pulls. Never waits for the budget: the layer-by-layer path sends the same
        bytes, holding one layer at a time."""
        read_stage = getattr(src, "read_stage", None)
        need = -(-nbytes // self.stages.grain) * self.stages.grain  # the pool's rounding
        if read_stage is None or not self.read_budget.try_take(need):
            return None, 0
        try:
            stage = await read_stage(ids, self.stages)
        except BaseException:
            self.read_budget.give(need)
            raise
        if stage is None:
            self.read_budget.give(need)
            return None, 0
        return stage, need

    async def pull(self, request: web.Request) -> web.StreamResponse:
        try:
            req = PullRequest.model_validate_json(await request.read())
        except ValidationError as exc:
            return _error(400, f"bad KV pull request: {exc.errors()[:3]}")
        running = self._pulling.get(req.handle, 0)
        if running >= _MAX_PULLS_PER_HANDLE:
            return _error(
                429, f"{running} pulls of KV handle {req.handle!r} are under way already; "
                "prefill locally"
            )  # fmt: skip
        self._pulling[req.handle] = running + 1
        try:
            return await self._pull(req, request)
        finally:
            left = self._pulling.pop(req.handle) - 1
            if left:
                self._pulling[req.handle] = left

    async def _pull(self, req: PullRequest, request: web.Request) -> web.StreamResponse:
        raw = self._source()
        if raw is None:
            return _error(503, "the model is still loading")
        src = self._kv_source()
        if src is None:
            return _error(404, "this engine keeps no KV transfer handles")
        layout = src.layout()
        if req.layout != layout_dict(layout):
            return _error(
                409, f"KV layout mismatch: this pod has {layout_dict(layout)}, asked for "
                f"{req.layout}"
            )  # fmt: skip
        entry = await src.acquire(req.handle)
        if entry is None:
            return _error(
                404, f"no live transfer handle {req.handle!r}: already pulled, expired, or "
                "never created here; prefill locally"
            )  # fmt: skip
        consumed = False
        stage = None
        granted = 0  # bytes of ``read_budget`` the stage gathered for this pull holds
        try:
            end = req.first_block + req.num_blocks
            if end > len(entry.block_ids):
                return _error(
                    400, f"blocks {req.first_block}..{end - 1} asked, the handle has "
                    f"{len(entry.block_ids)}"
                )  # fmt: skip
            n_full = len(entry.block_hashes)
            have = [entry.block_hashes[i] if i < n_full else None
                    for i in range(req.first_block, end)]  # fmt: skip
            if have != req.block_hashes:
                return _error(409, "the handle's block keys differ from the ones expected")
            tail = entry.tail_hash if end > n_full else None
            if tail is not None and req.tail_hash != tail:
                return _error(
                    409, "the handle's partial last block has another tail_hash than the one "
                    "expected (another model, adapter or prompt, or a decode pod that "
                    "predates tail_hash): prefill locally"
                )  # fmt: skip
            bs = layout.block_size
            header = {
                "layout": layout_dict(layout),
                "layers": [0, layout.num_layers],
                "first_block": req.first_block,
                "num_blocks": req.num_blocks,
                "block_hashes": have,
                "tail_hash": tail,
                "token_ids": entry.token_ids[req.first_block * bs : end * bs],
            }
            ids = entry.block_ids[req.first_block : end]
            data = json.dumps(header, separators=(",", ":")).encode()
            # An engine in another process fills one shared-memory stage with every layer:
            # all of the handle's blocks as its prefill finished (``stage_export``), of
            # which the asked range is sent; else just the range's, gathered now.
            bpl = layout.block_bytes_per_layer
            count = len(entry.block_ids)
            staged = self._staged.pop(req.handle, None)
            if (
                staged is not None
                and staged.filled
                and staged.stage.nbytes == (2 * layout.num_layers * count * bpl)
            ):
                stage, first = staged.stage, req.first_block
            else:
                if staged is not None:
                    self._dispose(staged)
                nbytes = 2 * layout.num_layers * len(ids) * bpl
                stage, granted = await self._read_stage(src, ids, nbytes)
                first, count = 0, len(ids)
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            # A known length: the client reads a plain body, not chunked encoding.
            payload = 2 * layout.num_layers * len(ids) * bpl
            resp.content_length = _HEADER_LEN.size + len(data) + payload
            # A peer that stops reading would hold this write, and with it the handle (a
            # handle being read never expires), for as long as its connection lives.
            try:
                async with asyncio.timeout(self.send_timeout_s):
                    await resp.prepare(request)
                    await resp.write(_HEADER_LEN.pack(len(data)) + data)
                    sent = 0
                    if stage is not None:  # per layer K then V: the range is contiguous in each
                        view = stage.view()
                        part = count * bpl
                        lo, hi = first * bpl, (first + len(ids)) * bpl
                        spans = [(0, stage.nbytes)] if hi - lo == part else [
                            (i * part + lo, i * part + hi) for i in range(2 * layout.num_layers)
                        ]  # fmt: skip
                        for a, b in spans:
                            for off in range(a, b, _WRITE_CHUNK):
                                await resp.write(view[off : min(b, off + _WRITE_CHUNK)])
                                sent += min(b, off + _WRITE_CHUNK) - off
                        del view
                    else:
                        for layer in range(layout.num_layers):
                            for buf in await src.read_layer(ids, layer):
                                await resp.write(buf)
                                sent += len(buf)
                    await resp.write_eof()
            except TimeoutError:
                logger.warning(
                    "a pull of KV handle %r stalled for %.0fs (the peer stopped reading); "
                    "dropping its connection: the handle stays until its deadline",
                    req.handle, self.send_timeout_s,
                )  # fmt: skip
                if request.transport is not None:
                    request.transport.abort()
                return resp
            consumed = True
            if self.metrics is not None:
                self.metrics.moved("sent", sent, len(ids))
            return resp
        finally:
            if stage is not None:
                # Read only by this handler now, which is done with it: reused.
                self.stages.give_back(stage)
            if granted:
                self.read_budget.give(granted)
            src.release(req.handle, consumed=consumed)
            if consumed:
                self._release()


# Bytes per write of a staged payload: large enough that a pull is a few writes, small
# enough that the transport's buffer (a copy) stays bounded.
_WRITE_CHUNK = 4 << 20
# Export stages held at once (each a prompt's KV in tmpfs until pulled or expired).
_MAX_STAGED = 4
# Bytes of stages gathered at pull time (``KVExportServer.read_budget``), at once.
_READ_STAGING_BYTES = 1 << 30


@dataclass(slots=True)
class _Awaited:
    """A handle waited for or expected; ``event`` is set when it settles."""

    event: asyncio.Event
    since: float
    expected: bool = False


@dataclass(slots=True)
class _Staged:
    """A stage the engine fills (``filled``: it did) with one handle's blocks."""

    stage: KVStage
    since: float
    filled: bool = False


def _bytes_view(t: Any) -> memoryview:
    return memoryview(t.contiguous().view(-1).view(_uint8()).numpy())


def _uint8() -> Any:
    import torch

    return torch.uint8


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}},
        status=status,
    )
