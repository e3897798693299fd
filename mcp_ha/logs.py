"""Pattern: logs a machine can read, one JSON object per line, each naming its request.

With three replicas behind a proxy, one session's story is spread over three
log files. So every line a replica writes (its own, FastMCP's, the SDK's,
uvicorn's access and error lines) is one JSON object with `time` (UTC, ISO
8601), `level`, `logger`, `message` and `instance`, and, when it was logged
while serving a request, that request's `session_id` (`mcp-session-id`) and
`request_id` (HAProxy's `X-Request-Id`, the same one replicas use as the
idempotency key): grep one id across every replica's log to follow a session
through a failover.

The ids come from request headers, so they are checked before they reach a
log line: a session id only in the form this kit mints
(`session_store.is_session_id`), a request id cut to 64 characters and
escaped unless printable. They are carried in a context variable that
`RequestIds` (ASGI middleware, outermost) sets for each request; the SDK
serves a call within its request's context, so FastMCP's and the tools' own
lines carry them too.

`LOG_FORMAT=text` keeps the human format of earlier versions.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any

import uvicorn.config
from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter
from starlette.types import ASGIApp, Receive, Scope, Send

from .session_store import is_session_id

FORMATS = ("json", "text")
MAX_REQUEST_ID = 64


class _Ids:
    """The ids of one request. Cleared when the request ends: tasks it started
    (the SDK's task for a new session) keep a reference and outlive it, and
    their later lines must not name a request long gone."""

    __slots__ = ("request_id", "session_id")

    def __init__(self, session_id: str | None, request_id: str | None) -> None:
        self.session_id = session_id
        self.request_id = request_id


_current: ContextVar[_Ids | None] = ContextVar("structured_logs_ids", default=None)


def safe_request_id(value: str | None) -> str | None:
    if not value:
        return None
    value = value[:MAX_REQUEST_ID]
    if not value.isprintable():
        value = value.encode("unicode_escape").decode("ascii")[:MAX_REQUEST_ID]
    return value


def _ids(session_id: str | None, request_id: str | None) -> _Ids:
    return _Ids(session_id if is_session_id(session_id) else None, safe_request_id(request_id))


class RequestIds:
    """ASGI middleware: the request's session and request ids, for every line logged while serving it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        session_id = request_id = None
        for name, value in scope["headers"]:
            if name == b"mcp-session-id":
                session_id = value.decode("latin-1")
            elif name == b"x-request-id":
                request_id = value.decode("latin-1")
        ids = _ids(session_id, request_id)
        token = _current.set(ids)
        try:
            await self.app(scope, receive, send)
        finally:
            _current.reset(token)
            ids.session_id = ids.request_id = None


class RequestFields(logging.Filter):
    """Adds `session_id` and `request_id` to a record logged while serving a request; never drops one."""

    def filter(self, record: logging.LogRecord) -> bool:
        ids = _current.get()
        if ids is not None:
            if ids.session_id is not None:
                record.session_id = ids.session_id
            if ids.request_id is not None:
                record.request_id = ids.request_id
        return True


def json_formatter(*, instance: str) -> logging.Formatter:
    return JsonFormatter(
        "{levelname}{name}{message}",
        style="{",
        rename_fields={"levelname": "level", "name": "logger"},
        static_fields={"instance": instance},
        timestamp="time",
        # uvicorn's copy of the message with terminal colours in it.
        reserved_attrs=[*RESERVED_ATTRS, "color_message"],
    )


def configure(*, log_format: str = "json", instance: str, level: str = "INFO") -> dict[str, Any] | None:
    """Send every log line of this process to stderr in `log_format`; the `log_config` to give uvicorn."""
    if log_format not in FORMATS:
        raise ValueError(f"LOG_FORMAT must be one of {', '.join(FORMATS)}, not {log_format!r}")
    if log_format == "text":
        logging.basicConfig(level=level, format=f"%(asctime)s {instance} %(levelname)s %(name)s: %(message)s")
        return uvicorn.config.LOGGING_CONFIG
    handler = logging.StreamHandler()
    handler.setFormatter(json_formatter(instance=instance))
    handler.addFilter(RequestFields())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Libraries that set up their own handlers (FastMCP's rich console) would
    # write lines of their own format: everything goes through the root's instead.
    for logger in list(logging.root.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger) and logger.handlers:
            logger.handlers.clear()
            logger.propagate = True
    logging.captureWarnings(True)
    return None  # uvicorn then leaves logging as it is: its loggers propagate to the root


class Expected(logging.Filter):
    """Drops the records of a logger that carry one of these exceptions: conditions the server
    expects, whose tracebacks would only bury real bugs (and, for a client's doing, let any client
    fill the log)."""

    def __init__(self, *exceptions: type[BaseException]) -> None:
        super().__init__()
        self.exceptions = exceptions

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], self.exceptions))
