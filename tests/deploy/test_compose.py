"""Static checks of the container setup: docker-compose.yaml, the Dockerfile (and
examples/jobs/Dockerfile, a server of one's own built on it), haproxy.cfg as
compose runs it, and `mcp-ha deploy compose`, which writes them out. No Docker
engine needed; the haproxy.cfg check needs the haproxy binary, as `python
stack.py` does."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from fastmcp.server.auth.providers.jwt import JWTVerifier, StaticTokenVerifier

from mcp_ha import auth
from mcp_ha.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
REPLICAS = ["mcp-server-1", "mcp-server-2", "mcp-server-3"]
HAPROXY_CFG_IN_CONTAINER = "/usr/local/etc/haproxy/haproxy.cfg"
# A server module of one's own, as a user's image names it.
OWN = "my_project.server"
HAPROXY = shutil.which("haproxy")
needs_haproxy = pytest.mark.skipif(
    HAPROXY is None, reason="haproxy is not installed (apt-get install haproxy); needed to check haproxy.cfg"
)

# ${VAR}, ${VAR-default}, ${VAR:-default}, ${VAR:?message}, $VAR and $$, as compose reads them.
_INTERPOLATION = re.compile(r"\$(?:(\$)|\{(\w+)(?:(:?-)([^}]*)|(:?\?)([^}]*))?\}|(\w+))")
# What the tests set on the "host" for variables compose requires.
HOST_ENV = {
    "HAPROXY_STATS_PASSWORD": "a-test-password",
    "REDIS_ADMIN_PASSWORD": "test-admin-password",
    "REDIS_PASSWORD": "test-kit-password",
    "REDIS_SENTINEL_AUTH_PASSWORD": "test-sentinel-password",
    "REDIS_REPLICATION_PASSWORD": "test-replication-password",
    "REQUEST_STATE_KEYS": "test-request-state-key-of-32-bytes-at-least",
}


def verifier_from_env(environ: dict[str, str]):
    """The verifier a replica with this environment builds (None: authentication off)."""
    return auth.make_verifier(Settings.from_env(environ))


class MissingVariable(Exception):
    """compose refuses to start: a ${VAR:?message} is unset (or empty)."""


def interpolate(value: object, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(7)
        if m.group(5):
            if env.get(name) is None or (m.group(5) == ":?" and env[name] == ""):
                raise MissingVariable(f"{name}: {m.group(6)}")
            return env[name]
        return env.get(name) or m.group(4) or ""

    return _INTERPOLATION.sub(sub, str(value))


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yaml").read_text())


def service(compose: dict, name: str) -> dict:
    assert name in compose["services"], f"docker-compose.yaml has no service {name!r}"
    return compose["services"][name]


def environment(svc: dict, host_env: dict[str, str] = HOST_ENV) -> dict[str, str]:
    """A service's environment as compose would pass it with only `host_env` set on the host."""
    raw = svc.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {key: interpolate(value, host_env) for key, value in raw.items()}


def depends_on_healthy(svc: dict, other: str) -> bool:
    deps = svc.get("depends_on") or {}
    return isinstance(deps, dict) and (deps.get(other) or {}).get("condition") == "service_healthy"


def bind_mounts(svc: dict) -> dict[str, tuple[str, bool]]:
    """target -> (source, read_only) for a service's volumes, short or long syntax."""
    mounts = {}
    for vol in svc.get("volumes") or []:
        if isinstance(vol, str):
            source, target, *mode = vol.split(":")
            mounts[target] = (source, "ro" in (mode[0].split(",") if mode else []))
        else:
            mounts[vol["target"]] = (vol.get("source", ""), bool(vol.get("read_only")))
    return mounts


def haproxy_env_for_local_check(compose: dict, name: str = "haproxy") -> dict[str, str]:
    """An HAProxy's compose environment, with replica and peer hostnames swapped for 127.0.0.1:
    `haproxy -c` resolves server and peer names, and compose's service names only resolve
    inside the compose network."""
    haproxy = service(compose, name)
    env = environment(haproxy)
    for key, value in env.items():
        if re.fullmatch(r"MCP_SERVER_\d+|HAPROXY_PEER_\d", key):
            _, port = value.rsplit(":", 1)
            env[key] = f"127.0.0.1:{port}"
    # The Lua file from where compose mounts it, as the container would find it.
    lua = bind_mounts(haproxy)[f"{env['HAPROXY_LUA_DIR']}/refuse_body.lua"][0]
    env["HAPROXY_LUA_DIR"] = str((ROOT / lua).parent)
    return env


