"""The whole stack as plain local processes, with docker-compose-like verbs.

    mcp-ha stack up -d               redis, mcp-server-1..3, haproxy (MCP_BALANCERS=2: haproxy-2 beside it,
                                     one port, one session table); returns when all are healthy
    mcp-ha stack up -d --server jobs_server
                                     the replicas run `python -m jobs_server` from your project: the
                                     current folder, or --project DIR
    mcp-ha stack up -d --redis sentinel
                                     redis-1 (primary at start), redis-2 (its replica) and
                                     sentinel-1..3 instead of one redis
    mcp-ha stack ps [--json]         each service's pid, address and state; the replicas' module and project
    mcp-ha stack stop|start|restart NAME...
    mcp-ha stack kill [-s SIGNAL] NAME...
    mcp-ha stack logs [-f] NAME
    mcp-ha stack down                stops everything it started, by pid

From the kit's checkout, `python stack.py ...` is the same command. No Docker:
redis-server and haproxy come from the distribution, the replicas are
`python -m server` (the kit's demo) or the module --server names, run by the
interpreter that ran `up`, in the project folder (their cwd, and first on their
PYTHONPATH), so a module of your project and the mcp_ha installed beside that
interpreter are what they import.

The stack dir holds what `up` started, with each process's pid and start time,
so later commands signal exactly the processes this tool started and nothing
that merely reuses a pid; and what a replica needs to start again: module,
project, interpreter, and the environment `up` ran in (less the stack's own
secrets, STACK_SECRETS), in state.json, readable by this user only. So
`restart`, `stop`/`start` and `ps` work from any shell and give a replica
exactly what it had at `up`. Every command finds the stack dir by, in order:
--stack-dir DIR (before the verb: `mcp-ha stack --stack-dir DIR ps`),
STACK_DIR, or .stack in the current folder (for `up --project DIR`, in DIR);
`up` prints it. The tests drive the same `Stack` class on free ports.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import datetime
import fcntl
import io
import ipaddress
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, TypedDict, TypeVar, Unpack, cast

import click
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from rich.console import Console
from rich.table import Table

from ..settings import Settings, SettingsError

# HAProxy's config and Lua: the checkout's haproxy/ (one file for the stack, compose and Kubernetes),
# which the wheel carries as mcp_ha/haproxy/.
_PACKAGE = Path(__file__).resolve().parents[1]  # mcp_ha/, above this wing
HAPROXY_DIR = _PACKAGE / "haproxy" if (_PACKAGE / "haproxy").is_dir() else _PACKAGE.parent / "haproxy"
# How HAProxy runs, in the foreground, with that config (its settings in its environment: haproxy_env).
HAPROXY_ARGV = ("haproxy", "-db", "-f", str(HAPROXY_DIR / "haproxy.cfg"))
# HAProxy's per-address limits (haproxy/haproxy.cfg has the same defaults): requests per 10 s, and
# open connections. Both well above what the tests and benchmarks send from their one address.
DEFAULT_RATE_LIMIT = 30_000
# HAProxy processes a stack runs side by side at most: haproxy.cfg names three peers.
MAX_BALANCERS = 3
DEFAULT_MAX_CONN_PER_SOURCE = 500
# Redis's maxmemory in the local stack and compose.
DEFAULT_REDIS_MAXMEMORY = "256mb"
STOP_GRACE_SECONDS = 15.0
# The name the sentinels know the primary by (the replicas' REDIS_MASTER_NAME).
SENTINEL_MASTER = "mymaster"
HEALTH_TIMEOUT_SECONDS = 30.0

# Redis's users. `default` is the admin (stack.py's own checks, redis-cli);
# the replicas connect as REDIS_KIT_USER, which may run exactly the commands
# stores/redis_store.py sends, its Lua scripts' included (Redis checks those
# against the caller's ACL too), on the kit's keys only: a leaked replica
# password cannot read other data, flush, list keys, reconfigure or replicate.
# (redis-py's CLIENT SETINFO on connect is left out: Redis 7.0 has no such
# command, and redis-py carries on when it is refused.)
REDIS_KIT_USER = "mcp"
# +info: the replicas read INFO memory to report how near Redis is to its maxmemory.
_KIT_COMMANDS = (
    "+time +expire +zadd +zremrangebyscore +zcard +hget +hset +hincrby +hgetall +hkeys +hmget "
    "+hexists +hdel +hstrlen +exists +zscore +zrem +get +set +lindex +rpush +lpop +lrange "
    "+publish +subscribe +unsubscribe +zrange +pttl +llen"
)
_TASKS_COMMANDS = (
    "+multi +exec +discard +evalsha +script|load "
    "+del +setex +mget +pexpire +ttl +sadd +srem +smembers +zcount +zrangebyscore +xadd +xack +xdel +xlen "
    "+xrange +xread +xreadgroup +xautoclaim +xclaim +xgroup|create +psubscribe +punsubscribe"
)
REDIS_KIT_ACL = (
    f"resetkeys ~mcp:* resetchannels &mcp:* -@all +ping +info +fcall +wait {_KIT_COMMANDS} "
    # Durable tasks (tasks.py): Docket, under mcp:tasks, may do more there and only there (an ACL selector):
    # its Lua (EVALSHA after SCRIPT LOAD), streams, sets, and the cancellation channels it subscribes to by
    # pattern, which Redis matches against the ACL's channel patterns literally.
    f"(~mcp:tasks:* &mcp:tasks:* &mcp:tasks:cancel:* {_TASKS_COMMANDS})"
)
# Sentinel's connections to the servers (`sentinel auth-user`): what Sentinel
# needs to watch the servers, announce itself and reconfigure them in a failover.
REDIS_SENTINEL_USER = "sentinel"
REDIS_SENTINEL_ACL = (
    "resetkeys resetchannels &__sentinel__:hello -@all +multi +exec +slaveof +ping +info +role "
    "+config|rewrite +client|setname +client|kill +script|kill +publish +subscribe"
)
# A replica's connection to its primary (`masteruser`): replication only.
REDIS_REPLICATION_USER = "replication"
REDIS_REPLICATION_ACL = "resetkeys resetchannels -@all +psync +replconf +ping"
# On Redis Cluster the kit's user also learns the slot map and follows a slot being moved, redis-py
# asks COMMAND when it connects, and the feeds are sharded pub/sub (redis_cluster.py).
# Docket names its keys and channels {mcp:tasks}:... there (one slot), outside ~mcp:*: its selector allows
# what the kit's own commands do there too, and EVAL (its pipelines send their Lua whole) and PEXPIREAT.
REDIS_KIT_CLUSTER_ACL = (
    f"resetkeys ~mcp:* resetchannels &mcp:* -@all +ping +info +fcall +wait {_KIT_COMMANDS} "
    "+cluster|slots +command +asking +spublish +ssubscribe +sunsubscribe "
    f"(~{{mcp:tasks}}:* &{{mcp:tasks}}:* &{{mcp:tasks}}:cancel:* {_KIT_COMMANDS} {_TASKS_COMMANDS} +eval +pexpireat)"
)
# How many Redis servers `--redis cluster` runs: three primaries, each with a replica.
CLUSTER_NODES = 6
# The kit's user on the sentinels: asking for the primary, nothing that changes them.
REDIS_SENTINEL_KIT_ACL = "-@all +ping +sentinel|masters +sentinel|get-master-addr-by-name"
# What a Redis password may hold: printable ASCII but space, quotes and
# backslash. Sentinel writes its passwords back into sentinel.conf unquoted
# (CONFIG REWRITE), where a space breaks the file at the next start and a
# newline would start a line of its own: a user, say, with no password.
# Such a password needs no quoting, so the config files below hold them as they are.
REDIS_PASSWORD_FORM = re.compile(r"[!#-&(-\[\]-~]+")
# Passwords the stack generates unless set in the environment, kept in the
# stack dir (REDIS_SECRETS_FILE) across down and up with the Redis data and
# config files that need them: StackConfig field -> variable.
REDIS_SECRETS = {
    "redis_admin_password": "REDIS_ADMIN_PASSWORD",
    "redis_password": "REDIS_PASSWORD",
    "redis_sentinel_auth_password": "REDIS_SENTINEL_AUTH_PASSWORD",
    "redis_replication_password": "REDIS_REPLICATION_PASSWORD",
}
REDIS_SECRETS_FILE = "redis-secrets.json"
# REDIS_MAXMEMORY: a size as Redis reads one (bytes, or with k, kb, m, mb, g, gb).
REDIS_MEMORY_FORM = re.compile(r"[1-9][0-9]*(?:[kmg]b?|b)?", re.IGNORECASE)
# Secrets a shell may hold for stack.py itself, never handed on with the rest
# of its environment: each service gets what it needs in Service.env (the
# replicas the kit's Redis user, not the admin; HAProxy no Redis password at
# all), so a compromised replica does not find the admin password in its own
# environment.
STACK_SECRETS = {*REDIS_SECRETS.values(), "HAPROXY_STATS_PASSWORD", "MCP_AUTH_TOKENS", "REQUEST_STATE_KEYS"}

# The line of a dead process's log that says why: a Python exception, or `python -m`'s own
# "python: No module named x", which comes without one.
EXIT_CAUSE = re.compile(r"[\w.]+(?:Error|Exception)\b|.*\bNo module named ")
MISSING_MODULE = re.compile(r"No module named '?([\w.]+)'?")

INSTALL_HINT = {
    "redis-server": "apt-get install redis-server (make demo installs it)",
    "haproxy": "apt-get install haproxy (make demo installs it)",
}


class StackError(Exception):
    """Something the user has to fix; the message says what."""


def shell_environment() -> dict[str, str]:
    """This shell's environment less the stack's own secrets: what every service starts from."""
    return {name: value for name, value in os.environ.items() if name not in STACK_SECRETS}


def new_secret() -> str:
    return secrets.token_urlsafe(18)


def write_private(path: Path, text: str | bytes) -> None:
    """Write a file only this user can read (it holds a password or a key), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)
    tmp.replace(path)


