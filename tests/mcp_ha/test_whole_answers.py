"""whole_answers.py: an answer with a Content-Length leaves uvicorn in one write; a stream's head at once.

A real uvicorn (in a thread of this process) serves an app that stands still between its head and its body,
as a process the kernel has switched away from does; a raw socket reads what has left it by then.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from mcp_ha.ops.stack import free_ports
from mcp_ha.whole_answers import WholeAnswers

BODY = b'{"jsonrpc":"2.0","id":1,"result":{}}'
EVENT = b"data: {}\r\n\r\n"


class StandsStill:
    """The app: sends its head, then stands still (the whole loop, as a paused process) until `go` is set."""

    def __init__(self) -> None:
        self.go = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        if scope["path"] == "/stream":
            headers = [(b"content-type", b"text/event-stream")]
            body = EVENT
        else:
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
            body = BODY
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if scope["path"] != "/quick":
            assert self.go.wait(timeout=30)  # blocks the loop: nothing of this process runs meanwhile
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
def served() -> Iterator[tuple[int, StandsStill]]:
    app = StandsStill()
    (port,) = free_ports(1)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, http=WholeAnswers, lifespan="off", log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield port, app
    finally:
        app.go.set()
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def connection(port: int) -> Iterator[socket.socket]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        yield sock


def ask(sock: socket.socket, method: str, path: str) -> None:
    sock.sendall(f"{method} {path} HTTP/1.1\r\nhost: replica\r\n\r\n".encode())


def read_until(sock: socket.socket, end: bytes) -> bytes:
    data = b""
    while not data.endswith(end):
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    return data


def test_a_whole_answers_head_leaves_only_with_its_body(served: tuple[int, StandsStill]) -> None:
    """The process stands still after sending its head: none of the answer has left (a kill here leaves
    HAProxy nothing sent, which it re-sends); once it runs on, head and body come as one write, and the
    connection serves the next request as before."""
    port, app = served
    with connection(port) as sock:
        ask(sock, "GET", "/json")
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(65536)  # plain httptools: the head, at once
        sock.settimeout(10)
        app.go.set()
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ") and first.endswith(b"\r\n\r\n" + BODY), first
        ask(sock, "GET", "/quick")
        assert read_until(sock, BODY).startswith(b"HTTP/1.1 200 ")


def test_a_streams_head_leaves_at_once(served: tuple[int, StandsStill]) -> None:
    """A stream's head is not held: its client sees the answer begin before its first event exists."""
    port, app = served
    with connection(port) as sock:
        ask(sock, "GET", "/stream")
        head = read_until(sock, b"\r\n\r\n")  # while the process stands still
        assert head.startswith(b"HTTP/1.1 200 ") and b"text/event-stream" in head, head
        app.go.set()
        assert EVENT in read_until(sock, b"0\r\n\r\n")


def test_a_head_with_no_body_to_follow_still_leaves(served: tuple[int, StandsStill]) -> None:
    """HEAD: uvicorn writes no body after the head, which then goes at the end of the loop's turn."""
    port, _ = served
    with connection(port) as sock:
        ask(sock, "HEAD", "/quick")
        head = read_until(sock, b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and f"content-length: {len(BODY)}".encode() in head.lower()
