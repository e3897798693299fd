"""The reference kit (github.com/vikrantjain/mcp-high-availability), run as local processes, for
`python -m tools.bench --reference PATH`.

Given the path of a checkout of it, `ReferenceKit` starts what its docker-compose.yaml starts, without
Docker and on free loopback ports only:

    a venv        OUTSIDE this repository, ~/.cache/mcp-ha-kit/reference-venv-<digest of its
                  pyproject.toml, uv.lock and .python-version>, made by uv from its own lock
                  (`uv export --frozen`, installed with --require-hashes); reused while the
                  lock is unchanged
    redis-server  its own, with Redis's defaults (the kit's compose runs redis:7-alpine unconfigured)
    3 replicas    `fastmcp run server.py --transport streamable-http` from that venv (its
                  Dockerfile's CMD), INSTANCE_ID mcp-server-N and REDIS_URL as its compose sets them
    haproxy       its haproxy.cfg, rewritten into a temporary directory so every `bind` is a free
                  loopback port and every `server` one of the replicas; nothing else in it changes

Nothing of the checkout is copied into this repository or written into the checkout: it is only run.
Every wait is bounded; what does not start is a ReferenceKitError naming the command and its log file.
Each process is started in a session of its own and stopped by its pid (its process group) on exit.

    with ReferenceKit(Checkout.at(path), ensure_venv(Checkout.at(path))) as kit:
        kit.url   # http://127.0.0.1:<port>/mcp, through its HAProxy
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from mcp_ha.ops.stack import free_ports, http_status, redis_command
from tools import ROOT

HOST = "127.0.0.1"
REPLICAS = 3
# The reference kit's files this runner reads; a checkout without one of them is refused.
REQUIRED = ("pyproject.toml", "uv.lock", "server.py", "haproxy/haproxy.cfg")
# Where the venv goes: under the user's cache, never under this repository.
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mcp-ha-kit"
# Written into the venv once everything is installed: a venv without it is made again.
READY = ".mcp-ha-kit-ready"
VENV_STEP_TIMEOUT = 900.0
START_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0
# The packages whose pinned versions are reported beside the figures.
REPORTED_PACKAGES = ("fastmcp", "mcp", "uvicorn", "starlette", "redis", "hiredis")
# Section keywords of an HAProxy configuration (a line starting with one opens a section).
SECTIONS = {
    "global",
    "defaults",
    "frontend",
    "backend",
    "listen",
    "resolvers",
    "peers",
    "userlist",
    "mailers",
    "program",
    "http-errors",
    "ring",
    "cache",
}


class ReferenceKitError(Exception):
    """The reference kit could not be prepared or started; the message says which command and log."""


# -- the checkout -------------------------------------------------------------------------


@dataclass(frozen=True)
class Checkout:
    path: Path

    @classmethod
    def at(cls, path: str | Path) -> Checkout:
        root = Path(path).expanduser().resolve()
        missing = [name for name in REQUIRED if not (root / name).is_file()]
        if missing:
            raise ReferenceKitError(
                f"{root} is not a checkout of the reference kit (vikrantjain/mcp-high-availability): "
                f"{', '.join(missing)} missing"
            )
        return cls(root)

    @property
    def haproxy_cfg(self) -> Path:
        return self.path / "haproxy" / "haproxy.cfg"

    def python_request(self) -> str | None:
        """The Python its .python-version asks for (its Dockerfile's image is the same)."""
        pinned = self.path / ".python-version"
        text = pinned.read_text().strip() if pinned.is_file() else ""
        return text.splitlines()[0].strip() if text else None

    def digest(self) -> str:
        """What the venv depends on: its project file, its lock and its Python version."""
        h = hashlib.sha256()
        for name in ("pyproject.toml", "uv.lock", ".python-version"):
            f = self.path / name
            h.update(name.encode() + b"\0" + (f.read_bytes() if f.is_file() else b"") + b"\0")
        return h.hexdigest()[:16]

    def pinned(self) -> dict[str, str]:
        """The versions its uv.lock pins for the packages that matter to the figures."""
        try:
            lock = tomllib.loads((self.path / "uv.lock").read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ReferenceKitError(f"cannot read {self.path / 'uv.lock'}: {exc}") from None
        versions = {p.get("name"): p.get("version") for p in lock.get("package", []) if isinstance(p, dict)}
        return {name: str(versions[name]) for name in REPORTED_PACKAGES if versions.get(name)}

    def commit(self) -> str | None:
        """The commit checked out, when the checkout is a git work tree (an exported one has none)."""
        if not (self.path / ".git").exists():
            return None
        try:
            done = subprocess.run(
                ["git", "-C", str(self.path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return (done.stdout.strip() or None) if done.returncode == 0 else None


# -- its venv -----------------------------------------------------------------------------


def find_uv() -> str:
    """uv on PATH, else the one `make` pins into .tools/."""
    found = shutil.which("uv") or (str(ROOT / ".tools/uv/bin/uv") if (ROOT / ".tools/uv/bin/uv").is_file() else None)
    if not found:
        raise ReferenceKitError("the reference kit's venv is made with uv, which is not installed (make python-deps)")
    return found


def _uv_env() -> dict[str, str]:
    """uv's environment without this repository's venv or project settings leaking into the reference's."""
    drop = {"VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT", "UV_PROJECT", "PYTHONPATH", "PYTHONHOME"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def find_python(uv: str, request: str | None) -> str | None:
    """An interpreter for `request` (its .python-version, "3.12"): the one uv finds without downloading, else
    a python<request> on PATH or installed by pyenv (whose shims uv cannot use when that version is not
    pyenv's global), else `request` itself, for uv to download."""
    if not request:
        return None
    try:
        found = subprocess.run(
            [uv, "python", "find", "--no-project", request],
            capture_output=True,
            text=True,
            timeout=60,
            env=_uv_env(),
        )
        if found.returncode == 0 and found.stdout.strip():
            return found.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    if re.fullmatch(r"\d+\.\d+", request):
        pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
        for candidate in sorted(pyenv.glob(f"versions/{request}.*/bin/python{request}"), reverse=True):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    return request


def venv_path(checkout: Checkout, cache_dir: Path = CACHE_DIR) -> Path:
    return cache_dir / f"reference-venv-{checkout.digest()}"


def _step(argv: list[str], log: Path, cwd: Path) -> None:
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(argv)}\n".encode())
        out.flush()
        try:
            done = subprocess.run(
                argv,
                cwd=cwd,
                env=_uv_env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=VENV_STEP_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            raise ReferenceKitError(f"`{' '.join(argv)}` took over {VENV_STEP_TIMEOUT:.0f} s; see {log}") from None
        except OSError as exc:
            raise ReferenceKitError(f"`{' '.join(argv)}` could not run: {exc}; see {log}") from None
    if done.returncode != 0:
        raise ReferenceKitError(f"`{' '.join(argv)}` exited {done.returncode}; see {log}")


def ensure_venv(checkout: Checkout, cache_dir: Path = CACHE_DIR) -> Path:
    """The reference kit's venv with exactly what its uv.lock pins: made once, reused while the lock holds."""
    venv = venv_path(checkout, cache_dir)
    if venv.resolve().is_relative_to(ROOT):
        raise ReferenceKitError(f"{venv} is inside this repository; the reference kit's venv must live outside it")
    if (venv / READY).is_file():
        return venv
    cache_dir.mkdir(parents=True, exist_ok=True)
    log = cache_dir / f"{venv.name}.log"
    # One maker at a time: a second bench waits for the first's venv instead of racing it.
    with open(cache_dir / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / READY).is_file():
            return venv
        shutil.rmtree(venv, ignore_errors=True)  # a half-made one, from an interrupted run
        log.write_bytes(b"")
        uv = find_uv()
        requirements = cache_dir / f"{venv.name}.requirements.txt"
        _step(
            [
                uv,
                "export",
                "--quiet",
                "--frozen",
                "--no-dev",
                "--no-emit-project",
                "--format",
                "requirements-txt",
                "--project",
                str(checkout.path),
                "--output-file",
                str(requirements),
            ],
            log,
            cache_dir,
        )
        python = find_python(uv, checkout.python_request())
        _step([uv, "venv", "--no-project", *(["--python", python] if python else []), str(venv)], log, cache_dir)
        _step(
            [
                uv,
                "pip",
                "install",
                "--python",
                str(venv / "bin" / "python"),
                "--require-hashes",
                "-r",
                str(requirements),
            ],
            log,
            cache_dir,
        )
        if not (venv / "bin" / "fastmcp").is_file():
            raise ReferenceKitError(f"the reference kit's venv {venv} has no fastmcp after installing; see {log}")
        (venv / READY).write_text(checkout.digest() + "\n")
    return venv


# -- its haproxy.cfg, on loopback ports ---------------------------------------------------


@dataclass
class HAProxyConfig:
    """A haproxy.cfg rewritten to loopback addresses: its text, and what was put where."""

    text: str
    binds: dict[str, int] = field(default_factory=dict)  # frontend (or listen) name: its port
    servers: dict[str, str] = field(default_factory=dict)  # server name: address
    stats: tuple[str, str] | None = None  # (frontend, uri) of its stats page, if it has one

    def port_of(self, frontend: str) -> int:
        return self.binds[frontend]


_SECTION = re.compile(r"^\s*(\S+)(?:\s+(\S+))?")
_BIND = re.compile(r"^(\s*bind\s+)(\S+)(.*)$")
_SERVER = re.compile(r"^(\s*server\s+)(\S+)(\s+)(\S+)(.*)$")
_STATS_URI = re.compile(r"^\s*stats\s+uri\s+(\S+)")


def count_binds(text: str) -> int:
    """How many `bind` lines (each needs a port of its own)."""
    return sum(1 for line in text.splitlines() if _BIND.match(line.split("#", 1)[0]))


def rewrite_haproxy_cfg(
    text: str, bind_ports: list[int], server_addresses: list[str], host: str = HOST
) -> HAProxyConfig:
    """`text` with the address of every `bind` line replaced by host:<the next of bind_ports> and that of every
    `server` line by the next of server_addresses; every other byte as it was. ValueError when the counts do
    not match (a config of another shape than the one this runner knows)."""
    binds = count_binds(text)
    servers = sum(1 for line in text.splitlines() if _SERVER.match(line.split("#", 1)[0]))
    if binds != len(bind_ports):
        raise ValueError(f"the config has {binds} bind line(s), {len(bind_ports)} port(s) were given")
    if servers != len(server_addresses):
        raise ValueError(f"the config has {servers} server line(s), {len(server_addresses)} replica(s) were given")
    out = HAProxyConfig("")
    lines = text.splitlines(keepends=True)
    ports, addresses = iter(bind_ports), iter(server_addresses)
    section: tuple[str, str] = ("", "")
    for i, line in enumerate(lines):
        body = line.rstrip("\r\n")
        code = body.split("#", 1)[0]
        ending = line[len(body) :]
        head = _SECTION.match(code)
        if head and head.group(1) in SECTIONS and not code[:1].isspace():
            section = (head.group(1), head.group(2) or "")
            continue
        if m := _BIND.match(code):
            port = next(ports)
            out.binds.setdefault(section[1], port)
            lines[i] = f"{m.group(1)}{host}:{port}{m.group(3)}{body[len(code) :]}{ending}"
        elif m := _SERVER.match(code):
            address = next(addresses)
            out.servers[m.group(2)] = address
            lines[i] = f"{m.group(1)}{m.group(2)}{m.group(3)}{address}{m.group(5)}{body[len(code) :]}{ending}"
        elif m := _STATS_URI.match(code):
            out.stats = (section[1], m.group(1))
    out.text = "".join(lines)
    return out


# -- the processes ------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen

    def describe(self) -> str:
        return f"`{' '.join(self.argv)}` ({self.name}; log {self.log})"


class ReferenceKit:
    """The reference kit's Redis, replicas and HAProxy as local processes on free loopback ports."""

    def __init__(self, checkout: Checkout, venv: Path, *, replicas: int = REPLICAS, timeout: float = START_TIMEOUT):
        self.checkout = checkout
        self.venv = venv
        self.replicas = replicas
        self.timeout = timeout
        self.procs: list[Proc] = []
        self.work_dir: Path | None = None
        self.redis_port = 0
        self.replica_ports: list[int] = []
        self.config: HAProxyConfig | None = None
        self.frontend = ""

    # -- addresses

    @property
    def url(self) -> str:
        """Its MCP endpoint, through its HAProxy."""
        return f"http://{HOST}:{self.frontend_port}/mcp"

    @property
    def frontend_port(self) -> int:
        if self.config is None:
            raise ReferenceKitError("the reference kit is not started")
        return self.config.port_of(self.frontend)

    def replica_url(self, index: int = 0) -> str:
        return f"http://{HOST}:{self.replica_ports[index]}/mcp"

    # -- life

    def __enter__(self) -> ReferenceKit:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(keep_logs=exc[0] is not None)

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop(keep_logs=True)
            raise

    def _start(self) -> None:
        cfg_text = self.checkout.haproxy_cfg.read_text()
        binds = count_binds(cfg_text)
        self.work_dir = Path(tempfile.mkdtemp(prefix="mcp-ha-reference-"))
        self.redis_port, *rest = free_ports(1 + self.replicas + binds)
        self.replica_ports, bind_ports = rest[: self.replicas], rest[self.replicas :]
        try:
            self.config = rewrite_haproxy_cfg(cfg_text, bind_ports, [f"{HOST}:{p}" for p in self.replica_ports])
        except ValueError as exc:
            raise ReferenceKitError(f"{self.checkout.haproxy_cfg}: {exc}") from None
        self.frontend = self._mcp_frontend()
        deadline = time.monotonic() + self.timeout

        redis = self._spawn(
            "redis",
            ["redis-server", "--port", str(self.redis_port), "--bind", HOST, "--dir", str(self.work_dir)],
            cwd=self.work_dir,
        )
        self._wait(redis, deadline, lambda: redis_command(HOST, self.redis_port, "PING") == "PONG", "answer PING")

        fastmcp = str(self.venv / "bin" / "fastmcp")
        replicas = []
        for i, port in enumerate(self.replica_ports, start=1):
            # Its Dockerfile's CMD, on a loopback port; its docker-compose.yaml's environment.
            argv = [fastmcp, "run", "server.py", "--transport", "streamable-http", "--host", HOST, "--port", str(port)]
            env = {"INSTANCE_ID": f"mcp-server-{i}", "REDIS_URL": f"redis://{HOST}:{self.redis_port}/0"}
            replicas.append(self._spawn(f"mcp-server-{i}", argv, cwd=self.checkout.path, env=env))
        for proc, port in zip(replicas, self.replica_ports, strict=True):
            url = f"http://{HOST}:{port}/health"
            self._wait(proc, deadline, lambda url=url: http_status(url) == 200, f"answer 200 at {url}")

        cfg = self.work_dir / "haproxy.cfg"
        cfg.write_text(self.config.text)
        check = subprocess.run(["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise ReferenceKitError(
                f"haproxy -c -f {cfg} refused the rewritten config: {(check.stderr or check.stdout).strip()[-600:]}"
            )
        haproxy = self._spawn("haproxy", ["haproxy", "-db", "-f", str(cfg)], cwd=self.work_dir)
        health = f"http://{HOST}:{self.frontend_port}/health"
        self._wait(haproxy, deadline, lambda: http_status(health) == 200 and self._all_up(), f"serve {health}")

    def _mcp_frontend(self) -> str:
        """The frontend clients use: the first one that is not the stats page."""
        assert self.config is not None
        stats = self.config.stats[0] if self.config.stats else None
        names = [name for name in self.config.binds if name != stats]
        if not names:
            raise ReferenceKitError(f"{self.checkout.haproxy_cfg} has no frontend besides its stats page")
        return names[0]

    def _all_up(self) -> bool:
        """Every server UP on its stats page (true when it has none: its /health answered through it)."""
        assert self.config is not None
        if self.config.stats is None:
            return True
        frontend, uri = self.config.stats
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.config.port_of(frontend)}{uri};csv", timeout=1) as r:
                text = r.read().decode()
        except (OSError, ValueError, urllib.error.URLError):
            return False
        rows = [line.split(",") for line in text.splitlines()]
        status = {r[1]: r[17] for r in rows if len(r) > 17 and r[1] in self.config.servers}
        return len(status) == len(self.config.servers) and all(s.startswith("UP") for s in status.values())

    def _spawn(self, name: str, argv: list[str], *, cwd: Path, env: dict[str, str] | None = None) -> Proc:
        assert self.work_dir is not None
        log = self.work_dir / f"{name}.log"
        base = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
        with open(log, "ab") as out:
            try:
                popen = subprocess.Popen(
                    argv,
                    cwd=cwd,
                    env={**base, **(env or {})},
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: stopped by its pid, with any children
                )
            except OSError as exc:
                raise ReferenceKitError(f"`{' '.join(argv)}` could not start: {exc}") from None
        proc = Proc(name, argv, log, popen)
        self.procs.append(proc)
        return proc

    def _wait(self, proc: Proc, deadline: float, ready, what: str) -> None:
        while not ready():
            if proc.popen.poll() is not None:
                raise ReferenceKitError(f"{proc.describe()} exited {proc.popen.returncode} before it would {what}")
            if time.monotonic() > deadline:
                raise ReferenceKitError(f"{proc.describe()} did not {what} within {self.timeout:.0f} s")
            time.sleep(0.1)

    def stop(self, *, keep_logs: bool = False) -> None:
        """Stop every process it started (TERM, then KILL past STOP_TIMEOUT), newest first; the temporary
        directory goes too, unless `keep_logs` (a start that failed keeps it, for its logs)."""
        for proc in reversed(self.procs):
            _signal(proc.popen, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.popen.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                _signal(proc.popen, signal.SIGKILL)
                proc.popen.wait(timeout=5)
        self.procs = []
        if self.work_dir is not None and not keep_logs:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def describe(self) -> dict:
        """What ran, for the report."""
        return {
            "checkout": str(self.checkout.path),
            "commit": self.checkout.commit(),
            "requirements_digest": self.checkout.digest(),
            "pinned": self.checkout.pinned(),
            "python": self.checkout.python_request(),
            "venv": str(self.venv),
            "replicas": self.replicas,
            "haproxy_cfg": "haproxy/haproxy.cfg, binds and servers rewritten to loopback ports",
        }


def _signal(popen: subprocess.Popen, sig: signal.Signals) -> None:
    """`sig` to the process group this runner made for `popen` (its pid is the group's id), while that pid
    is still the process it started (not yet reaped), so nobody else's process is ever signalled."""
    if popen.poll() is not None:
        return
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":  # python -m tools.reference PATH: start it, print its URL, stop on Enter
    kit = ReferenceKit(Checkout.at(sys.argv[1]), ensure_venv(Checkout.at(sys.argv[1])))
    with kit:
        print(kit.url, flush=True)
        input("Enter stops it. ")
