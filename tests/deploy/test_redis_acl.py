"""Redis behind passwords and an ACL (issue 6): nobody gets in unauthenticated, and the kit's own
user can do what stores/redis_store.py does and nothing else. That it can do all of that is
tests/test_session_store.py's job: the store suite runs as this user, alone and through Sentinel."""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, running_stack, stack_config

from mcp_ha.ops.stack import (
    REDIS_SECRETS,
    REDIS_SECRETS_FILE,
    SENTINEL_MASTER,
    STACK_SECRETS,
    Stack,
    StackConfig,
    StackError,
    http_status,
    redis_command,
)
from mcp_ha.stores.redis_store import LIBRARY, functions_library

# Harmless forms of what the kit never needs: reading everything, wiping, reconfiguring, replicating.
REFUSED = [
    ("FLUSHALL",),
    ("FLUSHDB",),
    ("KEYS", "*"),
    ("SCAN", "0"),
    ("CONFIG", "GET", "requirepass"),
    ("DEBUG", "SLEEP", "0"),
    ("ACL", "LIST"),
    ("CLIENT", "LIST"),
    ("MONITOR",),
    ("SHUTDOWN", "NOSAVE"),
    ("REPLICAOF", "NO", "ONE"),
    # Lua of its own on the store's keys: the store calls the functions the admin loaded (FCALL). Docket's
    # scripts (durable tasks) may run, by EVALSHA, on Docket's keys only (test_docket_may_do_its_work_...).
    ("EVAL", "return 1", "0"),
    ("EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", "1", "mcp:sessions"),
    ("SCRIPT", "FLUSH"),
    ("SCRIPT", "KILL"),
    ("FUNCTION", "LOAD", "#!lua name=mine\nredis.register_function('spin', function() while true do end end)"),
    ("FUNCTION", "DELETE", "mine"),
    ("FUNCTION", "FLUSH"),
    ("FUNCTION", "LIST"),
    ("SELECT", "1"),
    ("SUBSCRIBE", "x"),
    ("DEL", "mcp:sessions"),
    ("APPEND", "mcp:x", "1"),
    ("GET", "other:x"),
    # What Docket may do under mcp:tasks, nowhere else.
    ("XADD", "mcp:sessions", "*", "f", "v"),
    ("SMEMBERS", "mcp:x"),
    ("DEL", "mcp:taskz"),
    ("PSUBSCRIBE", "mcp:*"),
    ("PUBLISH", "other:tasks:cancel:x", "1"),
]
# What Docket does, under its name (tasks.DOCKET_NAME), as the kit's user: docs/security.md.
DOCKET = [
    ("XADD", "mcp:tasks:stream", "*", "f", "v"),
    ("XGROUP", "CREATE", "mcp:tasks:stream", "docket-workers", "$", "MKSTREAM"),
    ("XAUTOCLAIM", "mcp:tasks:stream", "docket-workers", "w", "1000", "0-0"),
    ("EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", "1", "mcp:tasks:runs:x"),
    ("SCRIPT", "LOAD", "return 1"),
    ("DEL", "mcp:tasks:runs:x"),
    ("PSUBSCRIBE", "mcp:tasks:cancel:*"),
    ("PUBLISH", "mcp:tasks:cancel:x", "1"),
    ("SADD", "mcp:tasks:workers", "w"),
    ("MULTI",),
]


def as_kit(stack: Stack, name: str, *words: str) -> object:
    c = stack.config
    return redis_command(c.host, stack.service(name).port, *words, user=c.redis_user, password=c.redis_password)


def error_of(reply: object) -> str:
    assert isinstance(reply, Exception), f"expected an error reply, got {reply!r}"
    return str(reply)