def ensure_certificate(cert: Path, pem: Path, host: str, *, days: int = 365) -> None:
    """A self-signed certificate for `host` and localhost, made once per stack dir (again once it nears expiry).

    No CA: the certificate is its own trust anchor, so a client trusts
    exactly this stack (`cert`), and nothing else is signed by what it
    trusts. `pem` holds it with its key, for HAProxy, readable by this user only.
    """
    now = datetime.datetime.now(datetime.UTC)
    if cert.exists() and pem.exists():
        current = x509.load_pem_x509_certificate(cert.read_bytes())
        if current.not_valid_after_utc - now > datetime.timedelta(days=1):
            return
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mcp-ha-kit local stack")])
    subject_key = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(host))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_encipherment=False,
                content_commitment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(subject_key, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(subject_key), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_bytes = certificate.public_bytes(serialization.Encoding.PEM)
    key_bytes = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_private(pem, cert_bytes + key_bytes)
    cert.write_bytes(cert_bytes)


def env_int(name: str, default: int, *, low: int = 0, high: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise StackError(f"{name}={raw!r} is not a whole number") from None
    if value < low or (high is not None and value > high):
        raise StackError(
            f"{name}={raw!r}: expected {low} or more" if high is None else f"{name}={raw!r}: expected {low}-{high}"
        )
    return value


def env_port(name: str, default: int, *, after: int = 0) -> int:
    """A port, or the first of `after` + 1 consecutive ones."""
    return env_int(name, default, low=1, high=65535 - after)


class StackOptions(TypedDict, total=False):
    """StackConfig fields `on_free_ports` passes on as given."""

    rate_limit: int
    max_conn_per_source: int
    max_body_bytes: int
    allowed_origins: str
    auth: dict[str, str]
    server: str
    project: Path
    redis_maxmemory: str


class RedisAuth(TypedDict):
    """Credentials on Redis, as RedisSessionStore's keyword arguments."""

    username: str
    password: str


class SentinelAuth(TypedDict):
    """Credentials on the sentinels, as RedisSessionStore's keyword arguments."""

    sentinel_username: str
    sentinel_password: str


@dataclass(frozen=True)
class StackConfig:
    state_dir: Path = Path(".stack")
    host: str = "127.0.0.1"
    http_port: int = 8080
    # HAProxy's TLS port, with a self-signed certificate the stack generates (tls_cert).
    https_port: int = 8443
    # HAProxy: one process per entry, all on http_port and https_port (SO_REUSEPORT: the kernel spreads
    # new connections over those alive), each with its own stats port; with more than one, each tells
    # the others every session it learns, on its peer port (haproxy.cfg, peers). One unless asked
    # (MCP_BALANCERS=2): the kernel spreads one client's connections over both, and a session whose
    # requests reach both in the instant after it opens can be adopted twice (docs/deploy.md).
    stats_ports: tuple[int, ...] = (8404,)
    peer_ports: tuple[int, ...] = (8410,)
    redis_port: int = 6380
    replica_ports: tuple[int, ...] = (8001, 8002, 8003)
    session_ttl_seconds: int = 1800
    python: str = sys.executable
    # "single": one redis. "sentinel": redis-1 (primary at start, on
    # redis_port), redis-2 (replica) and three sentinels electing a new primary.
    redis_mode: str = "single"
    redis_replica_port: int = 6381
    sentinel_ports: tuple[int, ...] = (26380, 26381, 26382)
    # "cluster": redis-1..6, a Redis Cluster of three primaries with a replica each, each node on its
    # port and its cluster bus on the one beside it in cluster_bus_ports (never port + 10000 unasked).
    cluster_ports: tuple[int, ...] = tuple(range(7100, 7106))
    cluster_bus_ports: tuple[int, ...] = tuple(range(7110, 7116))
    # Replicas' REDIS_WAIT_REPLICAS: how many Redis replicas acknowledge a write before a call does.
    redis_wait_replicas: int = 0
    # HAProxy's stats page and /metrics: a password of this stack's own unless
    # HAPROXY_STATS_PASSWORD is set, recorded with the rest of the config so
    # later commands, the tests and the benchmarks can read the stats.
    stats_user: str = "stats"
    stats_password: str = field(default_factory=new_secret, repr=False)
    # Redis refuses unauthenticated clients: `default` is the admin, the
    # replicas connect as REDIS_KIT_USER (see REDIS_KIT_ACL), and with
    # Sentinel the sentinels and the replica link have users of their own.
    redis_user: str = REDIS_KIT_USER
    redis_admin_password: str = field(default_factory=new_secret, repr=False)
    redis_password: str = field(default_factory=new_secret, repr=False)
    redis_sentinel_auth_password: str = field(default_factory=new_secret, repr=False)
    redis_replication_password: str = field(default_factory=new_secret, repr=False)
    # HAProxy's HAPROXY_RATE_LIMIT (requests per 10 s per client address),
    # HAPROXY_MAX_CONN_PER_SOURCE (open connections per client address),
    # HAPROXY_MAX_BODY_BYTES and HAPROXY_ALLOWED_ORIGINS (space-separated).
    rate_limit: int = DEFAULT_RATE_LIMIT
    max_conn_per_source: int = DEFAULT_MAX_CONN_PER_SOURCE
    max_body_bytes: int = 1_048_576
    allowed_origins: str = ""
    # The replicas' MCP_AUTH* settings (mcp_ha/auth.py), e.g. {"MCP_AUTH": "static",
    # "MCP_AUTH_TOKENS": "alice:…"}; none: authentication off.
    auth: dict[str, str] = field(default_factory=dict, repr=False)
    # The module each replica runs (`python -m MODULE`): the kit's demo server, or
    # any server made with mcp_ha (MCP_SERVER_MODULE, `up --server`).
    server: str = "server"
    # The folder `server` is found in (the cwd at `up`, or `up --project`): the replicas' cwd and the
    # first entry of their PYTHONPATH.
    project: Path = field(default_factory=Path.cwd)
    # The environment `up` ran in (shell_environment), which every service starts from again whichever
    # shell restarts it; recorded in the state file, this user's only.
    env: dict[str, str] = field(default_factory=shell_environment, repr=False)
    # The replicas' REQUEST_STATE_KEYS: one ring for all of them, so a 2026-07-28 multi-round-trip
    # request may take its legs to any replica (mcp_ha/request_state.py). This stack's own unless set.
    request_state_keys: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    # Redis's maxmemory (REDIS_MAXMEMORY), with maxmemory-policy noeviction: at the bound
    # Redis refuses writes, which the replicas answer as clear errors, and never evicts a
    # live session's state to make room.
    redis_maxmemory: str = DEFAULT_REDIS_MAXMEMORY

    def __post_init__(self) -> None:
        if not 1 <= len(self.stats_ports) == len(self.peer_ports) <= MAX_BALANCERS:
            raise StackError(f"MCP_BALANCERS={len(self.stats_ports)}: between 1 and {MAX_BALANCERS} are supported")
        if not REDIS_MEMORY_FORM.fullmatch(self.redis_maxmemory):
            raise StackError(f"REDIS_MAXMEMORY={self.redis_maxmemory!r}: a size such as 256mb or 1gb")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", self.server):
            raise StackError(f"MCP_SERVER_MODULE={self.server!r}: a module name, e.g. examples.cart.server")
        for name, variable in REDIS_SECRETS.items():
            if not REDIS_PASSWORD_FORM.fullmatch(getattr(self, name)):
                raise StackError(
                    f"{variable}: use printable ASCII without spaces, quotes or backslashes "
                    "(Sentinel writes its passwords back into its config file as they are)"
                )

    @classmethod
    def from_env(
        cls,
        *,
        redis_mode: str = "single",
        server: str | None = None,
        project: Path | None = None,
        state_dir: Path | None = None,
    ) -> StackConfig:
        """The stack configured from this shell's environment, serving `server` (else MCP_SERVER_MODULE, else the
        kit's demo) from `project` (else the cwd), recorded in `state_dir` (else STACK_DIR, else the project's
        .stack)."""
        replicas = env_int("MCP_REPLICAS", 3)
        if not 1 <= replicas <= 9:
            raise StackError(f"MCP_REPLICAS={replicas}: between 1 and 9 replicas are supported")
        base = env_port("MCP_BASE_PORT", 8001, after=replicas - 1)
        balancers = env_int("MCP_BALANCERS", 1, low=1)
        stats = env_port("MCP_STATS_PORT", 8404, after=balancers - 1)
        peers = env_port("MCP_PEER_BASE_PORT", 8410, after=balancers - 1)
        project = (project or Path.cwd()).resolve()
        state_dir = Path(state_dir or os.environ.get("STACK_DIR") or project / ".stack").resolve()
        try:
            kept = json.loads((state_dir / REDIS_SECRETS_FILE).read_text())
        except FileNotFoundError:
            kept = {}
        redis_secrets = {
            name: os.environ.get(var) or kept.get(name) or new_secret() for name, var in REDIS_SECRETS.items()
        }
        return cls(
            state_dir=state_dir,
            http_port=env_port("MCP_HTTP_PORT", 8080),
            https_port=env_port("MCP_HTTPS_PORT", 8443),
            stats_ports=tuple(stats + i for i in range(balancers)),
            peer_ports=tuple(peers + i for i in range(balancers)),
            redis_port=env_port("REDIS_PORT", 6380),
            replica_ports=tuple(base + i for i in range(replicas)),
            session_ttl_seconds=env_int("SESSION_TTL_SECONDS", 1800, low=1),
            redis_mode=redis_mode,
            redis_replica_port=env_port("REDIS_REPLICA_PORT", 6381),
            sentinel_ports=tuple(env_port("SENTINEL_BASE_PORT", 26380, after=2) + i for i in range(3)),
            cluster_ports=tuple(
                env_port("REDIS_CLUSTER_BASE_PORT", 7100, after=10 + CLUSTER_NODES) + i for i in range(CLUSTER_NODES)
            ),
            cluster_bus_ports=tuple(
                env_port("REDIS_CLUSTER_BASE_PORT", 7100, after=10 + CLUSTER_NODES) + 10 + i
                for i in range(CLUSTER_NODES)
            ),
            redis_wait_replicas=env_int("REDIS_WAIT_REPLICAS", 0),
            stats_user=os.environ.get("HAPROXY_STATS_USER") or "stats",
            stats_password=os.environ.get("HAPROXY_STATS_PASSWORD") or new_secret(),
            request_state_keys=os.environ.get("REQUEST_STATE_KEYS") or secrets.token_hex(32),
            **redis_secrets,
            rate_limit=env_int("HAPROXY_RATE_LIMIT", DEFAULT_RATE_LIMIT, low=1),
            max_conn_per_source=env_int("HAPROXY_MAX_CONN_PER_SOURCE", DEFAULT_MAX_CONN_PER_SOURCE, low=1),
            max_body_bytes=env_int("HAPROXY_MAX_BODY_BYTES", 1_048_576, low=1),
            allowed_origins=" ".join(os.environ.get("HAPROXY_ALLOWED_ORIGINS", "").replace(",", " ").split()),
            auth={name: value for name, value in os.environ.items() if name.startswith("MCP_AUTH")},
            server=server or os.environ.get("MCP_SERVER_MODULE") or "server",
            project=project,
            env=shell_environment(),
            redis_maxmemory=os.environ.get("REDIS_MAXMEMORY") or DEFAULT_REDIS_MAXMEMORY,
        )

    @classmethod
    def on_free_ports(
        cls,
        state_dir: Path,
        *,
        replicas: int = 3,
        redis_mode: str = "single",
        redis_wait_replicas: int = 0,
        balancers: int = 1,
        **haproxy: Unpack[StackOptions],
    ) -> StackConfig:
        """A stack beside any other: for tests and benchmarks that start their own.

        `balancers`: how many HAProxy processes (one unless a test is about the pair).
        `haproxy`: rate_limit, max_conn_per_source, max_body_bytes, allowed_origins (the defaults otherwise), and
        `auth`, the replicas' MCP_AUTH* settings (and `server`, the module the replicas run, from `project`).
        """
        http, https, redis, redis_replica, *rest = free_ports(7 + replicas + 2 * balancers + 2 * CLUSTER_NODES)
        stats, peers, rest = rest[:balancers], rest[balancers : 2 * balancers], rest[2 * balancers :]
        cluster, rest = rest[: 2 * CLUSTER_NODES], rest[2 * CLUSTER_NODES :]
        return cls(
            state_dir=state_dir,
            http_port=http,
            https_port=https,
            stats_ports=tuple(stats),
            peer_ports=tuple(peers),
            redis_port=redis,
            replica_ports=tuple(rest[3:]),
            redis_mode=redis_mode,
            redis_replica_port=redis_replica,
            sentinel_ports=tuple(rest[:3]),
            cluster_ports=tuple(cluster[:CLUSTER_NODES]),
            cluster_bus_ports=tuple(cluster[CLUSTER_NODES:]),
            redis_wait_replicas=redis_wait_replicas,
            **haproxy,
        )

    @property
    def sentinels(self) -> str:
        """The replicas' REDIS_SENTINELS."""
        return ",".join(f"{self.host}:{port}" for port in self.sentinel_ports)

    def redis_names(self) -> list[str]:
        if self.redis_mode == "sentinel":
            return ["redis-1", "redis-2", "sentinel-1", "sentinel-2", "sentinel-3"]
        if self.redis_mode == "cluster":
            return [f"redis-{i}" for i in range(1, CLUSTER_NODES + 1)]
        return ["redis"]

    @property
    def cluster_nodes(self) -> str:
        """The replicas' REDIS_CLUSTER_NODES."""
        return ",".join(f"{self.host}:{port}" for port in self.cluster_ports)

    @property
    def redis_url(self) -> str:
        return f"redis://{self.host}:{self.redis_port}/0"

    @property
    def redis_auth(self) -> RedisAuth:
        """The replicas' credentials, as RedisSessionStore's keyword arguments."""
        return {"username": self.redis_user, "password": self.redis_password}

    @property
    def sentinel_auth(self) -> SentinelAuth:
        """The replicas' credentials on the sentinels (the same user there), as RedisSessionStore's arguments."""
        return {"sentinel_username": self.redis_user, "sentinel_password": self.redis_password}

    @property
    def redis_cli_env(self) -> dict[str, str]:
        """The environment for `redis-cli` as the admin: the password in REDISCLI_AUTH, not argv (`ps` shows argv)."""
        return {**os.environ, "REDISCLI_AUTH": self.redis_admin_password}

    @property
    def mcp_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/mcp"

    @property
    def mcp_https_url(self) -> str:
        return f"https://{self.host}:{self.https_port}/mcp"

    @property
    def tls_cert(self) -> Path:
        """The stack's self-signed certificate: what a client trusts to reach mcp_https_url."""
        return self.state_dir / "tls" / "cert.pem"

    @property
    def tls_pem(self) -> Path:
        """Certificate and private key in one file, for HAProxy; readable by this user only."""
        return self.state_dir / "tls" / "haproxy.pem"

    @property
    def stats_port(self) -> int:
        """The first HAProxy's stats port."""
        return self.stats_ports[0]

    @property
    def stats_url(self) -> str:
        return self.stats_url_of("haproxy")

    def stats_url_of(self, balancer: str) -> str:
        return f"http://{self.host}:{self.stats_ports[self.balancer_names().index(balancer)]}/stats"

    def balancer_names(self) -> list[str]:
        """The HAProxy services: haproxy, then haproxy-2 and haproxy-3 when there are more."""
        return ["haproxy", *(f"haproxy-{i}" for i in range(2, len(self.stats_ports) + 1))]

    @property
    def stats_auth(self) -> tuple[str, str]:
        return self.stats_user, self.stats_password

    def replica_names(self) -> list[str]:
        return [f"mcp-server-{i}" for i in range(1, len(self.replica_ports) + 1)]

    def haproxy_env(self, http_port: int, https_port: int, servers: Sequence[int]) -> dict[str, str]:
        """haproxy.cfg's environment with this stack's settings, on `http_port` and `https_port` (with the
        stack's certificate), in front of the servers on `servers`, ports of this host. A process adds its
        own HAPROXY_STATS_BIND, and peers when it is one of a pair. The benchmark's floor takes it too, so
        it pays for the same rules."""
        env = {
            "HAPROXY_BIND": f"{self.host}:{http_port}",
            "SESSION_TTL_SECONDS": str(self.session_ttl_seconds),
            "HAPROXY_STATS_USER": self.stats_user,
            "HAPROXY_STATS_PASSWORD": self.stats_password,
            "HAPROXY_RATE_LIMIT": str(self.rate_limit),
            "HAPROXY_MAX_CONN_PER_SOURCE": str(self.max_conn_per_source),
            "HAPROXY_MAX_BODY_BYTES": str(self.max_body_bytes),
            "HAPROXY_ALLOWED_ORIGINS": self.allowed_origins,
            "HAPROXY_LUA_DIR": str(HAPROXY_DIR),
            "HAPROXY_TLS_BIND": f"{self.host}:{https_port}",
            "HAPROXY_TLS_CERT": str(self.tls_pem),
        }
        for i, port in enumerate(servers, start=1):
            env[f"MCP_SERVER_{i}"] = f"{self.host}:{port}"
        return env

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["state_dir"] = str(self.state_dir)
        data["project"] = str(self.project)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StackConfig:
        # A stack recorded before HAProxy came in pairs ran one, with no peers.
        old_stats = data.pop("stats_port", None)
        return cls(
            **{
                **data,
                "stats_ports": tuple(data.get("stats_ports") or [old_stats]),
                "peer_ports": tuple(data.get("peer_ports") or [0]),
                "state_dir": Path(data["state_dir"]),
                # A stack recorded before projects were: its replicas ran in the cwd, and env is the shell's.
                "project": Path(data.get("project") or Path.cwd()),
                "replica_ports": tuple(data["replica_ports"]),
                "sentinel_ports": tuple(data["sentinel_ports"]),
                "cluster_ports": tuple(data.get("cluster_ports") or StackConfig.cluster_ports),
                "cluster_bus_ports": tuple(data.get("cluster_bus_ports") or StackConfig.cluster_bus_ports),
            }
        )


@dataclass
class Service:
    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    # A config file written before the first start and kept afterwards:
    # Sentinel rewrites its own, and the Redis servers' after a failover, so
    # a restarted server keeps its current role.
    config_file: tuple[Path, str] | None = None
    # False: written afresh at every start instead (nothing rewrites it, and
    # so a changed password or ACL takes effect).
    config_kept: bool = True
    # Where it runs: a replica in the project it serves, the rest in the stack dir (None).
    cwd: Path | None = None

    @property
    def binary(self) -> str:
        return self.argv[0]


@dataclass
class ServiceState:
    name: str
    pid: int | None
    address: str
    state: str  # running, paused, exited, stopped
    # A replica's: the module it runs and the folder it runs it from.
    module: str | None = None
    project: str | None = None


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state letter, start time in clock ticks) of a process, or None if there is none."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name may contain spaces and parentheses; fields after it don't.
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], fields[19]


