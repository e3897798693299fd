"""Every setting of a replica, read from the environment into one type.

`Settings.from_env()` is the only place the layer reads the environment;
docs/operations.md has the table of variables (and `tests/mcp_ha/test_settings.py`
holds the table and this type equal). A setting that cannot work is refused at
start-up with `SettingsError`, naming the variable.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import cast
from urllib.parse import urlsplit

from .session_store import (
    DEFAULT_EVENT_TTL_SECONDS,
    DEFAULT_MAX_BYTES_PER_HOLDER,
    DEFAULT_MAX_LOG_BYTES,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_MAX_SESSIONS_PER_HOLDER,
    DEFAULT_MAX_STATE_BYTES,
    DEFAULT_OP_TTL_SECONDS,
    DEFAULT_TTL_SECONDS,
)

AUTH_MODES = ("none", "static", "jwt")
LOG_FORMATS = ("json", "text")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class SettingsError(ValueError):
    """A setting cannot work; the message names the variable and says why."""


# The settings that must be above 0: each a bound or a duration.
POSITIVE = (
    "max_body_bytes",
    "max_record_bytes",
    "max_listen_streams",
    "max_listens_per_client",
    "max_event_bytes",
    "max_log_bytes",
    "max_state_bytes",
    "max_sessions",
    "max_sessions_per_client",
    "max_bytes_per_client",
    "session_idle_seconds",
    "max_transports_per_client",
    "max_calls_per_session",
    "max_calls_per_client",
    "max_queued_calls_per_client",
    "fair_share_calls",
    "max_request_items",
    "max_request_depth",
    "max_replays_per_session",
    "max_replays",
    "abandoned_call_seconds",
    "sse_retry_ms",
    "task_redelivery_seconds",
    "task_ttl_seconds",
    "max_tasks_per_client",
    "max_task_result_bytes",
    "max_task_argument_bytes",
)


def _check_request_state_keys(keys: Sequence[str]) -> None:
    for n, key in enumerate(keys, start=1):
        if len(key.encode()) < MIN_REQUEST_STATE_KEY_BYTES:
            raise SettingsError(
                f"REQUEST_STATE_KEYS: key {n} is shorter than {MIN_REQUEST_STATE_KEY_BYTES} bytes "
                '(make one with: python -c "import secrets; print(secrets.token_hex(32))")'
            )
    if len(set(keys)) != len(keys):
        raise SettingsError("REQUEST_STATE_KEYS: a key stands in the ring twice")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """One replica's settings. Each field's `env` metadata names its variable."""

    instance_id: str = field(default="mcp-server-1", metadata={"env": "INSTANCE_ID"})
    host: str = field(default="127.0.0.1", metadata={"env": "HOST"})
    port: int = field(default=8000, metadata={"env": "PORT"})
    session_ttl_seconds: int = field(default=DEFAULT_TTL_SECONDS, metadata={"env": "SESSION_TTL_SECONDS"})
    event_ttl_seconds: int = field(default=DEFAULT_EVENT_TTL_SECONDS, metadata={"env": "EVENT_TTL_SECONDS"})
    op_ttl_seconds: int = field(default=DEFAULT_OP_TTL_SECONDS, metadata={"env": "OP_TTL_SECONDS"})
    redis_url: str = field(default="", metadata={"env": "REDIS_URL"})
    redis_sentinels: tuple[tuple[str, int], ...] = field(default=(), metadata={"env": "REDIS_SENTINELS"})
    redis_cluster_nodes: tuple[tuple[str, int], ...] = field(default=(), metadata={"env": "REDIS_CLUSTER_NODES"})
    redis_master_name: str = field(default="mymaster", metadata={"env": "REDIS_MASTER_NAME"})
    redis_username: str | None = field(default=None, metadata={"env": "REDIS_USERNAME"})
    redis_password: str | None = field(default=None, repr=False, metadata={"env": "REDIS_PASSWORD"})
    redis_sentinel_username: str | None = field(default=None, metadata={"env": "REDIS_SENTINEL_USERNAME"})
    redis_sentinel_password: str | None = field(default=None, repr=False, metadata={"env": "REDIS_SENTINEL_PASSWORD"})
    redis_wait_replicas: int = field(default=0, metadata={"env": "REDIS_WAIT_REPLICAS"})
    redis_retry_seconds: float = field(default=4.0, metadata={"env": "REDIS_RETRY_SECONDS"})
    log_format: str = field(default="json", metadata={"env": "LOG_FORMAT"})
    log_level: str = field(default="info", metadata={"env": "LOG_LEVEL"})
    metrics: bool = field(default=True, metadata={"env": "METRICS"})
    auth: str = field(default="none", metadata={"env": "MCP_AUTH"})
    # Static tokens: token -> the principal's name.
    auth_tokens: Mapping[str, str] = field(default_factory=dict, repr=False, metadata={"env": "MCP_AUTH_TOKENS"})
    auth_jwks_url: str = field(default="", metadata={"env": "MCP_AUTH_JWKS_URL"})
    auth_issuer: str = field(default="", metadata={"env": "MCP_AUTH_ISSUER"})
    auth_audience: str = field(default="", metadata={"env": "MCP_AUTH_AUDIENCE"})
    auth_algorithm: str = field(default="RS256", metadata={"env": "MCP_AUTH_ALGORITHM"})
    auth_required_scopes: tuple[str, ...] = field(default=(), metadata={"env": "MCP_AUTH_REQUIRED_SCOPES"})
    # The ring sealing 2026-07-28 request state, the same on every replica: the first seals, all unseal.
    request_state_keys: tuple[str, ...] = field(default=(), repr=False, metadata={"env": "REQUEST_STATE_KEYS"})
    request_state_ttl_seconds: float = field(default=600.0, metadata={"env": "REQUEST_STATE_TTL_SECONDS"})
    # The largest request body the MCP endpoint takes, however it is sent (HAProxy's HAPROXY_MAX_BODY_BYTES).
    max_body_bytes: int = field(default=1_048_576, metadata={"env": "MAX_BODY_BYTES"})
    # The most a session-era client's clientInfo and capabilities may take, kept in its record.
    max_record_bytes: int = field(default=4096, metadata={"env": "MAX_SESSION_RECORD_BYTES"})
    # Open `subscriptions/listen` streams one replica serves at once.
    max_listen_streams: int = field(default=1024, metadata={"env": "MAX_LISTEN_STREAMS"})
    # Of those, the most one client (its principal, else its address) holds on one replica.
    max_listens_per_client: int = field(default=64, metadata={"env": "MAX_LISTEN_STREAMS_PER_CLIENT"})
    # The largest event a session's event log keeps (a larger answer is kept as an error saying to call again).
    max_event_bytes: int = field(default=64 * 1024, metadata={"env": "MAX_EVENT_BYTES"})
    # What a session's event log keeps, in bytes: its latest events.
    max_log_bytes: int = field(default=DEFAULT_MAX_LOG_BYTES, metadata={"env": "MAX_SESSION_LOG_BYTES"})
    # A session's state, in bytes of JSON text: a write past it is a tool error.
    max_state_bytes: int = field(default=DEFAULT_MAX_STATE_BYTES, metadata={"env": "MAX_SESSION_STATE_BYTES"})
    # Live sessions and handles, in all and per client (its principal, or its address when unauthenticated).
    max_sessions: int = field(default=DEFAULT_MAX_SESSIONS, metadata={"env": "MAX_SESSIONS"})
    max_sessions_per_client: int = field(
        default=DEFAULT_MAX_SESSIONS_PER_HOLDER, metadata={"env": "MAX_SESSIONS_PER_CLIENT"}
    )
    # Everything the store keeps for one client (state, op and call records, claims, records, event logs).
    max_bytes_per_client: int = field(default=DEFAULT_MAX_BYTES_PER_HOLDER, metadata={"env": "MAX_CLIENT_BYTES"})
    # A replica forgets an idle session's transport after this; adoption brings it back on its next request.
    session_idle_seconds: float = field(default=5.0, metadata={"env": "SESSION_IDLE_SECONDS"})
    # Session transports one client holds on one replica: past it, its least recently used idle one is forgotten.
    max_transports_per_client: int = field(default=256, metadata={"env": "MAX_TRANSPORTS_PER_CLIENT"})
    # Calls (JSON-RPC requests) in flight on one replica, per session and per client.
    max_calls_per_session: int = field(default=16, metadata={"env": "MAX_CALLS_PER_SESSION"})
    max_calls_per_client: int = field(default=64, metadata={"env": "MAX_CALLS_PER_CLIENT"})
    # A call past either bound waits this long for a place before its 429 (0: refused at once), and at most
    # this many of one client's calls wait on one replica at once.
    call_queue_seconds: float = field(default=10.0, metadata={"env": "CALL_QUEUE_SECONDS"})
    max_queued_calls_per_client: int = field(default=64, metadata={"env": "MAX_QUEUED_CALLS_PER_CLIENT"})
    # Calls in flight on one replica that the clients active there share: while others are active too, a
    # client's next call waits (as one past a bound) until it has fewer than this / their number in flight.
    fair_share_calls: int = field(default=8, metadata={"env": "FAIR_SHARE_CALLS"})
    # A request body's JSON: keys and array elements in all, and how deep it nests.
    max_request_items: int = field(default=10_000, metadata={"env": "MAX_REQUEST_ITEMS"})
    max_request_depth: int = field(default=32, metadata={"env": "MAX_REQUEST_DEPTH"})
    # Streams being resumed (GET with Last-Event-ID) at once: per session, and on one replica.
    max_replays_per_session: int = field(default=8, metadata={"env": "MAX_REPLAYS_PER_SESSION"})
    max_replays: int = field(default=256, metadata={"env": "MAX_REPLAYS"})
    # A streamed call nobody reads (its client's connection closed, no resumed stream reading it) this long
    # is cancelled.
    abandoned_call_seconds: float = field(default=30.0, metadata={"env": "ABANDONED_CALL_SECONDS"})
    # FastMCP's own variable, read here so the layer reads the environment in one place: unset, the kit
    # turns FastMCP's OpenTelemetry spans off (replica.py).
    fastmcp_telemetry_mode: str | None = field(default=None, metadata={"env": "FASTMCP_TELEMETRY_MODE"})
    # The SSE `retry:` field: how soon a client whose stream broke reconnects to resume it, in ms.
    sse_retry_ms: int = field(default=1000, metadata={"env": "SSE_RETRY_MS"})
    # Durable tasks (tasks.py): a task whose replica stopped renewing it is run again elsewhere after this.
    task_redelivery_seconds: float = field(default=4.0, metadata={"env": "TASK_REDELIVERY_SECONDS"})
    # How long a finished task (its status and result) is kept for `tasks/get`.
    task_ttl_seconds: int = field(default=900, metadata={"env": "TASK_TTL_SECONDS"})
    # Tasks not yet finished one client (its principal, else its address) may have.
    max_tasks_per_client: int = field(default=16, metadata={"env": "MAX_TASKS_PER_CLIENT"})
    # The largest result a task may keep, in bytes of its JSON.
    max_task_result_bytes: int = field(default=256 * 1024, metadata={"env": "MAX_TASK_RESULT_BYTES"})
    # The largest arguments a task may keep (with its context, for its life), in bytes of their JSON.
    max_task_argument_bytes: int = field(default=64 * 1024, metadata={"env": "MAX_TASK_ARGUMENT_BYTES"})

    def __post_init__(self) -> None:
        if self.port <= 0 or self.port > 65535:
            raise SettingsError(f"PORT={self.port}: expected 1-65535")
        for name in ("session_ttl_seconds", "event_ttl_seconds", "op_ttl_seconds"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{_env(name)}={getattr(self, name)}: expected a positive number of seconds")
        for name in POSITIVE:
            if getattr(self, name) <= 0:
                raise SettingsError(f"{_env(name)}={getattr(self, name)}: expected a positive number")
        if self.redis_cluster_nodes and (self.redis_url or self.redis_sentinels):
            raise SettingsError(
                "REDIS_CLUSTER_NODES is set, and so is REDIS_URL or REDIS_SENTINELS: set one (Redis Cluster, one "
                "Redis, or Sentinel)"
            )
        if self.redis_wait_replicas < 0:
            raise SettingsError(f"REDIS_WAIT_REPLICAS={self.redis_wait_replicas}: expected 0 or more")
        if not self.call_queue_seconds >= 0:
            raise SettingsError(f"CALL_QUEUE_SECONDS={self.call_queue_seconds}: expected 0 or more seconds")
        if self.redis_retry_seconds < 0:
            raise SettingsError(f"REDIS_RETRY_SECONDS={self.redis_retry_seconds}: expected 0 or more")
        if self.log_format not in LOG_FORMATS:
            raise SettingsError(f"LOG_FORMAT={self.log_format!r}: expected one of {', '.join(LOG_FORMATS)}")
        if self.log_level not in LOG_LEVELS:
            raise SettingsError(f"LOG_LEVEL={self.log_level!r}: expected one of {', '.join(LOG_LEVELS)}")
        if self.request_state_ttl_seconds <= 0:
            raise SettingsError(
                f"REQUEST_STATE_TTL_SECONDS={self.request_state_ttl_seconds}: expected a positive number"
            )
        _check_request_state_keys(self.request_state_keys)
        if self.auth not in AUTH_MODES:
            raise SettingsError(f"MCP_AUTH={self.auth!r}: expected one of {', '.join(AUTH_MODES)}")

    @property
    def uses_redis(self) -> bool:
        return bool(self.redis_url or self.redis_sentinels or self.redis_cluster_nodes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """The settings the environment gives; SettingsError, naming the variable, for one that cannot work."""
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = environ.get(f.metadata["env"])
            if raw is None or not raw.strip():
                continue  # empty is unset
            if f.name == "auth_tokens" and environ.get("MCP_AUTH", "").strip().lower() != "static":
                continue  # read only where they are used
            values[f.name] = _parse(f.name, f.type, raw)
        return cls(**values)  # type: ignore[arg-type]


def _env(name: str) -> str:
    return next(cast(str, f.metadata["env"]) for f in fields(Settings) if f.name == name)


def _parse(name: str, kind: object, raw: str) -> object:
    var = _env(name)
    text = raw.strip()
    if name in ("redis_sentinels", "redis_cluster_nodes"):
        return addresses(var, text)
    if name == "auth_tokens":
        return static_tokens(text)
    if name == "request_state_keys":
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if name == "auth_required_scopes":
        return tuple(part for part in text.replace(",", " ").split() if part)
    if name in ("auth", "log_format", "log_level"):
        return text.lower()
    if name in ("redis_password", "redis_sentinel_password"):
        return raw  # a password is kept as given
    if name == "redis_url":
        return redis_url(var, text)
    if kind in ("int", int):
        try:
            return int(text)
        except ValueError:
            raise SettingsError(f"{var}={raw!r}: expected a whole number") from None
    if kind in ("float", float):
        try:
            number = float(text)
        except ValueError:
            raise SettingsError(f"{var}={raw!r}: expected a number") from None
        if not math.isfinite(number):  # nan passes every comparison's check, inf every bound's
            raise SettingsError(f"{var}={raw!r}: expected a finite number")
        return number
    if kind in ("bool", bool):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"{var}={raw!r}: expected on or off")
    return text


REDIS_URL_SCHEMES = ("redis", "rediss", "unix")


def redis_url(var: str, text: str) -> str:
    """REDIS_URL as redis-py reads it: redis://[user:password@]host[:port][/db], rediss:// or unix://."""
    try:
        url = urlsplit(text)
        port = url.port  # a port that is not a number or out of range raises
    except ValueError as exc:
        raise SettingsError(f"{var}: {exc} (expected redis://host:port/db)") from None
    if url.scheme not in REDIS_URL_SCHEMES:
        # Not echoed: a URL may carry a password.
        raise SettingsError(f"{var}: expected redis://host:port/db (or rediss://, unix://), got no such scheme")
    if url.scheme != "unix" and not url.hostname:
        raise SettingsError(f"{var}: expected redis://host:port/db, got no host")
    del port
    return text


