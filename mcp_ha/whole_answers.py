"""A whole answer leaves a replica in one write, so a replica killed while answering leaves its head nowhere.

uvicorn writes an answer's head when the app sends it and its body when that comes: two writes, even
back to back. On a busy machine the kernel often switches to HAProxy, woken by the first write, before the
second: tens of milliseconds between them were measured (144 ms once; one answer in ten over 1 ms under
the failover benchmark's load). A replica killed there left HAProxy a head it had already passed on,
which it cannot re-send elsewhere, and the client a body that never came; an SDK client that gets one
never works again (test_failover). In one write, the kill finds the answer either sent whole or not at
all, and HAProxy re-sends a request nothing was answered for (`retry-on empty-response`), where the
request's id keeps it applied once.

`WholeAnswers` is uvicorn's httptools protocol with that one change: the head of an answer with a
Content-Length waits for the next write (its body, as Starlette sends it in the same step) or the end of
the event loop's turn, whichever comes first; streamed and chunked answers' heads go at once.
`HighAvailability.run` serves with it; a server run by uvicorn of its own passes `http=WholeAnswers`.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["WholeAnswers"]


class _HeadWaitsForBody:
    """The transport uvicorn writes to: a head alone with a Content-Length is joined to the write after it."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._head is not None:
            data, self._head = self._head + bytes(data), None
        elif _is_head_of_whole_answer(data):
            self._head = bytes(data)
            # A HEAD request's answer, or an app that sends its body only after awaiting: the head goes
            # at the end of this turn of the loop, as it would have (a paused process runs no turn).
            self._loop.call_soon(self._flush)
            return
        self._transport.write(data)

    def _flush(self) -> None:
        head, self._head = self._head, None
        if head is not None and not self._transport.is_closing():
            self._transport.write(head)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        # Everything else (flow control, extra info, pausing reads) is the transport's own.
        return getattr(self._transport, name)


def _is_head_of_whole_answer(data: bytes | bytearray | memoryview) -> bool:
    # uvicorn writes a head alone, ending in its blank line; an error answer of its own comes whole.
    if not (data[:9] == b"HTTP/1.1 " and data[-4:] == b"\r\n\r\n"):
        return False
    return b"\r\ncontent-length:" in bytes(data).lower()


class WholeAnswers(HttpToolsProtocol):
    """uvicorn's httptools protocol, writing an answer with a Content-Length in one write (module docstring)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        wrapped = _HeadWaitsForBody(cast(asyncio.Transport, transport), self.loop)
        super().connection_made(cast(asyncio.Transport, wrapped))
