"""Bearer API keys and a separate admin token, for the gateway and for a daemon exposed on
its own (aiohttp middleware).

Configuration (environment only, so no secret ever appears on a command line):

- ``PAGEFLEET_API_KEYS``: client keys, comma separated; ``PAGEFLEET_API_KEYS_FILE``: a file
  with one key per line (blank lines and ``#`` comments ignored). Both may be set.
- ``PAGEFLEET_ADMIN_TOKEN`` or ``PAGEFLEET_ADMIN_TOKEN_FILE``: the admin token, for the
  state-changing and introspection endpoints (``/reset_prefix_cache``, ``/get_server_info``).
- ``PAGEFLEET_UPSTREAM_API_KEY`` or ``PAGEFLEET_UPSTREAM_API_KEY_FILE``: the key presented
  to daemons that require one -- by the gateway on every request it sends a daemon (clients'
  keys are never forwarded), and by a decode daemon on its ``/v1/kv/*`` calls to a prefill
  daemon (``/v1/kv/*`` stays behind the client keys: KV bytes are tenant data). One Secret
  serves both.
- ``PAGEFLEET_KV_TRANSFER_SECRET`` or ``PAGEFLEET_KV_TRANSFER_SECRET_FILE``: the fleet's
  P/D secret, the same on every daemon and gateway of one fleet. A prefill daemon (and a
  gateway that names a handle itself) signs the ``kv_transfer_params`` it hands out with it
  (``TransferSigner``); a decode daemon with a secret refuses params it did not verify
  before it opens any connection: without it, whoever reaches a decode daemon chose the host
  it pulls from (and presents its upstream key to), and could plant K/V in its cache.

Invariants:
- keys live in memory only as SHA-256 digests; a presented key is hashed once and compared
  with ``hmac.compare_digest`` against every stored digest, without an early exit, so the
  time taken says nothing about which key (or how much of one) matched;
- ``/health``, ``/ready``, ``/metrics`` and ``/openapi.json`` never need a key;
- admin paths accept only the admin token, never a client key; with client keys but no
  admin token configured they are closed (403);
- with nothing configured every path is open, as before, and one warning says so.

Also the write deadline both servers put on their clients (``write_within``): a client that
stops reading is cut, never waited for.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

logger = logging.getLogger(__name__)

ENV_KEYS = "PAGEFLEET_API_KEYS"
ENV_KEYS_FILE = "PAGEFLEET_API_KEYS_FILE"
ENV_ADMIN = "PAGEFLEET_ADMIN_TOKEN"
ENV_ADMIN_FILE = "PAGEFLEET_ADMIN_TOKEN_FILE"
ENV_UPSTREAM = "PAGEFLEET_UPSTREAM_API_KEY"
ENV_UPSTREAM_FILE = "PAGEFLEET_UPSTREAM_API_KEY_FILE"
ENV_KV_SECRET = "PAGEFLEET_KV_TRANSFER_SECRET"
ENV_KV_SECRET_FILE = "PAGEFLEET_KV_TRANSFER_SECRET_FILE"
# Bumped when the signed message changes: a daemon never accepts a signature of another.
_TRANSFER_MAC_VERSION = "pagefleet-kv-transfer-v1"

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/openapi.json"})
ADMIN_PATHS = frozenset({"/reset_prefix_cache", "/get_server_info", "/server_info"})


def upstream_key_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """The key sent to daemons (by the gateway, and by a daemon to another daemon's
    ``/v1/kv/*``), or None (daemons without keys)."""
    env = os.environ if env is None else env
    key = env.get(ENV_UPSTREAM, "").strip()
    if not key and env.get(ENV_UPSTREAM_FILE):
        lines = _read_lines(env[ENV_UPSTREAM_FILE])
        key = lines[0] if lines else ""
    return key or None


def kv_secret_from_env(env: Mapping[str, str] | None = None) -> bytes | None:
    """The fleet's P/D transfer secret (``ENV_KV_SECRET``, else the first line of
    ``ENV_KV_SECRET_FILE``), or None: params are then neither signed nor checked."""
    env = os.environ if env is None else env
    secret = env.get(ENV_KV_SECRET, "").strip()
    if not secret and env.get(ENV_KV_SECRET_FILE):
        lines = _read_lines(env[ENV_KV_SECRET_FILE])
        if not lines:
            raise ValueError(f"{ENV_KV_SECRET_FILE}={env[ENV_KV_SECRET_FILE]} holds no secret")
        secret = lines[0]
    return secret.encode("utf-8") if secret else None


@dataclass(slots=True, frozen=True)
class TransferClaims:
    """What a decode pod acts on in ``kv_transfer_params``, as signed: the handle, where to
    pull it, the prefill engine and its block ids (None when not known yet: a gateway names
    the handle before its prefill ran), the KV namespace (the model, the same on every pod
    of one fleet) and when the signature expires (unix seconds). Anything else in the params
    is not covered: the prompt's own hash chain still checks what the pulled bytes are."""

    handle: str
    host: str
    port: int
    engine_id: str | None
    block_ids: list[int] | None
    namespace: str
    expires_at: int

    def message(self) -> bytes:
        return json.dumps(
            [_TRANSFER_MAC_VERSION, self.handle, self.host, self.port, self.engine_id,
             self.block_ids, self.namespace, self.expires_at],
            separators=(",", ":"),
        ).encode("utf-8")  # fmt: skip


@dataclass(slots=True, frozen=True)
class TransferSigner:
    """HMAC-SHA256 of ``TransferClaims`` under the fleet's secret, as hex."""

    secret: bytes

    def sign(self, claims: TransferClaims) -> str:
        return hmac.new(self.secret, claims.message(), hashlib.sha256).hexdigest()

    def verify(self, claims: TransferClaims, signature: str) -> bool:
        """Whether ``signature`` is this secret's over ``claims`` (constant-time compare)."""
        want = self.sign(claims).encode()
        return hmac.compare_digest(want, signature.encode("utf-8", "replace"))


def bearer_header(key: str | None) -> dict[str, str]:
    """The ``Authorization`` header a request to a daemon carries: ``Bearer <key>``, or
    none without a key."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def upstream_refused_hint(component: str, key_sent: bool) -> str:
    """Why a daemon answered 401 to ``component``'s call and what to set (logged once)."""
    why = "the key it sends is not one they accept" if key_sent else "it sends no key"
    return (
        f"{why}: set {ENV_UPSTREAM} (or {ENV_UPSTREAM_FILE}) on the {component} to a key "
        f"listed in the daemons' {ENV_KEYS}"
    )


class ClientWriteTimeout(ConnectionResetError):
    """A client left written bytes unread past the write timeout; its connection is cut."""


async def write_within(
    request: web.Request,
    resp: web.StreamResponse,
    data: bytes | None,
    limit_s: float,
    flag: str = "--client-write-timeout",
) -> None:
    """Write ``data`` to the client (None: end the response; ``resp`` is prepared first when
    it is not yet). A write the client does not take within ``limit_s`` (its socket buffers
    are full: it stopped reading) aborts the connection, unsent bytes and all, and raises
    ClientWriteTimeout, a ConnectionResetError as for a client that hung up. ``flag``: the
    setting the error names.

    Why: aiohttp's write waits for a slow client without a bound, so a client that kept its
    socket open but read nothing held the handler, its answer and its connection forever."""
    try:
        async with asyncio.timeout(limit_s):
            if not resp.prepared:
                await resp.prepare(request)
            if data is None:
                await resp.write_eof()
            else:
                await resp.write(data)
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()  # its unsent bytes go too: nothing waits on them
        raise ClientWriteTimeout(f"the client took no bytes for {limit_s:.0f}s ({flag})") from None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _read_lines(path: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the key file {path}: {exc.strerror}") from None
    return [
        ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]


@dataclass(slots=True, frozen=True)
class Credentials:
    """Digests of the client keys and of the admin token (empty: not configured)."""

    client: tuple[bytes, ...] = ()
    admin: tuple[bytes, ...] = ()

    @classmethod
    def from_keys(cls, client: Iterable[str] = (), admin: str | None = None) -> Credentials:
        keys = [k for k in client if k]
        return cls(
            client=tuple(_digest(k) for k in keys),
            admin=(_digest(admin),) if admin else (),
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Credentials:
        """Read the ``PAGEFLEET_*`` variables; raises ValueError naming an unreadable file."""
        env = os.environ if env is None else env
        keys = [k.strip() for k in env.get(ENV_KEYS, "").split(",") if k.strip()]
        if env.get(ENV_KEYS_FILE):
            keys += _read_lines(env[ENV_KEYS_FILE])
        admin = env.get(ENV_ADMIN, "").strip() or None
        if admin is None and env.get(ENV_ADMIN_FILE):
            lines = _read_lines(env[ENV_ADMIN_FILE])
            admin = lines[0] if lines else None
        if env.get(ENV_KEYS_FILE) and not keys:
            raise ValueError(f"{ENV_KEYS_FILE}={env[ENV_KEYS_FILE]} holds no key")
        return cls.from_keys(keys, admin)

    @property
    def enabled(self) -> bool:
        return bool(self.client or self.admin)

    @staticmethod
    def _matches(presented: bytes, digests: tuple[bytes, ...]) -> bool:
        ok = False
        for d in digests:  # no early exit: every digest is compared
            ok |= hmac.compare_digest(presented, d)
        return ok

    def is_client(self, key: str) -> bool:
        return self._matches(_digest(key), self.client)

    def is_admin(self, key: str) -> bool:
        return self._matches(_digest(key), self.admin)


def _error(status: int, message: str, code: str) -> web.Response:
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    }
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    return web.Response(
        status=status, text=json.dumps(body), content_type="application/json", headers=headers
    )


def _bearer(request: web.Request) -> str | None:
    value = request.headers.get("Authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(slots=True)
class AuthPolicy:
    """Which paths need what; ``middleware`` enforces it on an aiohttp app."""

    credentials: Credentials
    component: str = "server"
    open_paths: frozenset[str] = OPEN_PATHS
    admin_paths: frozenset[str] = ADMIN_PATHS
    _warned: bool = field(default=False)

    def warn_if_open(self) -> None:
        """Log once when anyone who reaches the port may use the API."""
        if self._warned:
            return
        self._warned = True
        if not self.credentials.client:
            logger.warning(
                "%s: no API keys configured (%s / %s): every client that reaches this port "
                "is served",
                self.component,
                ENV_KEYS,
                ENV_KEYS_FILE,
            )

    def check(self, path: str, token: str | None) -> web.Response | None:
        """None when the request may proceed, else the 401/403 response to send."""
        creds = self.credentials
        if path in self.open_paths or not creds.enabled:
            return None
        if path in self.admin_paths:
            if not creds.admin:
                return _error(
                    403,
                    f"{path} needs the admin token and none is configured; set "
                    f"{ENV_ADMIN} or {ENV_ADMIN_FILE} on this server",
                    "admin_token_not_configured",
                )
            if token is None or not creds.is_admin(token):
                return _error(
                    401,
                    f"{path} needs the admin token: send 'Authorization: Bearer <admin token>'",
                    "invalid_admin_token",
                )
            return None
        if not creds.client:
            return None
        if token is None:
            return _error(
                401,
                "missing API key: send 'Authorization: Bearer <key>'",
                "invalid_api_key",
            )
        if not creds.is_client(token) and not creds.is_admin(token):
            return _error(401, "incorrect API key provided", "invalid_api_key")
        return None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        refused = self.check(request.path, _bearer(request))
        if refused is not None:
            return refused
        return await handler(request)