def addresses(var: str, raw: str) -> tuple[tuple[str, int], ...]:
    """REDIS_SENTINELS or REDIS_CLUSTER_NODES, "host:port,host:port", as (host, port) pairs."""
    found = []
    for item in filter(None, (part.strip() for part in raw.split(","))):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise SettingsError(f"{var}={raw!r}: expected host:port[,host:port...], got {item!r}")
        found.append((host, int(port)))
    return tuple(found)


MIN_TOKEN_LENGTH = 16
# The SDK's AES-GCM codec derives its key from at least this much secret.
MIN_REQUEST_STATE_KEY_BYTES = 32


def static_tokens(raw: str) -> dict[str, str]:
    """MCP_AUTH_TOKENS, "name:token,name:token", as token -> name."""
    tokens: dict[str, str] = {}
    for n, item in enumerate(filter(None, (part.strip() for part in raw.split(","))), start=1):
        name, sep, token = item.partition(":")
        if not sep or not name or not token:
            # Named by position: the entry itself may be a bare token, and a start-up error is logged.
            raise SettingsError(f"MCP_AUTH_TOKENS: entry {n} is not name:token (expected name:token[,name:token...])")
        if len(token) < MIN_TOKEN_LENGTH:
            raise SettingsError(
                f"MCP_AUTH_TOKENS: the token for {name!r} is shorter than {MIN_TOKEN_LENGTH} characters"
            )
        if token in tokens:
            raise SettingsError(f"MCP_AUTH_TOKENS: {name!r} and {tokens[token]!r} share a token")
        tokens[token] = name
    return tokens