def _reaped(pid: int) -> bool:
    """Collect a zombie if it is this process's child; whether it is gone for good.

    A multi-threaded process (haproxy) shows as a zombie while its other
    threads are still exiting, and cannot be collected until they have.
    """
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True  # someone else's zombie: gone as far as we are concerned


# Where processes handing out ports at once (parallel test workers, a bench beside them) note each port
# they hand out, and for how long no other takes it: long enough for its server to bind it.
PORTS_NOTED = Path(tempfile.gettempdir()) / f"mcp-ha-ports-{os.getuid()}"
PORTS_HELD_SECONDS = 120.0
LOWEST_PORT = 10000
_random = random.SystemRandom()  # not the global generator: a test may seed that one, in every worker alike


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' source ports."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 65535


def free_ports(count: int) -> list[int]:
    """Loopback ports nobody listens on, none handed out on this machine in the last PORTS_HELD_SECONDS.

    Drawn from outside the kernel's ephemeral range: an outgoing connection (a client's, HAProxy's, a
    replica's) takes its source port from that range, and could take a port the kernel handed out here
    before the server it was meant for binds it ("address already in use", seen with tests in parallel).
    """
    low, high = _ephemeral_ports()
    candidates = [range(LOWEST_PORT, low), range(high + 1, 65536)]
    if sum(len(r) for r in candidates) < 1000:
        raise RuntimeError(f"too few ports outside the ephemeral range {low}-{high} to hand out")
    with open(PORTS_NOTED, "a+") as noted:
        fcntl.flock(noted, fcntl.LOCK_EX)  # released when the file closes
        noted.seek(0)
        now = time.time()
        held: dict[int, float] = {}
        for line in noted.read().split():
            number, _, until = line.partition("@")
            with contextlib.suppress(ValueError):
                if float(until) > now:
                    held[int(number)] = float(until)
        chosen: list[int] = []
        for _ in range(100 * count):  # bounded: a port in use or held is drawn again
            if len(chosen) == count:
                break
            port = _random.choice(_random.choice([r for r in candidates if r]))
            if port not in held and port_is_free("127.0.0.1", port, reuse=False):
                held[port] = now + PORTS_HELD_SECONDS
                chosen.append(port)
        if len(chosen) < count:
            raise RuntimeError(f"found {len(chosen)} of {count} free loopback ports")
        noted.seek(0)
        noted.truncate()
        noted.write("".join(f"{port}@{until:.1f}\n" for port, until in held.items()))
    return chosen


