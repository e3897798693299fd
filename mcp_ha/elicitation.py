"""Pattern: one call asks the user, for both generations and inside a task.

    answer = await ha.elicit(ctx, "Delete every job?", bool, name="confirm")
    if isinstance(answer, AcceptedElicitation) and answer.data: ...

How the question travels depends on who asked for the call, and the tool does
not care:

- **Session-era clients** (2025-11-25) are asked on the session's stream
  (`elicitation/create`), with a timeout. The answer is recorded with the
  call's writes (`Session.apply_once` under the call's idempotency key), so a
  re-run of the call on another replica (its replica died mid-call, or
  HAProxy or the client sent it again) gets the recorded answer instead of
  asking the user twice.
- **2026-07-28 clients**, and **tasks** (fastmcp-tasks re-runs a task's body
  once its input arrives), have no stream to ask on: `elicit` raises
  `InputNeeded`, which `AskForInput` (a FastMCP middleware the layer adds)
  turns into the call's `InputRequiredResult`. The client answers and sends
  the call again, to any replica; the tool runs again from its start and
  `elicit` finds the answer. Earlier answers ride in the request state, which
  the SDK seals (`request_state.py`), so a tool may ask several questions, one
  leg each, and none is asked twice. A tool that asks through `elicit` leaves
  `requestState` to it.

The answer is FastMCP's own: `AcceptedElicitation` (with `data` parsed as
`response_type` says, as `ctx.elicit` parses it), `DeclinedElicitation` or
`CancelledElicitation`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastmcp import Context
from fastmcp.exceptions import FastMCPError, ToolError
from fastmcp.server.elicitation import (
    AcceptedElicitation,
    CancelledElicitation,
    DeclinedElicitation,
    handle_elicit_accept,
    parse_elicit_response_type,
)
from fastmcp.server.middleware import Middleware, MiddlewareContext
from fastmcp.tools import InputRequiredToolResult
from mcp_types import ElicitRequest, ElicitRequestFormParams, ElicitResult, InputRequiredResult

from .handles import session_era_id
from .session_store import Session

Answer = AcceptedElicitation[Any] | DeclinedElicitation | CancelledElicitation

CANNOT_ASK = "This client declared no elicitation capability, so the tool cannot ask it: nothing was done."
NO_ANSWER = "No answer within {seconds:g} s; nothing was done."
# The request state `elicit` hands out: the answers given so far, by question name.
STATE_KEY = "mcp_ha.answers"


class InputNeeded(FastMCPError):
    """Raised by `elicit` for a client that answers in another leg; `AskForInput` makes it the result.

    A FastMCPError, because FastMCP passes those from a tool to the middlewares as they are (any other
    exception becomes a masked tool error first); at DEBUG, because asking is no error."""

    def __init__(self, result: InputRequiredResult) -> None:
        super().__init__("the call needs the client's input", log_level=logging.DEBUG)
        self.result = result


class AskForInput(Middleware):
    """A tool that raised `InputNeeded` answers the call with its `InputRequiredResult`."""

    async def on_call_tool(self, context: MiddlewareContext, call_next: Any) -> Any:
        try:
            return await call_next(context)
        except InputNeeded as needed:
            return InputRequiredToolResult(needed.result)


def _answer(config: Any, action: str, content: Any) -> Answer:
    if action == "accept":
        return handle_elicit_accept(config, content)
    return DeclinedElicitation() if action == "decline" else CancelledElicitation()


def _answers_so_far(ctx: Context) -> dict[str, dict[str, Any]]:
    """The answers earlier legs gathered (in the sealed state), and this leg's."""
    answers: dict[str, dict[str, Any]] = {}
    try:
        state = json.loads(ctx.request_state or "{}")
    except ValueError:
        state = {}
    if isinstance(state, dict) and isinstance(state.get(STATE_KEY), dict):
        answers.update(state[STATE_KEY])
    for name, reply in (ctx.input_responses or {}).items():
        if isinstance(reply, ElicitResult):
            answers[name] = {"action": reply.action, "content": reply.content}
    return answers


async def elicit(
    ctx: Context,
    session_of: Callable[[Context], Awaitable[Session]],
    message: str,
    response_type: Any,
    *,
    name: str,
    answer_within: float,
) -> Answer:
    """Ask the user `message`, expecting `response_type` (as `ctx.elicit` takes it); see the module.
    `session_of(ctx)`: the call's session-era `Session`, where the answer is recorded."""
    config = parse_elicit_response_type(response_type)
    if session_era_id(ctx) is not None and not ctx.is_background_task:
        capabilities = ctx.session.client_capabilities
        if capabilities is None or capabilities.elicitation is None:
            # It would never answer: say so now rather than hold the call open.
            raise ToolError(CANNOT_ASK, log_level=logging.DEBUG)  # the client's doing, not ours

        async def ask(_tx: Any) -> dict[str, Any]:
            try:
                async with asyncio.timeout(answer_within):
                    reply = await ctx.session.elicit(
                        message=message, requested_schema=config.schema, related_request_id=ctx.request_id
                    )
            except TimeoutError:
                raise ToolError(NO_ANSWER.format(seconds=answer_within)) from None
            return {"action": reply.action, "content": reply.content}

        # Recorded under the call's key: a re-run of this call gets this answer back, without asking.
        recorded = await (await session_of(ctx)).apply_once(ask, name=f"elicit:{name}")
        return _answer(config, recorded["action"], recorded["content"])
    answers = _answers_so_far(ctx)
    if name in answers:
        return _answer(config, answers[name]["action"], answers[name]["content"])
    form = ElicitRequestFormParams(message=message, requested_schema=config.schema)
    raise InputNeeded(
        InputRequiredResult(
            input_requests={name: ElicitRequest(params=form)}, request_state=json.dumps({STATE_KEY: answers})
        )
    )
