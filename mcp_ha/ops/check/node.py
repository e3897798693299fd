"""The TypeScript SDK client's Node process: where its SDK is installed, and one process serving every
ts_sdk session of a run over JSON lines (ts_client.mjs).

The SDK is pinned by node/package.json and node/package-lock.json, shipped with the check. Without
`--node-clients DIR`, it is installed once (`npm ci`) into ~/.cache/mcp-ha/node-clients/<lock hash>
(XDG_CACHE_HOME is respected) when node and npm are present. With `--node-clients DIR`, DIR must
already hold node_modules/@modelcontextprotocol/sdk (the kit's own tests pass tests/clients/ts).
Node finds an ES module's packages from the script's own folder, so the script is copied into the
cache folder, beside the SDK it installed or a link to DIR/node_modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "ts_client.mjs"
PINS = HERE / "node"
SDK = Path("node_modules") / "@modelcontextprotocol" / "sdk"
NPM_CI_TIMEOUT_SECONDS = 300


class NodeUnavailable(Exception):
    """The ts_sdk kind cannot run here; the message says why."""


def _cache_base() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mcp-ha"


def cache_dir() -> Path:
    lock = (PINS / "package-lock.json").read_bytes()
    return _cache_base() / "node-clients" / hashlib.sha256(lock).hexdigest()[:16]


def node_clients_missing(node_clients: str | Path | None = None) -> str | None:
    """Why the ts_sdk kind cannot run (without installing anything), or None when it can or could."""
    if shutil.which("node") is None:
        return "node is not installed"
    if node_clients is not None:
        if not (Path(node_clients) / SDK).is_dir():
            return f"{node_clients} holds no node_modules/@modelcontextprotocol/sdk (npm ci there)"
        return None
    if not (cache_dir() / SDK).is_dir() and shutil.which("npm") is None:
        return "npm is not installed, and the TypeScript SDK is not in the cache yet"
    return None


def prepare(node_clients: str | Path | None = None) -> Path:
    """The folder to run ts_client.mjs in, the SDK installed; NodeUnavailable when it cannot be."""
    if why := node_clients_missing(node_clients):
        raise NodeUnavailable(why)
    if node_clients is not None:
        # The script runs beside a link to the given node_modules: nothing is written into that folder.
        given = Path(node_clients).resolve()
        folder = _cache_base() / "node-run" / hashlib.sha256(str(given).encode()).hexdigest()[:16]
        folder.mkdir(parents=True, exist_ok=True)
        link = folder / "node_modules"
        if not link.is_symlink() or link.resolve() != given / "node_modules":
            link.unlink(missing_ok=True)
            link.symlink_to(given / "node_modules", target_is_directory=True)
    else:
        folder = cache_dir()
    if not (folder / SDK).is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copyfile(PINS / name, folder / name)
        try:
            subprocess.run(
                [shutil.which("npm") or "npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts"],
                cwd=folder,
                check=True,
                capture_output=True,
                timeout=NPM_CI_TIMEOUT_SECONDS,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            output = getattr(exc, "stderr", b"") or b""
            raise NodeUnavailable(f"npm ci in {folder} failed: {exc} {output.decode(errors='replace')[-400:]}") from exc
    script = folder / SCRIPT.name
    if not script.exists() or script.read_bytes() != SCRIPT.read_bytes():
        shutil.copyfile(SCRIPT, script)
    return folder


class NodeHost:
    """One `node ts_client.mjs` process, started at the first request; `request` sends one JSON line and
    awaits the line that answers it."""

    def __init__(self, node_clients: str | Path | None = None) -> None:
        self.node_clients = node_clients
        self.proc: asyncio.subprocess.Process | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._stderr = bytearray()
        self._lock = asyncio.Lock()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def _start(self) -> None:
        async with self._lock:
            if self.proc is not None:
                return
            folder = await asyncio.to_thread(prepare, self.node_clients)
            self.proc = await asyncio.create_subprocess_exec(
                shutil.which("node") or "node",
                str(folder / SCRIPT.name),
                cwd=folder,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                limit=1 << 22,
            )
            self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None and self.proc.stderr is not None
        stderr = asyncio.create_task(self._drain(self.proc.stderr))
        try:
            while raw := await self.proc.stdout.readline():
                try:
                    message = json.loads(raw)
                except ValueError:
                    log.warning("ts_client.mjs: not a JSON line: %r", raw[:200])
                    continue
                waiting = self._waiting.pop(message.get("re"), None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(message)
        finally:
            await stderr
            why = self._stderr.decode(errors="replace").strip()[-800:] or "(nothing on stderr)"
            for waiting in self._waiting.values():
                if not waiting.done():
                    waiting.set_exception(RuntimeError(f"the ts_sdk client ended: {why}"))
            self._waiting.clear()

    async def _drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            self._stderr += chunk

    async def request(self, message: dict[str, Any], *, within: float) -> dict[str, Any]:
        """The script's answer to `message`, awaited `within` seconds at most; RuntimeError when an open or
        a close is answered ok false."""
        await self._start()
        assert self.proc is not None and self.proc.stdin is not None
        if not self.running:
            raise RuntimeError(f"the ts_sdk client is not running: {self._stderr.decode(errors='replace')[-400:]}")
        number = next(self._ids)
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[number] = answer
        self.proc.stdin.write(json.dumps({**message, "id": number}).encode() + b"\n")
        await self.proc.stdin.drain()
        try:
            async with asyncio.timeout(within):
                result = await answer
        finally:
            self._waiting.pop(number, None)
        if message["op"] != "call" and not result.get("ok"):
            raise RuntimeError(f"ts_sdk {message['op']}: {result.get('error')}")
        return result

    async def aclose(self) -> None:
        proc = self.proc
        if proc is None:
            return
        try:
            if proc.stdin is not None and not proc.stdin.is_closing():
                proc.stdin.close()  # the script closes its sessions and exits
            try:
                async with asyncio.timeout(10):
                    await proc.wait()
            except TimeoutError:
                proc.kill()  # our own child
                await proc.wait()
        finally:
            if self._reader is not None:
                with contextlib.suppress(Exception):
                    await self._reader
