"""How daemons and gateways authenticate to the index's Redis, without the password in argv.

A command line is readable by every local user (``ps``, /proc/<pid>/cmdline) and is copied
into pod specs, logs and shell histories, so the password comes from the environment or a
file (a mounted Kubernetes Secret), never from ``--redis-url``:

``PAGEFLEET_REDIS_USERNAME``       ACL user (Redis 6+); default: the URL's user, else ``default``
``PAGEFLEET_REDIS_PASSWORD``       password
``PAGEFLEET_REDIS_PASSWORD_FILE``  file whose content (trailing newline stripped) is the password
``PAGEFLEET_REDIS_CA_FILE``        CA bundle that verifies a ``rediss://`` server

A URL that still carries a password works, with a warning.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

logger = logging.getLogger(__name__)

# Redis ACL rules of the two users (after `user NAME on >PASSWORD`): keys under pf:* only,
# nothing dangerous (FLUSHALL, CONFIG, KEYS, DEBUG...); the gateway's user only reads and
# runs scripts, whose writes Redis then refuses, and shares placements with the other
# gateway replicas on pf:* pub/sub channels (gateway/shared_placements.py). The chart's
# bundled Redis ships exactly these (a test compares), docs/operator.md shows them.
DAEMON_ACL_RULES = (
    "~pf:* resetchannels -@all +@read +@write +@connection +evalsha +eval +script|load +time "
    "-@dangerous"
)
GATEWAY_ACL_RULES = (
    "~pf:* resetchannels &pf:* -@all +@read +@connection +evalsha +script|load +time "
    "+publish +subscribe +unsubscribe -@dangerous"
)

USERNAME_ENV = "PAGEFLEET_REDIS_USERNAME"
PASSWORD_ENV = "PAGEFLEET_REDIS_PASSWORD"
PASSWORD_FILE_ENV = "PAGEFLEET_REDIS_PASSWORD_FILE"
CA_FILE_ENV = "PAGEFLEET_REDIS_CA_FILE"


@dataclass(frozen=True, slots=True)
class RedisCredentials:
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a log line
    ca_file: str | None = None

    def client_kwargs(self, url: str) -> dict[str, Any]:
        """Keyword arguments for ``redis.Redis.from_url(url, ...)`` (they win over the URL)."""
        out: dict[str, Any] = {}
        if self.username:
            out["username"] = self.username
        if self.password is not None:
            out["password"] = self.password
        if self.ca_file and url.startswith("rediss://"):
            out["ssl_ca_certs"] = self.ca_file
            out["ssl_cert_reqs"] = "required"
        return out


def credentials_from_env(environ: Mapping[str, str] | None = None) -> RedisCredentials:
    """Credentials from the environment (see the module docstring). A password file that
    cannot be read is an error naming the variable, not a silent unauthenticated start."""
    env = os.environ if environ is None else environ
    password = env.get(PASSWORD_ENV) or None
    path = env.get(PASSWORD_FILE_ENV)
    if path:
        try:
            password = Path(path).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(
                f"{PASSWORD_FILE_ENV}={path}: cannot read the Redis password: {exc}"
            ) from exc
    return RedisCredentials(
        username=env.get(USERNAME_ENV) or None,
        password=password,
        ca_file=env.get(CA_FILE_ENV) or None,
    )


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs and error messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[-1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def split_password(url: str) -> tuple[str, str | None]:
    """(``url`` without its password, the password or None): lets a launcher move a
    password given in a URL into the environment before it starts child processes."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    host = parts.netloc.rsplit("@", 1)[-1]
    netloc = f"{parts.username}@{host}" if parts.username else host
    return urlunsplit(parts._replace(netloc=netloc)), unquote(parts.password)


def warn_if_password_in_url(url: str, flag: str = "--redis-url") -> None:
    if urlsplit(url).password is not None:
        logger.warning(
            "%s %s carries a password, visible to every local user in the process list; "
            "pass it in %s or %s instead",
            flag,
            redact(url),
            PASSWORD_ENV,
            PASSWORD_FILE_ENV,
        )