def haproxy_check(compose: dict, env: dict[str, str]) -> subprocess.CompletedProcess:
    source, _ = bind_mounts(service(compose, "haproxy"))[HAPROXY_CFG_IN_CONTAINER]
    # Only compose's variables: a stray MCP_SERVER_4 in the caller's shell would
    # add a server line compose never does.
    return subprocess.run(
        [HAPROXY, "-c", "-f", source],
        cwd=ROOT,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


# -- docker-compose.yaml -------------------------------------------------------------


def test_compose_defines_the_stack(compose):
    assert set(compose["services"]) >= {"redis", *REPLICAS, "haproxy"}


def redis_script(command: list[str]) -> tuple[list[str], list[str]]:
    """A Redis service's `sh -c` command: the script's lines before its last, and the redis-server argv it ends in."""
    assert command[:2] == ["sh", "-c"], command
    script = interpolate(command[2], HOST_ENV)
    *body, last = script.rstrip("\n").splitlines()
    words = shlex.split(last)
    assert words[:3] == ["exec", "docker-entrypoint.sh", "redis-server"], "the image's entrypoint drops root"
    # "$@": the arguments after the script, past its $0.
    argv = [w for w in words[2:] if w != "$@"]
    if "$@" in words:
        argv += [interpolate(a, HOST_ENV) for a in command[4:]]
    return body, argv


def start_compose_redis(command: list[str], tmp: Path, port: int, env: dict[str, str]) -> subprocess.Popen:
    """A Redis service's command run here, on loopback: its files in `tmp`, not replicating from anything."""
    body, argv = redis_script(command)
    for option, values in (("--replicaof", 2), ("--replica-announce-ip", 1)):
        if option in argv:
            i = argv.index(option)
            del argv[i : i + 1 + values]
    argv = [a.replace("/data/", f"{tmp}/") for a in argv]
    argv += ["--bind", "127.0.0.1", "--port", str(port), "--dir", str(tmp)]
    script = "\n".join(body).replace("/data/", f"{tmp}/") + "\nexec " + shlex.join(argv) + "\n"
    with open(tmp / "redis.log", "wb") as log:
        return subprocess.Popen(
            ["sh", "-c", script],
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def wait_for_pong(port: int, password: str, log: Path) -> None:
    from mcp_ha.ops.stack import redis_command

    for _ in range(100):
        if redis_command("127.0.0.1", port, "PING", password=password) == "PONG":
            return
        time.sleep(0.05)
    raise AssertionError(log.read_text())


def acl_users(text: str) -> dict[str, str]:
    """`user NAME on #HASH RULES` lines: NAME -> RULES."""
    users = {}
    for line in text.splitlines():
        if m := re.fullmatch(r"user (\S+) on #\$\(hash \"\$(\w+)\"\) ?(.*)", line.strip()):
            users[m.group(1)] = m.group(3)
    return users


def test_redis_persists_with_aof_and_has_a_healthcheck(compose):
    redis = service(compose, "redis")
    _, argv = redis_script(redis["command"])
    assert argv[0] == "redis-server"
    assert "--appendonly" in argv and argv[argv.index("--appendonly") + 1] == "yes"
    check = redis.get("healthcheck") or {}
    assert check.get("test") and not check.get("disable"), "compose can only wait for a redis with a healthcheck"
    assert "ping" in " ".join(check["test"] if isinstance(check["test"], list) else [check["test"]])
    assert "/data" in bind_mounts(redis), "AOF on the container's writable layer is lost with the container"


def memory_bound(argv: list[str]) -> tuple[str, str]:
    return argv[argv.index("--maxmemory") + 1], argv[argv.index("--maxmemory-policy") + 1]


@pytest.mark.quick
def test_every_redis_server_has_a_memory_bound_and_evicts_nothing(compose, sentinel_file):
    """Full, Redis refuses writes (clear errors at the replicas) instead of evicting live session state."""
    _, argv = redis_script(service(compose, "redis")["command"])
    assert memory_bound(argv) == ("256mb", "noeviction")
    # The bound is REDIS_MAXMEMORY's, from the host (docs/operations.md), in every file.
    assert '--maxmemory "${REDIS_MAXMEMORY:-256mb}"' in service(compose, "redis")["command"][2]
    for name in ("redis", "redis-2"):
        command = sentinel_file["services"][name]["command"]
        assert "${REDIS_MAXMEMORY:-256mb}" in command, name
        _, argv = redis_script(command)
        assert memory_bound(argv) == ("256mb", "noeviction"), name


@pytest.mark.parametrize("name", REPLICAS)
@pytest.mark.quick
def test_replicas_take_the_auth_settings_from_the_host_and_are_open_without_them(compose, name):
    svc = service(compose, name)
    assert verifier_from_env(environment(svc)) is None
    token = "a-token-of-twenty-chars"
    verifier = verifier_from_env(
        environment(svc, {**HOST_ENV, "MCP_AUTH": "static", "MCP_AUTH_TOKENS": f"alice:{token}"})
    )
    assert isinstance(verifier, StaticTokenVerifier) and verifier.tokens[token]["client_id"] == "alice"
    jwt = environment(
        svc,
        {
            **HOST_ENV,
            "MCP_AUTH": "jwt",
            "MCP_AUTH_JWKS_URL": "https://idp.example/jwks.json",
            "MCP_AUTH_ISSUER": "https://idp.example",
            "MCP_AUTH_AUDIENCE": "mcp",
        },
    )
    assert isinstance(verifier_from_env(jwt), JWTVerifier)


@pytest.mark.parametrize("name", REPLICAS)
def test_replica_identity_and_store(compose, name):
    svc = service(compose, name)
    env = environment(svc)
    assert env["INSTANCE_ID"] == name
    redis_url = urlsplit(env["REDIS_URL"])
    assert redis_url.scheme == "redis"
    assert redis_url.hostname == "redis" and "redis" in compose["services"]
    assert (redis_url.port or 6379) == 6379
    assert redis_url.password is None, "credentials come from REDIS_USERNAME and REDIS_PASSWORD"
    assert (env["REDIS_USERNAME"], env["REDIS_PASSWORD"]) == ("mcp", HOST_ENV["REDIS_PASSWORD"])
    assert env["HOST"] == "0.0.0.0", "a replica bound to loopback is unreachable from haproxy's container"


@pytest.mark.parametrize("name", REPLICAS)
@pytest.mark.quick
def test_replica_waits_for_healthy_redis(compose, name):
    assert depends_on_healthy(service(compose, name), "redis")


@pytest.mark.quick
def test_replicas_share_one_image_built_from_the_dockerfile(compose):
    replicas = [service(compose, name) for name in REPLICAS]
    assert len({svc["image"] for svc in replicas}) == 1
    for svc in replicas:
        build = svc["build"] if isinstance(svc["build"], dict) else {"context": svc["build"]}
        dockerfile = ROOT / build.get("context", ".") / build.get("dockerfile", "Dockerfile")
        assert dockerfile.resolve() == ROOT / "Dockerfile"


@pytest.mark.quick
def test_the_replicas_run_the_image_mcp_image_names(compose):
    """MCP_IMAGE, a server of one's own; by default the image `--build` makes, never the kit's own tag:
    built from a Dockerfile FROM mcp-ha-kit, it would replace the image it is built on."""
    image = service(compose, REPLICAS[0])["image"]
    assert interpolate(image, {**HOST_ENV, "MCP_IMAGE": "registry.example/mine:1"}) == "registry.example/mine:1"
    default = interpolate(image, HOST_ENV)
    assert default.split(":")[0] != dockerfile_from(ROOT / "examples" / "jobs" / "Dockerfile").split(":")[0]
    # The module is the image's (its MCP_SERVER_MODULE): compose would override it for every image.
    assert "MCP_SERVER_MODULE" not in environment(service(compose, REPLICAS[0]))


def test_haproxy_mounts_the_shared_config_read_only(compose):
    mounts = bind_mounts(service(compose, "haproxy"))
    assert HAPROXY_CFG_IN_CONTAINER in mounts
    source, read_only = mounts[HAPROXY_CFG_IN_CONTAINER]
    assert (ROOT / source).resolve() == ROOT / "haproxy" / "haproxy.cfg"
    assert read_only


def test_haproxy_mounts_its_lua_file_where_haproxy_cfg_looks(compose):
    haproxy = service(compose, "haproxy")
    source, read_only = bind_mounts(haproxy)[f"{environment(haproxy)['HAPROXY_LUA_DIR']}/refuse_body.lua"]
    assert (ROOT / source).resolve() == ROOT / "haproxy" / "refuse_body.lua"
    assert read_only


def test_haproxy_points_at_each_replica(compose):
    haproxy = service(compose, "haproxy")
    env = environment(haproxy)
    for i, name in enumerate(REPLICAS, start=1):
        host, port = env[f"MCP_SERVER_{i}"].rsplit(":", 1)
        assert host == name
        assert port == environment(service(compose, name))["PORT"]
        assert depends_on_healthy(haproxy, name)
    # Published ports arrive on the container's interface, not its loopback.
    for key in ("HAPROXY_BIND", "HAPROXY_STATS_BIND"):
        assert env[key].rsplit(":", 1)[0] in ("", "*", "0.0.0.0", "::", "[::]"), f"{key}={env[key]}"
    # One TTL for the stick table and the session state.
    assert {environment(service(compose, name))["SESSION_TTL_SECONDS"] for name in REPLICAS} == {
        env["SESSION_TTL_SECONDS"]
    }


@needs_haproxy
@pytest.mark.parametrize("name", ["haproxy", "haproxy-2"])
@pytest.mark.haproxy
def test_haproxy_cfg_is_valid_with_composes_environment(compose, name):
    result = haproxy_check(compose, haproxy_env_for_local_check(compose, name))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Configuration file is valid" in result.stdout + result.stderr


def test_the_two_haproxys_differ_only_in_who_they_are_and_where_they_publish(compose):
    """One session table between them (peers): the same environment but for the peer each one is."""
    one, two = (environment(service(compose, name)) for name in ("haproxy", "haproxy-2"))
    assert (one.pop("HAPROXY_LOCAL_PEER"), two.pop("HAPROXY_LOCAL_PEER")) == ("haproxy-1", "haproxy-2")
    assert one == two
    assert (one["HAPROXY_PEER_1"], one["HAPROXY_PEER_2"]) == ("haproxy:10000", "haproxy-2:10000")
    published = [service(compose, name)["ports"] for name in ("haproxy", "haproxy-2")]
    assert published == [["8080:8080", "8404:8404"], ["8081:8080", "8405:8404"]]
    assert service(compose, "haproxy")["volumes"] == service(compose, "haproxy-2")["volumes"]


def test_compose_ships_no_stats_password_and_refuses_to_start_without_one(compose):
    haproxy = service(compose, "haproxy")
    for unset in ({}, {"HAPROXY_STATS_PASSWORD": ""}):
        with pytest.raises(MissingVariable, match="HAPROXY_STATS_PASSWORD"):
            environment(haproxy, unset)
    env = environment(haproxy)
    assert env["HAPROXY_STATS_PASSWORD"] == HOST_ENV["HAPROXY_STATS_PASSWORD"]
    # The other settings have safe defaults: limits on (the local stack's), no Origin allowed.
    from mcp_ha.ops.stack import DEFAULT_MAX_CONN_PER_SOURCE, DEFAULT_RATE_LIMIT

    assert int(env["HAPROXY_MAX_BODY_BYTES"]) > 0
    assert (int(env["HAPROXY_RATE_LIMIT"]), int(env["HAPROXY_MAX_CONN_PER_SOURCE"])) == (
        DEFAULT_RATE_LIMIT,
        DEFAULT_MAX_CONN_PER_SOURCE,
    )
    # The replicas hold a chunked body, which HAProxy cannot measure, to the same bound.
    assert {environment(service(compose, name))["MAX_BODY_BYTES"] for name in REPLICAS} == {
        env["HAPROXY_MAX_BODY_BYTES"]
    }
    assert env["HAPROXY_ALLOWED_ORIGINS"] == ""


@needs_haproxy
@pytest.mark.haproxy
def test_haproxy_refuses_to_start_without_a_stats_password(compose):
    env = haproxy_env_for_local_check(compose)
    del env["HAPROXY_STATS_PASSWORD"]
    result = haproxy_check(compose, env)
    assert result.returncode != 0
    assert "HAPROXY_STATS_PASSWORD is not set" in result.stdout + result.stderr


# A value each variable cannot take, so `haproxy -c` fails if haproxy.cfg reads it.
POISON = {"HAPROXY_STATS_USER": "", "HAPROXY_STATS_PASSWORD": ""}
# Any value is valid for these (an origin that matches nothing): checked by name only.
UNPOISONABLE = {"HAPROXY_ALLOWED_ORIGINS"}


@needs_haproxy
@pytest.mark.haproxy
def test_haproxy_cfg_reads_every_variable_compose_sets(compose):
    """A misspelt name would be silently ignored (haproxy.cfg has defaults and
    `.if defined`), so poison each variable in turn: the check must then fail,
    and for MCP_SERVER_N on the server line of the same replica."""
    env = haproxy_env_for_local_check(compose)
    cfg = (ROOT / "haproxy" / "haproxy.cfg").read_text()
    for key in env:
        if key in UNPOISONABLE:
            assert "${" + key in cfg, f"haproxy.cfg ignores {key}"
            continue
        result = haproxy_check(compose, {**env, key: POISON.get(key, "127.0.0.1:notaport")})
        output = result.stdout + result.stderr
        assert result.returncode != 0, f"haproxy.cfg ignores {key}:\n{output}"
        if m := re.fullmatch(r"MCP_SERVER_(\d+)", key):
            assert f"mcp_servers/mcp-server-{m.group(1)}'" in output, output


# -- Dockerfile ------------------------------------------------------------------------


def dockerfile_instructions(path: Path = ROOT / "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of every Dockerfile line, continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, args = line.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    return instructions


def dockerfile_final_stage(path: Path = ROOT / "Dockerfile") -> list[tuple[str, str]]:
    instructions = dockerfile_instructions(path)
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def dockerfile_from(path: Path) -> str:
    """The image a one-stage Dockerfile starts FROM, its ARG defaults filled in."""
    instructions = dockerfile_instructions(path)
    args = dict(a.split("=", 1) for k, a in instructions if k == "ARG" and "=" in a)
    (base,) = [a for k, a in instructions if k == "FROM"]
    return interpolate(base, args)


def copied(stage: list[tuple[str, str]]) -> set[str]:
    """The build context's paths a stage COPYs (not those from another stage)."""
    return {source.rstrip("/") for k, a in stage if k == "COPY" and "--from=" not in a for source in a.split()[:-1]}


def instruction(name: str) -> list[str]:
    return [args for keyword, args in dockerfile_final_stage() if keyword == name]


def test_dockerfile_has_a_healthcheck_on_health():
    checks = instruction("HEALTHCHECK")
    assert checks, "compose's service_healthy needs a HEALTHCHECK in the image"
    assert "/health" in checks[-1] and not checks[-1].upper().startswith("NONE")


def test_dockerfile_runs_as_non_root():
    users = instruction("USER")
    assert users, "no USER: the server would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("", "root", "0")


def image_env(path: Path = ROOT / "Dockerfile") -> dict[str, str]:
    """The ENV a Dockerfile's final stage sets (KEY=value pairs, unquoted values)."""
    env = {}
    for keyword, args in dockerfile_final_stage(path):
        if keyword == "ENV":
            env |= dict(pair.split("=", 1) for pair in shlex.split(args))
    return env


@pytest.mark.process
def test_the_image_serves_the_module_it_names_with_python_as_pid_1(tmp_path):
    """CMD in exec form, a shell that only reads MCP_SERVER_MODULE and execs Python, so Python is PID 1 and
    gets SIGTERM itself (drain.py); the default module is the demo the image holds."""
    argv = json.loads(instruction("CMD")[-1])
    assert argv[:2] == ["sh", "-c"] and len(argv) == 3
    assert image_env()["MCP_SERVER_MODULE"] == "server" and "server.py" in copied(dockerfile_final_stage())
    # The script run with a `python` that reports its pid and argv: the shell's own pid, `-m MODULE`.
    (tmp_path / "python").write_text('#!/bin/sh\necho "$$ $*"\n')
    (tmp_path / "python").chmod(0o755)
    for env, module in (({"MCP_SERVER_MODULE": "server"}, "server"), ({"MCP_SERVER_MODULE": OWN}, OWN)):
        shell = subprocess.Popen(
            argv, env={"PATH": f"{tmp_path}:/usr/bin:/bin", **env}, stdout=subprocess.PIPE, text=True
        )
        out, _ = shell.communicate(timeout=10)
        assert out.split() == [str(shell.pid), "-m", module]
    refused = subprocess.run(argv, env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, capture_output=True, text=True)
    assert refused.returncode != 0 and "set MCP_SERVER_MODULE" in refused.stderr


@pytest.mark.parametrize("dockerfile", [ROOT / "Dockerfile", ROOT / "examples" / "jobs" / "Dockerfile"])
def test_dockerfile_copies_files_that_exist_and_are_not_ignored(dockerfile):
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    sources = copied(dockerfile_instructions(dockerfile))
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"{dockerfile.relative_to(ROOT)} copies {source}, which is not in the repo"
        assert source not in ignored
    assert {".venv", ".git", ".stack", "tests"} <= ignored


@pytest.mark.process
def test_the_image_installs_only_what_a_replica_needs():
    """The Dockerfile syncs without the default groups: no test tools, no benchmark plotting in the image."""
    syncs = [args for keyword, args in dockerfile_instructions() if keyword == "RUN" and "uv sync" in args]
    assert syncs and all("--no-default-groups" in args for args in syncs)
    uv = shutil.which("uv") or str(ROOT / ".tools" / "uv" / "bin" / "uv")
    exported = subprocess.run(
        [uv, "export", "--frozen", "--no-default-groups", "--no-hashes"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert exported.returncode == 0, exported.stderr
    packages = {line.split("==")[0] for line in exported.stdout.splitlines() if "==" in line}
    assert {"fastmcp", "redis", "uvicorn"} <= packages
    assert not packages & {"matplotlib", "pytest", "hypothesis", "ruff", "mypy"}


def repository_files_imported(module: str) -> set[str]:
    """The repository's files (not the venv's) that importing `module` loads, relative to the root."""
    probe = (
        f"import sys, pathlib, importlib; importlib.import_module({module!r}); root = pathlib.Path('.').resolve(); "
        "print('\\n'.join(sorted({str(pathlib.Path(m.__file__).resolve().relative_to(root)) "
        "for m in list(sys.modules.values()) if getattr(m, '__file__', None) "
        "and pathlib.Path(m.__file__).resolve().is_relative_to(root) "
        "and '.venv' not in pathlib.Path(m.__file__).parts})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "REDIS_URL": "redis://127.0.0.1:1/0"},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def installed_by_the_kits_image() -> set[str]:
    """The packages the kit's wheel holds (pyproject.toml), which the build stage installs from the
    sources it copies: in the image they are the venv's, not /app's."""
    wheel = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    stages = dockerfile_instructions()
    build_stage = stages[: max(i for i, (k, _) in enumerate(stages) if k == "FROM")]
    assert set(wheel["packages"]) <= copied(build_stage)
    assert any(k == "RUN" and "uv sync" in a and "--no-install-project" not in a for k, a in build_stage)
    return set(wheel["packages"])


def covered(path: str, sources: set[str]) -> bool:
    return any(path == source or path.startswith(source + "/") for source in sources)


def test_the_build_stage_copies_every_file_the_wheel_force_includes():
    """hatchling fails the image's `uv sync` on a force-included file the build context lacks: a file
    added to pyproject's list must also reach the build stage."""
    wheel = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    stages = dockerfile_instructions()
    build_stage = stages[: max(i for i, (k, _) in enumerate(stages) if k == "FROM")]
    sources = copied(build_stage)
    missing = {path for path in wheel["force-include"] if not covered(path, sources)}
    assert not missing, f"force-included by the wheel but not copied into the Dockerfile's build stage: {missing}"


@pytest.mark.parametrize(
    "dockerfile,module",
    [(ROOT / "Dockerfile", "server"), (ROOT / "examples" / "jobs" / "Dockerfile", "examples.jobs.server")],
)
@pytest.mark.process
def test_the_image_holds_every_module_its_server_imports(dockerfile, module):
    """A file the server imports that its image leaves out would only fail when a container starts: each
    is in the kit's installed packages, or copied by the image's Dockerfile (or the kit's, under it)."""
    imported = repository_files_imported(module)
    assert f"{module.replace('.', '/')}.py" in imported and any(p.startswith("mcp_ha/") for p in imported)
    assert image_env(dockerfile)["MCP_SERVER_MODULE"] == module
    sources = installed_by_the_kits_image() | copied(dockerfile_final_stage(dockerfile))
    if dockerfile != ROOT / "Dockerfile":
        sources |= copied(dockerfile_final_stage())
    missing = {p for p in imported if not covered(p, sources)}
    assert not missing, f"imported by {module} but not in its image: {missing}"


def test_a_server_image_is_the_kits_with_its_code_and_module_added():
    """examples/jobs/Dockerfile, a user's as docs/deploy.md has it: FROM the kit's image, adding code and
    the module's name only, so the kit's user, health check, stop signal and command hold unchanged."""
    dockerfile = ROOT / "examples" / "jobs" / "Dockerfile"
    assert dockerfile_from(dockerfile) == "mcp-ha-kit:latest"
    assert {k for k, _ in dockerfile_final_stage(dockerfile)} == {"FROM", "COPY", "ENV"}
    assert set(image_env(dockerfile)) == {"MCP_SERVER_MODULE"}


# -- docker-compose.sentinel.yaml ---------------------------------------------------------

SENTINELS = ["sentinel-1", "sentinel-2", "sentinel-3"]


@pytest.fixture(scope="module")
def sentinel_file() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.sentinel.yaml").read_text())


def sentinel_conf(svc: dict) -> str:
    """The sentinel.conf a sentinel service writes before it starts (compose's `$$` read as `$`)."""
    script = interpolate(svc["command"][-1], HOST_ENV)
    return script.split("<<EOF\n", 1)[1].split("\nEOF\n", 1)[0]


@pytest.mark.quick
def test_the_sentinel_file_adds_a_replica_and_three_sentinels_watching_the_primary(sentinel_file: dict) -> None:
    services = sentinel_file["services"]
    assert set(services) >= {"redis", "redis-2", *SENTINELS}
    assert services["redis-2"]["command"][-3:] == ["--replicaof", "redis", "6379"]
    for name in SENTINELS:
        conf = sentinel_conf(services[name]).splitlines()
        assert "sentinel monitor mymaster redis 6379 2" in conf
        assert "sentinel resolve-hostnames yes" in conf  # compose names, not addresses that change
        assert set(services[name]["depends_on"]) == {"redis", "redis-2"}


@pytest.mark.quick
def test_with_the_sentinel_file_the_replicas_ask_the_sentinels(compose: dict, sentinel_file: dict) -> None:
    for name in REPLICAS:
        env = {**environment(service(compose, name)), **environment(sentinel_file["services"][name])}
        assert env["INSTANCE_ID"] == name  # the base file's settings are kept
        assert env["REDIS_URL"] == "" and env["REDIS_MASTER_NAME"] == "mymaster"
        assert env["REDIS_SENTINELS"] == ",".join(f"{name}:26379" for name in SENTINELS)
        assert set(sentinel_file["services"][name]["depends_on"]) == set(SENTINELS)


@pytest.mark.parametrize(
    "name,variable",
    [
        ("redis", "REDIS_REPLICATION_PASSWORD"),
        ("redis-2", "REDIS_REPLICATION_PASSWORD"),
        ("sentinel-1", "REDIS_ADMIN_PASSWORD"),
        ("sentinel-1", "REDIS_SENTINEL_AUTH_PASSWORD"),
    ],
)
@pytest.mark.redis
def test_a_password_the_config_cannot_hold_stops_the_container_without_printing_it(
    sentinel_file: dict, tmp_path: Path, name: str, variable: str
) -> None:
    """The passwords written in clear (masterauth; the sentinels', which Sentinel writes back unquoted): a quote
    or a space would make Redis refuse its file and print the line, password and all, in the container's log."""
    host_env = {**HOST_ENV, variable: 'a "pass\\word" with spaces'}
    command = sentinel_file["services"][name]["command"]
    argv = ["sh", "-c", interpolate(command[2], host_env), *[interpolate(a, host_env) for a in command[3:]]]
    result = subprocess.run(
        argv,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **environment(sentinel_file["services"][name], host_env)},
    )
    assert result.returncode == 1
    assert (
        f"{variable}" in result.stderr and "use printable ASCII without spaces, quotes or backslashes" in result.stderr
    )
    assert host_env[variable] not in result.stdout + result.stderr


@pytest.mark.timeout(60)
@pytest.mark.redis
def test_the_sentinel_config_compose_writes_runs_in_a_real_sentinel(sentinel_file: dict, tmp_path: Path) -> None:
    """The directives themselves, on redis-server --sentinel here, logging in to the sentinel file's own
    primary (its command, run here on loopback), and asking for a password itself."""
    from conftest import free_ports

    from mcp_ha.ops.stack import redis_command, redis_info

    port, redis_port = free_ports(2)
    (tmp_path / "redis").mkdir()
    redis = sentinel_file["services"]["redis"]
    primary = start_compose_redis(redis["command"], tmp_path / "redis", redis_port, environment(redis))
    proc = None
    try:
        wait_for_pong(redis_port, HOST_ENV["REDIS_ADMIN_PASSWORD"], tmp_path / "redis" / "redis.log")
        # The service's own script, which writes the config (hashing the passwords) and starts Sentinel.
        sentinel = sentinel_file["services"]["sentinel-1"]
        script = interpolate(sentinel["command"][-1], HOST_ENV).replace("/data/", f"{tmp_path}/")
        script = script.replace("port 26379", f"bind 127.0.0.1\nport {port}\ndir {tmp_path}")
        script = script.replace("mymaster redis 6379", f"mymaster 127.0.0.1 {redis_port}")
        script = script.replace(
            f"exec redis-sentinel {tmp_path}/sentinel.conf", f"exec redis-server {tmp_path}/sentinel.conf --sentinel"
        )
        assert "exec redis-server" in script
        with open(tmp_path / "sentinel.log", "wb") as log:
            proc = subprocess.Popen(
                ["sh", "-c", script],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **environment(sentinel)},
            )
        status = ""
        for _ in range(100):
            info = redis_info("127.0.0.1", port, "sentinel", password=HOST_ENV["REDIS_ADMIN_PASSWORD"])
            status = info.get("master0", "")
            if "status=ok" in status:
                break
            time.sleep(0.1)
        assert "name=mymaster,status=ok" in status, (tmp_path / "sentinel.log").read_text()
        assert str(redis_command("127.0.0.1", port, "PING")).startswith("NOAUTH")
        kit = {"user": "mcp", "password": HOST_ENV["REDIS_PASSWORD"]}
        address = redis_command("127.0.0.1", port, "SENTINEL", "get-master-addr-by-name", "mymaster", **kit)
        assert address == ["127.0.0.1", str(redis_port)]
        assert str(redis_command("127.0.0.1", port, "SENTINEL", "failover", "mymaster", **kit)).startswith("NOPERM")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
        primary.terminate()
        primary.wait(timeout=10)


# -- Redis's passwords and ACL (issue 6) ----------------------------------------------------


def requires(svc: dict, variable: str) -> bool:
    """compose refuses to start the service while `variable` is unset or empty."""
    for host_env in ({k: v for k, v in HOST_ENV.items() if k != variable}, {**HOST_ENV, variable: ""}):
        try:
            environment(svc, host_env)
        except MissingVariable as exc:
            if variable in str(exc):
                continue
        return False
    return True


@pytest.mark.quick
def test_compose_ships_no_redis_password_and_refuses_to_start_without_one(compose, sentinel_file):
    admin, kit, sentinel, replication = (
        "REDIS_ADMIN_PASSWORD",
        "REDIS_PASSWORD",
        "REDIS_SENTINEL_AUTH_PASSWORD",
        "REDIS_REPLICATION_PASSWORD",
    )
    assert requires(service(compose, "redis"), admin) and requires(service(compose, "redis"), kit)
    for name in REPLICAS:
        assert requires(service(compose, name), kit)
        assert requires(sentinel_file["services"][name], kit)
    for name in ("redis", "redis-2"):
        assert all(requires(sentinel_file["services"][name], v) for v in (admin, kit, sentinel, replication)), name
    for name in SENTINELS:
        assert all(requires(sentinel_file["services"][name], v) for v in (admin, kit, sentinel)), name
    # The health checks log in as the admin, from the environment.
    for svc in (service(compose, "redis"), *(sentinel_file["services"][name] for name in ("redis-2", "sentinel-1"))):
        assert environment(svc)["REDISCLI_AUTH"] == HOST_ENV[admin]


@pytest.mark.quick
def test_composes_acl_is_the_local_stacks(compose, sentinel_file):
    from mcp_ha.ops.stack import REDIS_KIT_ACL, REDIS_REPLICATION_ACL, REDIS_SENTINEL_ACL, REDIS_SENTINEL_KIT_ACL

    every = {"default": "~* &* +@all", "mcp": REDIS_KIT_ACL}
    assert acl_users(interpolate(service(compose, "redis")["command"][2], HOST_ENV)) == every
    for name in ("redis", "redis-2"):
        body, _ = redis_script(sentinel_file["services"][name]["command"])
        assert acl_users("\n".join(body)) == {
            **every,
            "sentinel": REDIS_SENTINEL_ACL,
            "replication": REDIS_REPLICATION_ACL,
        }
        assert "masteruser replication" in body
    for name in SENTINELS:
        conf = sentinel_conf(sentinel_file["services"][name])
        assert acl_users(conf) == {"default": "~* &* +@all", "mcp": REDIS_SENTINEL_KIT_ACL}
        assert "sentinel auth-user mymaster sentinel" in conf.splitlines()
    # No password on a command line: docker inspect and ps show those.
    for svc in (service(compose, "redis"), *sentinel_file["services"].values()):
        command = interpolate(json.dumps(svc.get("command", "")), HOST_ENV)
        assert not any(password in command for password in HOST_ENV.values()), svc.get("command")


@pytest.mark.timeout(60)
@pytest.mark.redis
def test_composes_redis_command_runs_with_its_acl(compose, tmp_path: Path) -> None:
    """The base file's Redis command, run here: unauthenticated clients refused, the kit's user held to its ACL."""
    from conftest import free_ports

    from mcp_ha.ops.stack import redis_command
    from mcp_ha.stores.redis_store import LIBRARY, functions_library

    (port,) = free_ports(1)
    redis = service(compose, "redis")
    proc = start_compose_redis(redis["command"], tmp_path, port, environment(redis))
    try:
        wait_for_pong(port, HOST_ENV["REDIS_ADMIN_PASSWORD"], tmp_path / "redis.log")
        assert str(redis_command("127.0.0.1", port, "PING")).startswith("NOAUTH")
        kit = {"user": "mcp", "password": HOST_ENV["REDIS_PASSWORD"]}
        assert redis_command("127.0.0.1", port, "PING", **kit) == "PONG"
        # Lua of its own runs only on Docket's keys (durable tasks); the store's, it reaches through the
        # kit's functions, which the admin loads.
        sha = redis_command("127.0.0.1", port, "SCRIPT", "LOAD", "return 1", **kit)
        assert "NOPERM" in str(redis_command("127.0.0.1", port, "EVALSHA", sha, "1", "mcp:sessions", **kit))
        assert redis_command("127.0.0.1", port, "EVALSHA", sha, "1", "mcp:tasks:x", **kit) == 1
        admin = {"password": HOST_ENV["REDIS_ADMIN_PASSWORD"]}
        assert redis_command("127.0.0.1", port, "FUNCTION", "LOAD", "REPLACE", functions_library(), **admin) == LIBRARY
        get = f"{LIBRARY}_get"
        assert (
            redis_command("127.0.0.1", port, "FCALL", get, "2", "mcp:compose", "mcp:i", "x", "60", "n", **kit) is None
        )
        assert str(redis_command("127.0.0.1", port, "FLUSHALL", **kit)).startswith("NOPERM")
        assert "NOPERM" in str(
            redis_command("127.0.0.1", port, "FCALL", get, "2", "other", "mcp:i", "x", "60", "n", **kit)
        )
        acl_file = (tmp_path / "users.acl").read_text()
        assert not any(password in acl_file for password in HOST_ENV.values()), "passwords are stored hashed"
        assert (tmp_path / "users.acl").stat().st_mode & 0o077 == 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# -- `mcp-ha deploy compose DIR`: the files, outside the checkout ---------------------------------


def deploy(*args: str):
    from click.testing import CliRunner

    from mcp_ha.ops.cli import main

    return CliRunner().invoke(main, ["deploy", *args])


@pytest.mark.quick
def test_the_deploy_command_writes_the_compose_files_and_all_they_mount(compose, sentinel_file, tmp_path):
    """The repository's own files, byte for byte, in its layout: every bind mount of both compose files
    finds its source in the directory written."""
    from mcp_ha.ops.deploy_files import FILES

    result = deploy("compose", str(tmp_path))
    assert result.exit_code == 0, result.output
    written = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    assert written == set(FILES["compose"])
    for path in written:
        assert (tmp_path / path).read_bytes() == (ROOT / path).read_bytes(), path
    for svc in [*compose["services"].values(), *sentinel_file["services"].values()]:
        for source, _ in bind_mounts(svc).values():
            if source.startswith("./"):
                assert (tmp_path / source).is_file(), source


@pytest.mark.quick
def test_the_deploy_command_leaves_a_changed_file_alone_unless_forced(tmp_path):
    assert deploy("compose", str(tmp_path)).exit_code == 0
    cfg = tmp_path / "haproxy" / "haproxy.cfg"
    cfg.write_text("# mine\n")
    again = deploy("compose", str(tmp_path))
    assert again.exit_code != 0 and "haproxy/haproxy.cfg" in again.output and "--force" in again.output
    assert cfg.read_text() == "# mine\n"
    assert "unchanged" in deploy("compose", str(tmp_path), "--force").output
    assert cfg.read_bytes() == (ROOT / "haproxy" / "haproxy.cfg").read_bytes()


# -- docker-compose.cluster.yaml ---------------------------------------------------------------------

CLUSTER_NODES = ["redis", "redis-2", "redis-3", "redis-4", "redis-5", "redis-6"]


@pytest.fixture(scope="module")
def cluster_file() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.cluster.yaml").read_text())


@pytest.mark.quick
def test_the_cluster_file_runs_six_nodes_made_one_cluster_before_the_replicas_start(
    compose: dict, cluster_file: dict
) -> None:
    """The nodes and the one-shot service that makes them a cluster run deploy/kubernetes-cluster's
    scripts, which tests/deploy/test_kubernetes_cluster.py runs live."""
    from mcp_ha.ops.stack import CLUSTER_NODES as STACK_NODES

    services = cluster_file["services"]
    assert len(CLUSTER_NODES) == STACK_NODES
    servers = [f"{name}:6379" for name in CLUSTER_NODES]
    for name in CLUSTER_NODES:
        svc = services[name]
        assert svc["command"] == ["sh", "/scripts/node.sh"] and svc["working_dir"] == "/data"
        env = environment(svc)
        assert env["POD_NAME"] == name and env["REDIS_SERVERS"].split(",") == servers
        assert all(requires(svc, v) for v in ("REDIS_ADMIN_PASSWORD", "REDIS_PASSWORD", "REDIS_REPLICATION_PASSWORD"))
        mounts = bind_mounts(svc)
        assert mounts["/scripts/node.sh"] == ("./deploy/kubernetes-cluster/node.sh", True)
        assert mounts["/functions/functions-cluster.lua"] == ("./deploy/redis/functions-cluster.lua", True)
    init = services["redis-cluster"]
    assert init["command"] == ["sh", "/scripts/create.sh"]
    assert bind_mounts(init)["/scripts/create.sh"] == ("./deploy/kubernetes-cluster/create.sh", True)
    assert set(init["depends_on"]) == set(CLUSTER_NODES)
    assert environment(init)["REDIS_SERVERS"].split(",") == servers
    for name in REPLICAS:
        env = {**environment(service(compose, name)), **environment(services[name])}
        assert env["REDIS_URL"] == "" and env["REDIS_CLUSTER_NODES"].split(",") == servers
        assert services[name]["depends_on"]["redis-cluster"]["condition"] == "service_completed_successfully"
        assert Settings.from_env(env).redis_cluster_nodes  # a setting the replicas accept