@pytest.mark.parametrize(
    "stack_name,server",
    [
        ("redis_stack", "redis"),
        ("sentinel_stack", "redis-1"),
        ("sentinel_stack", "redis-2"),
        ("sentinel_stack", "sentinel-1"),
    ],
)
@pytest.mark.redis  # the stack comes by `getfixturevalue`, which conftest's hook cannot see
def test_an_unauthenticated_client_is_refused(stack_name: str, server: str, request: pytest.FixtureRequest) -> None:
    stack: Stack = request.getfixturevalue(stack_name)
    port = stack.service(server).port
    assert error_of(redis_command(stack.config.host, port, "PING")).startswith("NOAUTH")
    assert error_of(redis_command(stack.config.host, port, "PING", password="wrong")).startswith("WRONGPASS")
    assert error_of(
        redis_command(
            stack.config.host, port, "PING", user=stack.config.redis_user, password=stack.config.redis_admin_password
        )
    ).startswith("WRONGPASS")
    assert stack.redis_command(server, "PING") == "PONG"  # the admin, as stack.py's health checks


@pytest.mark.parametrize("words", REFUSED, ids=lambda w: " ".join(w))
def test_the_kits_user_may_not_run_what_the_kit_does_not_need(redis_stack: Stack, words: tuple[str, ...]) -> None:
    error = error_of(as_kit(redis_stack, "redis", *words))
    # DEBUG is also off for everyone (enable-debug-command); the ACL's own answer says the user may not either.
    assert error.startswith("NOPERM") or words[0] == "DEBUG", error
    dry_run = redis_stack.redis_command("redis", "ACL", "DRYRUN", redis_stack.config.redis_user, *words)
    assert isinstance(dry_run, str) and "no permissions" in dry_run, dry_run


@pytest.mark.parametrize("words", DOCKET, ids=lambda w: " ".join(w))
def test_docket_may_do_its_work_under_its_name(redis_stack: Stack, words: tuple[str, ...]) -> None:
    """Durable tasks (mcp_ha/tasks.py) run on Docket, which needs more than the store, on its keys only:
    an ACL selector. Its workers subscribe to `mcp:tasks:cancel:*` by pattern, which Redis matches against
    the ACL literally (without it a worker never starts)."""
    from mcp_ha.tasks import DOCKET_NAME

    assert all(word.startswith(f"{DOCKET_NAME}:") for word in words if word.startswith("mcp:"))
    assert redis_stack.redis_command("redis", "ACL", "DRYRUN", redis_stack.config.redis_user, *words) == "OK"


def test_the_kits_user_reads_how_near_redis_is_to_its_memory_bound(redis_stack: Stack) -> None:
    """The replicas report memory pressure from INFO memory (issue 17); reading is all the user may do there."""
    info = as_kit(redis_stack, "redis", "INFO", "memory")
    assert isinstance(info, str), info
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    assert int(fields["maxmemory"]) > 0 and fields["maxmemory_policy"] == "noeviction"
    assert int(fields["used_memory"]) > 0
    assert error_of(as_kit(redis_stack, "redis", "CONFIG", "SET", "maxmemory", "0")).startswith("NOPERM")


def test_the_kits_user_reaches_only_the_kits_keys(redis_stack: Stack) -> None:
    other = f"other:{uuid.uuid4().hex}"
    assert redis_stack.redis_command("redis", "HSET", other, "f", "secret") == 1
    try:
        assert error_of(as_kit(redis_stack, "redis", "HGET", other, "f")).startswith("NOPERM")
        assert error_of(as_kit(redis_stack, "redis", "HSET", other, "f", "x")).startswith("NOPERM")
        # The functions it may call reach no further: the keys they are given are checked.
        get = f"{LIBRARY}_get"
        assert "NOPERM" in error_of(
            as_kit(redis_stack, "redis", "FCALL", get, "2", other, "mcp:sessions", "x", "60", "f")
        )
        assert redis_stack.redis_command("redis", "HGET", other, "f") == "secret"
        # Its own keys it can use, the way the store does.
        own = f"mcp:acl-test:{uuid.uuid4().hex}"
        assert as_kit(redis_stack, "redis", "FCALL", get, "2", own, "mcp:acl-test-index", "x", "60", "f") is None
        assert as_kit(redis_stack, "redis", "PING") == "PONG"
        redis_stack.redis_command("redis", "DEL", own, "mcp:acl-test-index")
    finally:
        redis_stack.redis_command("redis", "DEL", other)