def port_is_free(host: str, port: int, *, reuse: bool = True) -> bool:
    """Whether a server could bind `port` now; `reuse=False`: and no connection lingers on it either."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse))
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def http_status(url: str, timeout: float = 1.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return cast(int, response.status)  # urlopen's response is untyped: an http.client.HTTPResponse
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


def read_stats_csv(stats_url: str, user: str, password: str, timeout: float = 1.0) -> str:
    """HAProxy's stats as CSV, with the stats credentials (basic auth)."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    request = urllib.request.Request(f"{stats_url};csv", headers={"Authorization": f"Basic {token}"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return cast(bytes, response.read()).decode()  # urlopen's response is untyped: an http.client.HTTPResponse


def redis_command(
    host: str, port: int, *words: str, password: str | None = None, user: str = "default", timeout: float = 1.0
) -> object:
    """One command's reply (str, int, list, None; an error reply as an Exception), or None if unreachable.

    A few lines of RESP, so the stack needs no Redis client of its own. With
    `password`, the command goes after AUTH as `user`; a refused AUTH is the reply.
    """
    commands = ([("AUTH", user, password)] if password is not None else []) + [words]
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"".join(_resp_array(command) for command in commands))
            reply = sock.makefile("rb")
            if password is not None and isinstance(auth := _resp(reply), Exception):
                return auth
            return _resp(reply)
    except (OSError, ValueError):
        return None


def _resp_array(words: tuple[str, ...]) -> bytes:
    """A command as a RESP array: any bytes in a word (a password's, say) arrive as they are."""
    encoded = [word.encode() for word in words]
    return f"*{len(encoded)}\r\n".encode() + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in encoded)


def _resp(reply: io.BufferedReader) -> object:
    line = reply.readline().decode().rstrip("\r\n")
    kind, rest = line[:1], line[1:]
    if kind == "+":
        return rest
    if kind == "-":
        return Exception(rest)
    if kind == ":":
        return int(rest)
    if kind == "$":
        return None if rest == "-1" else reply.read(int(rest) + 2)[:-2].decode()
    if kind == "*":
        return None if rest == "-1" else [_resp(reply) for _ in range(int(rest))]
    raise ValueError(f"not a RESP reply: {line!r}")


def redis_info(host: str, port: int, section: str, *, password: str | None = None) -> dict[str, str]:
    """INFO `section` as a dict (empty if unreachable, still loading or refused), as `default` with `password`."""
    text = redis_command(host, port, "INFO", section, password=password)
    if not isinstance(text, str):
        return {}
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