def test_on_the_sentinels_the_kits_user_may_only_ask_for_the_primary(sentinel_stack: Stack) -> None:
    address = as_kit(sentinel_stack, "sentinel-1", "SENTINEL", "get-master-addr-by-name", "mymaster")
    assert isinstance(address, list) and len(address) == 2
    assert isinstance(as_kit(sentinel_stack, "sentinel-1", "SENTINEL", "masters"), list)
    for words in (
        ("SENTINEL", "failover", "mymaster"),
        ("SENTINEL", "remove", "mymaster"),
        ("SENTINEL", "set", "mymaster", "down-after-milliseconds", "1"),
        ("SENTINEL", "reset", "*"),
        ("SENTINEL", "config", "get", "*"),
        ("SHUTDOWN",),
        ("ACL", "LIST"),
    ):
        assert error_of(as_kit(sentinel_stack, "sentinel-1", *words)).startswith("NOPERM"), words


def test_the_replicas_get_the_kits_user_and_the_passwords_stay_private(sentinel_stack: Stack) -> None:
    c = sentinel_stack.config
    env = sentinel_stack.service("mcp-server-1").env
    assert (env["REDIS_USERNAME"], env["REDIS_PASSWORD"]) == (c.redis_user, c.redis_password)
    assert (env["REDIS_SENTINEL_USERNAME"], env["REDIS_SENTINEL_PASSWORD"]) == (c.redis_user, c.redis_password)
    assert c.redis_user != "default" and len({getattr(c, name) for name in REDIS_SECRETS}) == len(REDIS_SECRETS)
    recorded = json.loads(sentinel_stack.state_file.read_text())["config"]
    assert recorded["redis_admin_password"] == c.redis_admin_password
    for path in (sentinel_stack.state_file, c.state_dir / REDIS_SECRETS_FILE):
        assert path.stat().st_mode & 0o077 == 0, path
    assert c.state_dir.stat().st_mode & 0o077 == 0  # the config files in it hold passwords too
    for name in c.redis_names():
        argv = " ".join(json.loads(sentinel_stack.state_file.read_text())["processes"][name]["argv"])
        assert not any(getattr(c, secret) in argv for secret in REDIS_SECRETS), f"a password in {name}'s argv"


def test_a_stack_dir_keeps_its_redis_passwords_across_down_and_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its Redis config files and data outlive `down`, so the next `up` must bring the same passwords."""
    for variable in REDIS_SECRETS.values():
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("STACK_DIR", str(tmp_path))
    first = StackConfig.from_env()
    assert StackConfig.from_env().redis_admin_password != first.redis_admin_password  # nothing kept yet
    Stack(first)._keep_redis_secrets()
    again = StackConfig.from_env()
    assert all(getattr(again, name) == getattr(first, name) for name in REDIS_SECRETS)
    monkeypatch.setenv("REDIS_ADMIN_PASSWORD", "from-the-environment")
    assert StackConfig.from_env().redis_admin_password == "from-the-environment"
    assert os.stat(tmp_path / REDIS_SECRETS_FILE).st_mode & 0o077 == 0


@pytest.mark.redis
@pytest.mark.slow
def test_no_service_gets_the_admin_password_and_the_stack_dir_is_made_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shell's secrets are stack.py's: a replica (or HAProxy) holding the admin password in its environment
    would give whoever compromises it all of Redis, ACL or not. A stack dir that already existed is made private
    too: Redis and Sentinel rewrite their password-holding config files under the umask. (Redis itself is not
    read: it writes its process title over its environment.)"""
    for variable in STACK_SECRETS:
        monkeypatch.setenv(variable, f"the-shells-{variable.lower()}")
    state_dir = tmp_path / "stack"
    state_dir.mkdir(mode=0o755)
    state_dir.chmod(0o755)
    with running_stack(state_dir, replicas=1) as s:
        assert state_dir.stat().st_mode & 0o077 == 0
        for name in ("mcp-server-1", "haproxy"):
            environ = dict(
                item.split("=", 1)
                for item in Path(f"/proc/{s.pid(name)}/environ").read_bytes().decode().split("\0")
                if "=" in item
            )
            assert environ, name
            assert not STACK_SECRETS & environ.keys() - s.service(name).env.keys(), name
            assert not any(value.startswith("the-shells-") for value in environ.values()), name
            assert s.config.redis_admin_password not in environ.values(), name


@pytest.mark.parametrize("character", [" ", '"', "'", "\\", "\n", "\t", "\x7f", "é"])
def test_a_password_sentinel_could_not_write_back_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, character: str
) -> None:
    """Sentinel writes its passwords back into sentinel.conf unquoted: a space would break the file at the next
    start, a newline start a line of the password's choosing (here, a user with no password)."""
    monkeypatch.setenv("STACK_DIR", str(tmp_path))
    monkeypatch.setenv("REDIS_ADMIN_PASSWORD", f"a{character}user intruder on nopass ~* &* +@all")
    with pytest.raises(StackError, match=r"^REDIS_ADMIN_PASSWORD: use printable ASCII without spaces"):
        StackConfig.from_env(redis_mode="sentinel")
    assert not list(tmp_path.iterdir()), "nothing is written for a config that is refused"


@pytest.mark.redis
@pytest.mark.slow
def test_every_other_printable_character_works_in_every_password_through_a_sentinel_restart(tmp_path: Path) -> None:
    """The servers, the replica link, the sentinels with each other and with the servers, and the replicas all log
    in with such passwords, and a sentinel still starts from the file it rewrote with them."""
    punctuation = "!#$%&()*+,-./:;<=>?@[]^_`{|}~"
    # Each its own, so a password sent for the wrong user fails too.
    passwords = {name: f"{name}{punctuation}" for name in REDIS_SECRETS}
    stack = Stack(dataclasses.replace(stack_config(tmp_path, replicas=1, redis_mode="sentinel"), **passwords))
    try:
        stack.up()
        assert as_kit(stack, "redis-1", "PING") == "PONG"
        assert stack.redis_info("redis-2", "replication")["master_link_status"] == "up"
        # Sentinel's own rewrite, unquoted, which the restart below reads.
        rewritten = (tmp_path / "sentinel-1" / "sentinel.conf").read_text()
        assert f"sentinel sentinel-pass {passwords['redis_admin_password']}\n" in rewritten
        stack.restart("sentinel-1")
        for sentinel in ("sentinel-1", "sentinel-2", "sentinel-3"):
            assert stack.redis_command(sentinel, "SENTINEL", "CKQUORUM", SENTINEL_MASTER).startswith("OK"), sentinel
        assert http_status(f"http://{stack.config.host}:{stack.config.replica_ports[0]}/health") == 200
    finally:
        stack.down()


@pytest.mark.parametrize("cluster", [False, True], ids=["one redis", "cluster"])
def test_the_functions_file_the_deployments_load_is_the_stores_own(cluster: bool) -> None:
    """compose and Kubernetes load deploy/redis/functions*.lua: each must be the library the store calls."""
    name = "functions-cluster.lua" if cluster else "functions.lua"
    shipped = (ROOT / "deploy" / "redis" / name).read_text()
    flag = " --cluster" if cluster else ""
    assert shipped == functions_library(cluster=cluster), (
        f"deploy/redis/{name} is stale: python -m mcp_ha.stores.redis_store --functions{flag} > deploy/redis/{name}"
    )


def test_the_readiness_checks_find_the_loaded_functions(redis_stack: Stack) -> None:
    """compose's and Kubernetes' Redis checks wait for the library: their pattern must match it (a glob)."""
    found = redis_stack.redis_command("redis", "FUNCTION", "LIST", "LIBRARYNAME", "mcp_ha_*")
    assert isinstance(found, list) and LIBRARY in str(found), found
    for path in ("docker-compose.yaml", "docker-compose.ci.yaml", "deploy/kubernetes/redis.yaml"):
        assert "FUNCTION LIST LIBRARYNAME 'mcp_ha_*'" in (ROOT / path).read_text(), path