class Stack:
    """Start, stop and inspect the stack's processes. Safe to use from several commands in turn."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.state_file = config.state_dir / "state.json"
        self.log_dir = config.state_dir / "logs"

    @classmethod
    def load(
        cls,
        *,
        redis_mode: str | None = None,
        server: str | None = None,
        project: Path | None = None,
        state_dir: Path | None = None,
    ) -> Stack:
        """The stack recorded in `state_dir` (else STACK_DIR, else .stack in `project` or the cwd), or a fresh one
        configured from the environment."""
        config = StackConfig.from_env(
            redis_mode=redis_mode or "single", server=server, project=project, state_dir=state_dir
        )
        state_file = config.state_dir / "state.json"
        if state_file.exists():
            config = StackConfig.from_json(json.loads(state_file.read_text())["config"])
            if redis_mode and redis_mode != config.redis_mode:
                raise StackError(
                    f"the stack in {config.state_dir} is up with --redis {config.redis_mode}; "
                    "stop it first (python stack.py down)"
                )
            if server and server != config.server:
                raise StackError(
                    f"the stack in {config.state_dir} is up with --server {config.server}; "
                    "stop it first (python stack.py down)"
                )
            if project and project.resolve() != config.project:
                raise StackError(
                    f"the stack in {config.state_dir} is up with --project {config.project}; "
                    "stop it first (python stack.py down)"
                )
        return cls(config)

    # -- what the stack is made of ------------------------------------------------

    def _redis_users(self) -> str:
        """The Redis servers' ACL, as config file lines (in a file, not argv: `ps` shows argv to everyone)."""
        c = self.config
        kit = REDIS_KIT_CLUSTER_ACL if c.redis_mode == "cluster" else REDIS_KIT_ACL
        users = [("default", c.redis_admin_password, "~* &* +@all"), (c.redis_user, c.redis_password, kit)]
        if c.redis_mode == "sentinel":
            users.append((REDIS_SENTINEL_USER, c.redis_sentinel_auth_password, REDIS_SENTINEL_ACL))
        if c.redis_mode != "single":
            users.append((REDIS_REPLICATION_USER, c.redis_replication_password, REDIS_REPLICATION_ACL))
        return "".join(f"user {name} reset on >{password} {rules}\n" for name, password, rules in users)

    def _redis_memory_args(self) -> list[str]:
        """Redis's memory bound, on the command line (no secret in it) so it also holds for a config file
        Redis or Sentinel rewrote and the stack keeps: past it writes are refused, nothing is evicted."""
        return ["--maxmemory", self.config.redis_maxmemory, "--maxmemory-policy", "noeviction"]

    def _redis_services(self) -> list[Service]:
        c = self.config
        if c.redis_mode == "single":
            conf = c.state_dir / "redis" / "redis.conf"
            text = (
                f"bind {c.host}\nport {c.redis_port}\ndir {conf.parent}\nprotected-mode yes\n"
                f'appendonly yes\nsave ""\n{self._redis_users()}'
            )
            return [
                Service(
                    "redis",
                    ["redis-server", str(conf), *self._redis_memory_args()],
                    c.redis_port,
                    config_file=(conf, text),
                    config_kept=False,
                )
            ]
        if c.redis_mode == "cluster":
            return self._cluster_services()
        services = []
        for name, port in (("redis-1", c.redis_port), ("redis-2", c.redis_replica_port)):
            conf = c.state_dir / name / "redis.conf"
            # AOF fsynced every second, as in compose; redis-2 starts as redis-1's replica. A replica
            # (re)joining is sent the data at once, not after the default 5 s wait for others to join.
            # Either server may be a replica after a failover, so both know how to authenticate to a primary.
            text = (
                f"bind {c.host}\nport {port}\ndir {conf.parent}\nprotected-mode yes\n"
                'appendonly yes\nappendfsync everysec\nsave ""\nrepl-diskless-sync-delay 0\n'
                f"{self._redis_users()}masteruser {REDIS_REPLICATION_USER}\n"
                f"masterauth {c.redis_replication_password}\n"
            )
            if name == "redis-2":
                text += f"replicaof {c.host} {c.redis_port}\n"
            services.append(
                Service(name, ["redis-server", str(conf), *self._redis_memory_args()], port, config_file=(conf, text))
            )
        for i, port in enumerate(c.sentinel_ports, start=1):
            conf = c.state_dir / f"sentinel-{i}" / "sentinel.conf"
            # Quorum 2 of 3; the primary counts as down after 1 s without an answer. The sentinels
            # want a password too (`default`, the admin, which they also use with each other), and
            # the replicas ask them as the kit's user, which may only ask.
            text = (
                f"bind {c.host}\nport {port}\ndir {conf.parent}\n"
                f"user default reset on >{c.redis_admin_password} ~* &* +@all\n"
                f"user {c.redis_user} reset on >{c.redis_password} {REDIS_SENTINEL_KIT_ACL}\n"
                f"sentinel sentinel-pass {c.redis_admin_password}\n"
                f"sentinel monitor {SENTINEL_MASTER} {c.host} {c.redis_port} 2\n"
                f"sentinel auth-user {SENTINEL_MASTER} {REDIS_SENTINEL_USER}\n"
                f"sentinel auth-pass {SENTINEL_MASTER} {c.redis_sentinel_auth_password}\n"
                f"sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n"
                f"sentinel failover-timeout {SENTINEL_MASTER} 10000\n"
                f"sentinel parallel-syncs {SENTINEL_MASTER} 1\n"
            )
            services.append(
                Service(f"sentinel-{i}", ["redis-server", str(conf), "--sentinel"], port, config_file=(conf, text))
            )
        return services

    def _cluster_services(self) -> list[Service]:
        """redis-1..6 with cluster mode on; `up` makes them one cluster (create_cluster). A node's slots and
        role live in its own nodes.conf, beside its AOF, so a node started again rejoins as it was. A node
        silent for 1 s (cluster-node-timeout, as Sentinel's down-after) is marked failed and replaced by its
        replica; a slot range with no primary leaves the others served."""
        c = self.config
        services = []
        for i, (port, bus) in enumerate(zip(c.cluster_ports, c.cluster_bus_ports, strict=True), start=1):
            conf = c.state_dir / f"redis-{i}" / "redis.conf"
            text = (
                f"bind {c.host}\nport {port}\ndir {conf.parent}\nprotected-mode yes\n"
                'appendonly yes\nappendfsync everysec\nsave ""\nrepl-diskless-sync-delay 0\n'
                f"cluster-enabled yes\ncluster-config-file nodes.conf\ncluster-port {bus}\n"
                "cluster-node-timeout 1000\ncluster-require-full-coverage no\n"
                f"{self._redis_users()}masteruser {REDIS_REPLICATION_USER}\n"
                f"masterauth {c.redis_replication_password}\n"
            )
            argv = ["redis-server", str(conf), *self._redis_memory_args()]
            services.append(Service(f"redis-{i}", argv, port, config_file=(conf, text), config_kept=False))
        return services

    def create_cluster(self) -> None:
        """Make redis-1..6 one cluster, once (a node that knows other nodes already is one): three primaries,
        a replica each; then wait until every node sees every slot served, and load the kit's functions
        into each primary."""
        c = self.config
        if int(self._cluster_info("redis-1").get("cluster_known_nodes", "1")) < CLUSTER_NODES:
            nodes = [f"{c.host}:{port}" for port in c.cluster_ports]
            done = subprocess.run(
                ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "1", "--cluster-yes"],
                env=c.redis_cli_env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            if done.returncode != 0:
                raise StackError(f"redis-cli --cluster create failed: {(done.stdout + done.stderr)[-600:]}")
        deadline = time.monotonic() + HEALTH_TIMEOUT_SECONDS
        while not all(self._cluster_info(n).get("cluster_state") == "ok" for n in c.redis_names()):
            if time.monotonic() > deadline:
                raise StackError(
                    f"the Redis Cluster did not reach cluster_state:ok within {HEALTH_TIMEOUT_SECONDS:.0f}s"
                )
            time.sleep(0.1)
        for name in c.redis_names():
            self.load_functions(name)

    def _cluster_info(self, name: str) -> dict[str, str]:
        """CLUSTER INFO of one node, as fields; empty while it does not answer."""
        text = self.redis_command(name, "CLUSTER", "INFO")
        if not isinstance(text, str):
            return {}
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def services(self) -> list[Service]:
        c = self.config
        store_env = {"REDIS_USERNAME": c.redis_user, "REDIS_PASSWORD": c.redis_password}
        if c.redis_mode == "cluster":
            # The default REDIS_RETRY_SECONDS (4) outlasts a promotion (~2.5 s); a longer window keeps a call
            # in flight through a whole-cluster outage past a stock client's patience.
            store_env |= {"REDIS_CLUSTER_NODES": c.cluster_nodes}
        elif c.redis_mode == "sentinel":
            store_env |= {
                "REDIS_SENTINELS": c.sentinels,
                "REDIS_MASTER_NAME": SENTINEL_MASTER,
                "REDIS_SENTINEL_USERNAME": c.redis_user,
                "REDIS_SENTINEL_PASSWORD": c.redis_password,
            }
        else:
            store_env |= {"REDIS_URL": c.redis_url}
        # The project first, so its modules win over any of the same name; then what `up`'s shell had.
        pythonpath = os.pathsep.join(filter(None, [str(c.project), c.env.get("PYTHONPATH")]))
        replicas = [
            Service(
                name,
                [c.python, "-m", c.server],
                port,
                {
                    "INSTANCE_ID": name,
                    "PYTHONPATH": pythonpath,
                    "HOST": c.host,
                    "PORT": str(port),
                    **store_env,
                    "REDIS_WAIT_REPLICAS": str(c.redis_wait_replicas),
                    "SESSION_TTL_SECONDS": str(c.session_ttl_seconds),
                    "REQUEST_STATE_KEYS": c.request_state_keys,
                    # A chunked body HAProxy could not measure meets the same bound on the replica.
                    "MAX_BODY_BYTES": str(c.max_body_bytes),
                    # Only what this stack was started with, whatever the shell holds.
                    "MCP_AUTH": "none",
                    **c.auth,
                },
                cwd=c.project,
            )
            for name, port in zip(c.replica_names(), c.replica_ports, strict=True)
        ]
        return [*self._redis_services(), *replicas, *self._balancer_services()]

    def _balancer_services(self) -> list[Service]:
        c = self.config
        shared = c.haproxy_env(c.http_port, c.https_port, c.replica_ports)
        if len(c.peer_ports) > 1:
            for i, port in enumerate(c.peer_ports, start=1):
                shared[f"HAPROXY_PEER_{i}"] = f"{c.host}:{port}"
        return [
            Service(
                name,
                list(HAPROXY_ARGV),
                c.http_port,
                {
                    **shared,
                    "HAPROXY_STATS_BIND": f"{c.host}:{stats}",
                    **({"HAPROXY_LOCAL_PEER": f"haproxy-{i}"} if len(c.peer_ports) > 1 else {}),
                },
            )
            for i, (name, stats) in enumerate(zip(c.balancer_names(), c.stats_ports, strict=True), start=1)
        ]

    def service(self, name: str) -> Service:
        for svc in self.services():
            if svc.name == name:
                return svc
        known = ", ".join(s.name for s in self.services())
        raise StackError(f"no service named {name!r}; the stack has: {known}")

    # -- recorded state ------------------------------------------------------------

    def _read(self) -> dict[str, Any]:
        if self.state_file.exists():
            return cast(dict[str, Any], json.loads(self.state_file.read_text()))  # what _write wrote
        return {"config": self.config.to_json(), "processes": {}}

    def _write(self, state: dict[str, Any]) -> None:
        self._make_state_dir()
        # It holds the stats and Redis passwords: readable by this user only.
        write_private(self.state_file, json.dumps(state, indent=2))

    def _make_state_dir(self) -> None:
        # This user's only: Redis and Sentinel rewrite their config files (passwords in them) with
        # the umask's mode, and the logs say what the stack serves. Also a directory that was
        # already there (an old .stack, a STACK_DIR made by hand).
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        self.config.state_dir.chmod(0o700)

    def _keep_redis_secrets(self) -> None:
        """The Redis passwords, for the next `up` in this stack dir: its config files and data outlive `down`."""
        path = self.config.state_dir / REDIS_SECRETS_FILE
        if not path.exists():
            write_private(path, json.dumps({name: getattr(self.config, name) for name in REDIS_SECRETS}))

    def _recorded(self, name: str) -> dict[str, Any] | None:
        return cast(dict[str, Any] | None, self._read()["processes"].get(name))

    def pid(self, name: str) -> int | None:
        """The pid of the process this stack started for `name`, if it is still that process."""
        record = self._recorded(name)
        if record is None:
            return None
        stat = _proc_stat(record["pid"])
        if stat is None or stat[1] != record["start_ticks"]:
            return None
        if stat[0] in "ZX" and _reaped(record["pid"]):
            return None
        return cast(int, record["pid"])

    def state(self, name: str) -> str:
        pid = self.pid(name)
        if pid is None:
            return "exited" if self._recorded(name) else "stopped"
        stat = _proc_stat(pid)
        if stat and stat[0] in "ZX":
            return "exited"
        return "paused" if stat and stat[0] == "T" else "running"

    def ps(self) -> list[ServiceState]:
        c = self.config
        replicas = c.replica_names()
        return [
            ServiceState(
                svc.name,
                self.pid(svc.name),
                f"{c.host}:{svc.port}",
                self.state(svc.name),
                *((c.server, str(c.project)) if svc.name in replicas else ()),
            )
            for svc in self.services()
        ]

    # -- health --------------------------------------------------------------------

    def healthy(self, name: str) -> bool:
        c = self.config
        if name.startswith("sentinel-"):
            # It sees the primary up, and has found the other sentinels, so it can take part in a failover.
            status = self.redis_info(name, "sentinel").get("master0", "")
            return "status=ok" in status and f"sentinels={len(c.sentinel_ports)}" in status
        if name.startswith("redis"):
            # PING answers an error while the AOF is still loading: only PONG is ready.
            if self.redis_command(name, "PING") != "PONG":
                return False
            replication = self.redis_info(name, "replication")
            return replication.get("role") == "master" or replication.get("master_link_status") == "up"
        if name in c.balancer_names():
            return self.backends_up(name) == {n for n in c.replica_names() if self.pid(n)}
        return http_status(f"http://{c.host}:{self.service(name).port}/health") == 200

    def redis_command(self, name: str, *words: str) -> object:
        """A command to one of the stack's Redis servers or sentinels, as its admin (`default`)."""
        return redis_command(
            self.config.host, self.service(name).port, *words, password=self.config.redis_admin_password
        )

    def redis_info(self, name: str, section: str) -> dict[str, str]:
        return redis_info(self.config.host, self.service(name).port, section, password=self.config.redis_admin_password)

    def stats_rows(self, balancer: str = "haproxy") -> list[dict[str, str]]:
        """One HAProxy's stats CSV, a dict per proxy and server; empty while it does not answer."""
        try:
            text = read_stats_csv(self.config.stats_url_of(balancer), *self.config.stats_auth)
        except (OSError, ValueError):
            return []
        return list(csv.DictReader(io.StringIO(text.lstrip("# "))))

    def backend_status(self, balancer: str = "haproxy") -> dict[str, str]:
        """Each replica's status as one HAProxy sees it (UP, DOWN, ...), from its stats CSV."""
        return {
            row["svname"]: row["status"]
            for row in self.stats_rows(balancer)
            if row["pxname"] == "mcp_servers" and row["svname"].startswith("mcp-server-")
        }

    def backends_up(self, balancer: str = "haproxy") -> set[str]:
        return {name for name, status in self.backend_status(balancer).items() if status.startswith("UP")}

    def redis_primary(self) -> str | None:
        """The Redis service that is the primary now: the sentinels' answer, or "redis" without them; on a
        cluster, the primary that serves slot 0's range (the first of three)."""
        c = self.config
        if c.redis_mode == "single":
            return "redis"
        if c.redis_mode == "cluster":
            return next(iter(self.cluster_primaries()), None)
        by_port = {self.service(n).port: n for n in ("redis-1", "redis-2")}
        for name in c.redis_names()[2:]:
            address = self.redis_command(name, "SENTINEL", "get-master-addr-by-name", SENTINEL_MASTER)
            if isinstance(address, list) and len(address) == 2:
                return by_port.get(int(address[1]))
        return None

    def cluster_primaries(self) -> dict[str, int]:
        """The cluster's primaries that serve slots, as a node running sees them: name -> slots served,
        in the order of the slots; empty when no node answers."""
        by_port = {self.service(n).port: n for n in self.config.redis_names()}
        for name in self.config.redis_names():
            if self.pid(name) is None:
                continue
            text = self.redis_command(name, "CLUSTER", "NODES")
            if not isinstance(text, str):
                continue
            served: dict[str, tuple[int, int]] = {}
            for line in text.splitlines():
                fields = line.split()
                if "master" not in fields[2] or "fail" in fields[2] or len(fields) < 9:
                    continue
                port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
                ranges = [tuple(map(int, r.split("-"))) if "-" in r else (int(r), int(r)) for r in fields[8:]]
                served[by_port.get(port, str(port))] = (
                    min(r[0] for r in ranges),
                    sum(r[1] - r[0] + 1 for r in ranges),
                )
            return {n: slots for n, (_, slots) in sorted(served.items(), key=lambda item: item[1][0])}
        return {}

    def move_slots(self, source: str, target: str, count: int) -> None:
        """Move `count` slots, keys and all, from one cluster primary to another (redis-cli --cluster reshard,
        as the admin): what an operator does to rebalance, or to empty a node."""
        ids = {name: self.redis_command(name, "CLUSTER", "MYID") for name in (source, target)}
        done = subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "reshard",
                f"{self.config.host}:{self.service(source).port}",
                "--cluster-from",
                str(ids[source]),
                "--cluster-to",
                str(ids[target]),
                "--cluster-slots",
                str(count),
                "--cluster-yes",
            ],
            env=self.config.redis_cli_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise StackError(f"redis-cli --cluster reshard failed: {(done.stdout + done.stderr)[-600:]}")

    def wait_healthy(self, name: str, timeout: float = HEALTH_TIMEOUT_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pid(name) is None:
                headline = f"{name} exited while starting: {self._exit_cause(name)}"
                raise StackError("\n".join(filter(None, [headline, self.tail(name)])))
            if self.healthy(name):
                return
            time.sleep(0.1)
        raise StackError(
            f"{name} did not become healthy within {timeout:.0f}s:\n{self.tail(name) or '(it wrote nothing)'}"
        )

    # -- verbs ---------------------------------------------------------------------

    def _check_can_start(self, svc: Service) -> None:
        # Found where the process will look for it: the PATH it gets.
        if shutil.which(svc.binary, path=self.config.env.get("PATH", os.defpath)) is None:
            hint = INSTALL_HINT.get(svc.binary, "install it")
            raise StackError(f"{svc.binary} not found on PATH, needed for {svc.name}: {hint}")
        ports = [svc.port]
        if svc.name in (balancers := self.config.balancer_names()):
            i = balancers.index(svc.name)
            # The MCP ports are shared by every HAProxy of the stack (SO_REUSEPORT): in use by another is fine.
            shared = [] if any(self.pid(n) for n in balancers if n != svc.name) else [svc.port, self.config.https_port]
            ports = [*shared, self.config.stats_ports[i], *self.config.peer_ports[i : i + (len(balancers) > 1)]]
        for port in ports:
            # A process killed a moment ago may still hold its port while it exits.
            deadline = time.monotonic() + 2
            while not port_is_free(self.config.host, port) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not port_is_free(self.config.host, port):
                raise StackError(
                    f"port {port} on {self.config.host} is already in use, so {svc.name} cannot start; "
                    "stop what uses it or choose other ports (docs/operations.md)"
                )

    def start(self, name: str, *, wait: bool = True) -> None:
        if self.pid(name) is not None:
            return
        svc = self.service(name)
        self._check_can_start(svc)
        self._make_state_dir()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if name in self.config.redis_names():
            self._keep_redis_secrets()
        if name in self.config.balancer_names():
            ensure_certificate(self.config.tls_cert, self.config.tls_pem, self.config.host)
        if svc.config_file and not (svc.config_kept and svc.config_file[0].exists()):
            write_private(*svc.config_file)
        elif svc.config_file and "\nuser default " not in svc.config_file[0].read_text():
            raise StackError(
                f"{svc.config_file[0]} is from before Redis had passwords, so {name} would let anyone "
                f"in and refuse stack.py's own checks: run `python stack.py down`, remove "
                f"{self.config.state_dir} and start again"
            )
        if svc.cwd is not None and not svc.cwd.is_dir():
            raise StackError(f"{name} runs in {svc.cwd}, which is no longer a folder: bring it back, or down and up")
        argv = svc.argv + self._rejoin_args(name)
        log_path = self.log_dir / f"{name}.log"
        # Where this run's output starts: the log keeps earlier runs' too, which a failure must not show.
        log_offset = log_path.stat().st_size if log_path.exists() else 0
        log = open(log_path, "ab")
        proc = subprocess.Popen(
            argv,
            cwd=svc.cwd or self.config.state_dir,
            # What `up` ran with, not this shell's: the same for a restart from anywhere.
            env={**self.config.env, **svc.env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own session: Ctrl-C on `up` reaches only this tool, which then
            # stops each service in order.
            start_new_session=True,
        )
        log.close()
        stat = _proc_stat(proc.pid)
        state = self._read()
        state["processes"][name] = {
            "pid": proc.pid,
            "start_ticks": stat[1] if stat else "",
            "argv": argv,
            "log_offset": log_offset,
        }
        self._write(state)
        if wait:
            self.wait_healthy(name)
            if name in self.config.redis_names()[:2] and self.config.redis_mode != "cluster":
                self.load_functions(name)

    def load_functions(self, name: str) -> None:
        """Load the kit's Redis functions into `name` as its admin, if it is a primary (replicas get them
        from it): the kit's own user may only call them (REDIS_KIT_ACL)."""
        from ..stores.redis_store import functions_library

        if self.redis_info(name, "replication").get("role") != "master":
            return
        library = functions_library(cluster=self.config.redis_mode == "cluster")
        loaded = self.redis_command(name, "FUNCTION", "LOAD", "REPLACE", library)
        if isinstance(loaded, Exception) or loaded is None:
            raise StackError(f"{name} refused the kit's Redis functions: {loaded}")

    def _rejoin_args(self, name: str) -> list[str]:
        """A Redis server the sentinels no longer name as the primary starts as the new primary's replica.

        Its config file may still say it is the primary (it was killed before
        Sentinel could rewrite it); started as one, it would take writes nobody
        reads until Sentinel demotes it, ~8 s later, and a replica-acknowledged
        write (REDIS_WAIT_REPLICAS) would wait for it just as long.
        """
        if self.config.redis_mode != "sentinel" or name not in ("redis-1", "redis-2"):
            return []
        # Sentinels not up yet (`up` starts them last): the primary when the stack went down.
        primary = self.redis_primary() or self._last_primary()
        if primary == name or self.pid(primary) is None:
            return []
        return ["--replicaof", self.config.host, str(self.service(primary).port)]

    @property
    def _last_primary_file(self) -> Path:
        return self.config.state_dir / "redis-primary"

    def _last_primary(self) -> str:
        """The primary when the stack last went down (Sentinel may have moved it from redis-1)."""
        try:
            name = self._last_primary_file.read_text().strip()
        except FileNotFoundError:
            return "redis-1"
        return name if name in ("redis-1", "redis-2") else "redis-1"

    def signal(self, name: str, sig: signal.Signals) -> None:
        pid = self.pid(name)
        if pid is None:
            raise StackError(f"{name} is not running")
        os.kill(pid, sig)

    def stop(self, *names: str, timeout: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM, then SIGKILL after `timeout`, like `docker compose stop`; several side by side."""
        pids = {name: self.pid(name) for name in names}
        for running in filter(None, pids.values()):
            os.kill(running, signal.SIGCONT)  # a paused process cannot act on SIGTERM
            os.kill(running, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(self.pid(n) for n in names) and time.monotonic() < deadline:
            time.sleep(0.05)
        for name, pid in pids.items():
            if pid is not None and self.pid(name) is not None:
                os.kill(pid, signal.SIGKILL)
                while self.pid(name) is not None:
                    time.sleep(0.05)
        state = self._read()
        for name in names:
            state["processes"].pop(name, None)
        self._write(state)

    def up(self) -> None:
        """Start what is not running: redis (and its sentinels), then the replicas side by side, then haproxy.

        One that fails stops everything this call started, Redis too, so a failed `up` leaves nothing running.
        """
        self.check_replica_settings()
        running = {svc.name for svc in self.services() if self.pid(svc.name)}
        try:
            self._up()
        except BaseException:
            redis = self.config.redis_names()
            for group in (
                self.config.balancer_names(),
                self.config.replica_names(),
                redis[2:],
                *([n] for n in reversed(redis[:2])),
            ):
                self.stop(*(name for name in group if name not in running))
            if not running:
                self.state_file.unlink(missing_ok=True)
            raise

    def check_replica_settings(self) -> None:
        """What each replica will read from its environment (`up`'s shell, and what the stack sets), checked
        as the replica checks it, before anything starts: a setting that cannot work is refused by its name
        here, not found in a replica's log after redis is up."""
        for svc in self.services():
            if svc.name in self.config.replica_names():
                try:
                    Settings.from_env({**self.config.env, **svc.env})
                except SettingsError as exc:
                    raise StackError(str(exc)) from None

    def _up(self) -> None:
        redis = self.config.redis_names()
        servers = redis[:2]
        if self.config.redis_mode == "sentinel" and self._last_primary() == "redis-2":
            servers.reverse()
        # The primary first, so its replica and the sentinels find it; the sentinels side by side, so
        # each can find the others (healthy means it has).
        for name in servers:
            self.start(name)
        for name in redis[2:]:
            self.start(name, wait=False)
        for name in redis[2:]:
            self.wait_healthy(name)
        if self.config.redis_mode == "cluster":
            self.create_cluster()
        replicas = self.config.replica_names()
        for name in replicas:
            self.start(name, wait=False)
        for name in replicas:
            self.wait_healthy(name)
        for name in self.config.balancer_names():
            self.start(name)

    def down(self) -> None:
        """Stop HAProxy, then every replica side by side (each drains), then the sentinels and redis."""
        self.stop(*self.config.balancer_names())
        self.stop(*self.config.replica_names())
        redis = self.config.redis_names()
        if self.config.redis_mode == "sentinel":
            primary = self.redis_primary()
            if primary:
                self._last_primary_file.write_text(primary)
        self.stop(*redis[2:])
        for name in reversed(redis[:2]):
            self.stop(name)
        self.state_file.unlink(missing_ok=True)

    def restart(self, name: str) -> None:
        self.stop(name)
        self.start(name)
        if name.startswith("mcp-server-"):
            for balancer in self.config.balancer_names():
                if self.pid(balancer):
                    self.wait_healthy(balancer)

    def _this_run_log(self, name: str) -> str:
        """What `name`'s current (or last recorded) process wrote, without earlier runs' lines."""
        record = self._recorded(name) or {}
        try:
            with (self.log_dir / f"{name}.log").open("rb") as f:
                f.seek(record.get("log_offset", 0))
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, name: str, lines: int = 20) -> str:
        """The last `lines` lines `name`'s current (or last recorded) process wrote."""
        return "\n".join(self._this_run_log(name).splitlines()[-lines:])

    def _exit_cause(self, name: str) -> str:
        """Why `name` exited, in a line: the exception it died of, else its last line."""
        lines = [line.strip() for line in self._this_run_log(name).splitlines() if line.strip()]
        cause = next((line for line in reversed(lines) if EXIT_CAUSE.match(line)), lines[-1] if lines else "")
        c = self.config
        if name not in c.replica_names():
            return cause or "it wrote nothing"
        if not cause:
            # A module without `ha.run(app)` under `if __name__ == "__main__":` returns at once, silently.
            return f"it wrote nothing: does `python -m {c.server}` run the server (ha.run(app))?"
        missing = MISSING_MODULE.search(cause)
        if missing is None:
            return cause
        # `python -m` says "python: No module named x" without the exception's name; said the same way always.
        module = missing.group(1)
        cause = f"ModuleNotFoundError: No module named {module!r}"
        if c.server == module or c.server.startswith(f"{module}."):
            return f"{cause} (not in {c.project}: run from your project folder, or pass --project)"
        return f"{cause} (needed by {c.server}: install it into the environment of {c.python})"


def running_stack() -> Stack:
    """The stack `python stack.py up` started, for the benchmarks; StackError, saying what is wrong, unless whole."""
    stack = Stack.load()
    if not ipaddress.ip_address(stack.config.host).is_loopback:
        raise StackError(f"the stack listens on {stack.config.host}; the benchmarks only run against loopback")
    problems = []
    for svc in stack.services():
        state = stack.state(svc.name)
        if state != "running":
            problems.append(f"{svc.name} is {state}")
        elif not stack.healthy(svc.name):
            problems.append(f"{svc.name} is not healthy")
    if problems:
        raise StackError(
            f"the stack in {stack.config.state_dir} is not up and healthy ({'; '.join(problems)}). "
            "Start it with `python stack.py up -d`, or pass --own-stack to run on a stack of the benchmark's own."
        )
    return stack


# -- command line --------------------------------------------------------------------

# Piped (a CI log, a script, grep), a line is never broken at 80 columns: it would split paths and URLs.
console = Console(soft_wrap=not sys.stdout.isatty())


def _print_urls(stack: Stack) -> None:
    c = stack.config
    console.print(f"MCP endpoint  {c.mcp_url}")
    console.print(
        f"MCP over TLS  {c.mcp_https_url}  self-signed certificate {c.tls_cert}  (e.g. curl --cacert {c.tls_cert})"
    )
    console.print(f"health        http://{c.host}:{c.http_port}/health")
    for name in c.balancer_names():
        console.print(f"{name + ' stats':<13} {c.stats_url_of(name)}  user {c.stats_user}  password {c.stats_password}")
    if c.redis_mode == "sentinel":
        console.print(f"Redis         Sentinel {c.sentinels}, primary {SENTINEL_MASTER!r}")
    elif c.redis_mode == "cluster":
        console.print(f"Redis         Cluster {c.cluster_nodes} (three primaries, a replica each)")
    else:
        console.print(f"Redis         {c.redis_url}")
    # Where the passwords are, not the passwords: the admin's opens all of Redis, and a
    # terminal's scrollback or a CI log is no place for it.
    console.print(
        f"Redis users   {c.redis_user} (the replicas), default (admin): passwords in {c.state_dir / REDIS_SECRETS_FILE}"
    )
    console.print(f"replicas      {c.python} -m {c.server}  in {c.project}")
    console.print(f"stack dir     {c.state_dir}  (from another folder: --stack-dir {c.state_dir}, or STACK_DIR)")


class _Failed(click.ClickException):
    def show(self, file: IO[str] | None = None) -> None:
        # Plain stderr, never wrapped: scripts and tests read these lines.
        click.echo(f"error: {self.message}", err=True)


class _StackCommands(click.Group):
    """Its commands' StackError as `error: …` and exit status 1, as a ClickException: that way also where
    another group runs this one (`mcp-ha stack`), which handles ClickException but knows no StackError."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except StackError as exc:
            raise _Failed(str(exc)) from exc


def _up_stack(stack_dir: Path | None) -> Stack:
    """The stack recorded in the stack dir, for the verbs that act on one that is up."""
    stack = Stack.load(state_dir=stack_dir)
    if not stack.state_file.exists():
        raise StackError(
            f"no stack is up in {stack.config.state_dir}: run this in the folder you ran `up` in, "
            "or name its stack dir (--stack-dir DIR, or STACK_DIR)"
        )
    return stack


F = TypeVar("F", bound=Callable[..., Any])


def _stack_dir_option(*, before_the_verb: bool) -> Callable[[F], F]:
    """`--stack-dir`, taken before the verb (`stack --stack-dir D ps`) or after it (`stack ps --stack-dir D`), as
    docker compose and kubectl take their global options; after the verb it wins."""

    def chosen(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
        if value is not None or before_the_verb:
            ctx.obj = value

    return click.option(
        "--stack-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        expose_value=False,
        callback=chosen,
        help="Where `up` records the stack (default: STACK_DIR, else .stack in the current folder or `up --project`).",
    )


@click.group(cls=_StackCommands)
@_stack_dir_option(before_the_verb=True)
def cli() -> None:
    """The HA stack (redis, mcp-server-N, haproxy) as local processes."""


@cli.command()
@_stack_dir_option(before_the_verb=False)
@click.option("-d", "--detach", is_flag=True, help="Return once healthy and leave the stack running.")
@click.option(
    "--redis",
    "redis_mode",
    type=click.Choice(["single", "sentinel", "cluster"]),
    default=None,
    help="One redis (default), or a primary, a replica and three sentinels. A stack that is already up keeps its own.",
)
@click.option(
    "--server",
    "server",
    default=None,
    metavar="MODULE",
    help="The module each replica runs (default: server, the kit's demo; MCP_SERVER_MODULE).",
)
@click.option(
    "--project",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    metavar="DIR",
    help="The folder MODULE is in: the replicas' cwd, first on their PYTHONPATH (default: the current folder).",
)
@click.pass_obj
def up(stack_dir: Path | None, detach: bool, redis_mode: str | None, server: str | None, project: Path | None) -> None:
    """Start every service not already running; returns when all are healthy."""
    stack = Stack.load(redis_mode=redis_mode, server=server, project=project, state_dir=stack_dir)
    with console.status("starting redis, the replicas and haproxy"):
        stack.up()
    for svc in stack.services():
        console.print(f"[green]✔[/green] {svc.name} healthy on {stack.config.host}:{svc.port}")
    _print_urls(stack)
    if not detach:
        _follow(stack, [s.name for s in stack.services()], until_interrupted=True)
        stack.down()


@cli.command()
@_stack_dir_option(before_the_verb=False)
@click.pass_obj
def down(stack_dir: Path | None) -> None:
    """Stop every service this tool started."""
    Stack.load(state_dir=stack_dir).down()


@cli.command()
@_stack_dir_option(before_the_verb=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def ps(stack_dir: Path | None, as_json: bool) -> None:
    """Each service's name, pid, address and state; the replicas' module and project."""
    stack = Stack.load(state_dir=stack_dir)
    if not stack.state_file.exists():
        # Nothing made or shown: no table of services never started, no password minted for none.
        click.echo(f"(no stack is up in {stack.config.state_dir})", err=True)
        if as_json:
            click.echo("[]")
        return
    rows = stack.ps()
    if as_json:
        click.echo(json.dumps([asdict(r) for r in rows], indent=2))
        return
    table = Table("NAME", "PID", "ADDRESS", "STATE")
    for r in rows:
        table.add_row(r.name, str(r.pid or "-"), r.address, r.state)
    console.print(table)
    _print_urls(stack)


@cli.command()
@_stack_dir_option(before_the_verb=False)
@click.argument("names", nargs=-1, required=True)
@click.pass_obj
def stop(stack_dir: Path | None, names: tuple[str, ...]) -> None:
    """Stop services (SIGTERM, then SIGKILL after a grace period)."""
    stack = _up_stack(stack_dir)
    stack.stop(*[stack.service(n).name for n in names])


@cli.command()
@_stack_dir_option(before_the_verb=False)
@click.argument("names", nargs=-1, required=True)
@click.pass_obj
def start(stack_dir: Path | None, names: tuple[str, ...]) -> None:
    """Start stopped services and wait until they are healthy."""
    stack = _up_stack(stack_dir)
    for name in names:
        stack.start(name)


@cli.command()
@_stack_dir_option(before_the_verb=False)
@click.argument("names", nargs=-1, required=True)
@click.pass_obj
def restart(stack_dir: Path | None, names: tuple[str, ...]) -> None:
    """Restart services one at a time (a rolling restart when given every replica)."""
    stack = _up_stack(stack_dir)
    for name in names:
        with console.status(f"restarting {name}"):
            stack.restart(name)
        console.print(f"[green]✔[/green] {name} restarted")


def parse_signal(value: str) -> signal.Signals:
    value = value.upper()
    try:
        return (
            signal.Signals(int(value))
            if value.isdigit()
            else signal.Signals[value if value.startswith("SIG") else f"SIG{value}"]
        )
    except (KeyError, ValueError):
        raise click.BadParameter(f"unknown signal {value!r}") from None


@cli.command()
@_stack_dir_option(before_the_verb=False)
@click.option("-s", "--signal", "sig", default="SIGKILL", show_default=True, help="Signal name or number.")
@click.argument("names", nargs=-1, required=True)
@click.pass_obj
def kill(stack_dir: Path | None, sig: str, names: tuple[str, ...]) -> None:
    """Send a signal to services (SIGKILL by default, like docker compose kill)."""
    signum = parse_signal(sig)
    stack = _up_stack(stack_dir)
    for name in names:
        stack.signal(stack.service(name).name, signum)


@cli.command()
@_stack_dir_option(before_the_verb=False)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines.")
@click.argument("names", nargs=-1)
@click.pass_obj
def logs(stack_dir: Path | None, follow: bool, names: tuple[str, ...]) -> None:
    """Print services' logs (all of them when no name is given)."""
    stack = Stack.load(state_dir=stack_dir)
    if not stack.log_dir.is_dir():
        raise StackError(
            f"no logs in {stack.config.state_dir}: run this in the folder you ran `up` in, "
            "or name its stack dir (--stack-dir DIR, or STACK_DIR)"
        )
    selected = [stack.service(n).name for n in names] or [s.name for s in stack.services()]
    _follow(stack, selected, until_interrupted=follow)


def _follow(stack: Stack, names: list[str], *, until_interrupted: bool) -> None:
    offsets = dict.fromkeys(names, 0)
    try:
        while True:
            for name in names:
                path = stack.log_dir / f"{name}.log"
                if not path.exists():
                    continue
                with path.open("rb") as f:
                    f.seek(offsets[name])
                    chunk = f.read()
                    offsets[name] = f.tell()
                for line in chunk.decode(errors="replace").splitlines():
                    click.echo(f"{name:<13}| {line}" if len(names) > 1 else line)
            if not until_interrupted:
                return
            time.sleep(0.3)
    except KeyboardInterrupt:
        return


def main() -> None:
    """`python stack.py` and `python -m mcp_ha.ops.stack`: the same commands as `mcp-ha stack`."""
    cli()


if __name__ == "__main__":
    main()
