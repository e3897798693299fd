"""examples/jobs/server.py: a job runner whose jobs run inside their call, on a whole stack of its own
(redis, three replicas, haproxy), with stock clients of both generations and the raw client.

Where a test needs a job to be still running when it acts, the job is one no test machine finishes
in time (1000 steps of 0.05 s) and the test cancels it; no test asserts how long anything took.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx2
import pytest
from conftest import running_stack, starts
from fastmcp import Client
from fastmcp.client.elicitation import ElicitResult
from fastmcp.exceptions import ToolError

from mcp_ha._sdk import InlineClient
from mcp_ha.idempotency import IDEMPOTENCY_KEY
from mcp_ha.ops.check.wire import RawSession, jsonrpc_messages
from mcp_ha.ops.stack import Stack

pytestmark = pytest.mark.timeout(120)

MODULE = "examples.jobs.server"
# A job that outlasts any test that waits for it to be running: those tests end it themselves.
LONG = {"steps": 1000, "step_seconds": 0.05}
# The tests' own bound on waiting for something they expect (never what they assert).
WAIT_SECONDS = 30


@pytest.fixture(scope="module")
@starts("redis", "haproxy", "slow")
def jobs_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("jobs"), server=MODULE) as s:
        yield s


def wait_whole(stack: Stack) -> None:
    """Every service running and every replica UP in HAProxy."""
    for name in [svc.name for svc in stack.services()]:
        stack.start(name)  # a no-op for one already running
    stack.wait_healthy("haproxy")
    deadline = time.monotonic() + WAIT_SECONDS
    while stack.backends_up() != set(stack.config.replica_names()):
        assert time.monotonic() < deadline, f"HAProxy sees {stack.backend_status()}"
        time.sleep(0.1)


@pytest.fixture
def whole_stack(jobs_stack: Stack) -> Iterator[Stack]:
    """For the tests that kill a replica: whole before and after."""
    wait_whole(jobs_stack)
    yield jobs_stack
    wait_whole(jobs_stack)


def replica_url(stack: Stack, name: str) -> str:
    return f"http://127.0.0.1:{stack.service(name).port}/mcp"


@contextlib.asynccontextmanager
async def connected(url: str, generation: str, **options: Any) -> AsyncIterator[tuple[Client, dict[str, Any]]]:
    """FastMCP's Client in one generation, and the arguments its stateful calls carry: none for a
    session-era client (its MCP session holds the state), the handle for a sessionless one. "sessionless"
    does not ask for tasks, "tasks" does (FastMCP's tasks extension: start_job runs as a task)."""
    if generation == "session-era":
        async with Client(url, mode="legacy", timeout=WAIT_SECONDS, **options) as client:
            yield client, {}
    else:
        kind = InlineClient if generation == "sessionless" else Client
        async with kind(url, timeout=WAIT_SECONDS, **options) as client:
            handle = (await client.call_tool("create_session", {})).data["session_id"]
            yield client, {"session_id": handle}


async def call(client: Client, tool: str, arguments: dict[str, Any], **options: Any) -> dict[str, Any]:
    result = (await client.call_tool(tool, arguments, **options)).structured_content
    assert isinstance(result, dict), result
    return result


def without_instance(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != "instance"}


@pytest.mark.parametrize("generation", ["session-era", "sessionless"])
async def test_a_job_reports_its_progress_and_finishes(jobs_stack: Stack, generation: str) -> None:
    progress: list[tuple[float, float | None]] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append((done, total))

    async with connected(jobs_stack.config.mcp_url, generation) as (client, session):
        started = await call(
            client,
            "start_job",
            {"name": "build", "steps": 5, "step_seconds": 0.02, **session},
            progress_handler=on_progress,
        )
        job = started["job"]
        assert job == {"id": job["id"], "name": "build", "steps": 5, "done": 5, "state": "done"}
        assert progress == [(step, 5) for step in range(1, 6)]
        assert (await call(client, "job_status", {"job_id": job["id"], **session}))["job"] == job
        empty = await call(client, "start_job", {"name": "nothing", "steps": 0, **session})
        assert empty["job"]["state"] == "done" and empty["job"]["done"] == 0
        listed = await call(client, "list_jobs", session)
        assert (listed["jobs"], listed["count"]) == ([job, empty["job"]], 2)  # oldest first


async def test_a_job_runs_as_a_task_for_a_client_that_asks(jobs_stack: Stack) -> None:
    """FastMCP's Client with its tasks extension: start_job answers with a task, polled to the same job; its
    status message counts the steps; the session holds the one job."""
    fastmcp_tasks = pytest.importorskip("fastmcp_tasks", reason="tasks need the kit's tasks extra")
    async with connected(jobs_stack.config.mcp_url, "tasks") as (client, session):
        arguments = {"name": "tasked", "steps": 8, "step_seconds": 0.1, **session}
        task = await fastmcp_tasks.call_tool_task(client, "start_job", arguments)
        messages = set()
        async with asyncio.timeout(WAIT_SECONDS):
            while (status := await task.status()).status == "working":
                messages.add(status.status_message)
                await asyncio.sleep(0.05)
        assert status.status == "completed", status
        job = (await task.result()).structured_content["job"]
        assert job == {"id": job["id"], "name": "tasked", "steps": 8, "done": 8, "state": "done"}
        assert {m for m in messages if m} <= {f"step {n}/8" for n in range(1, 9)} and len(messages) > 2, messages
        # call_tool drives the task to its end itself.
        again = await call(client, "start_job", {"name": "again", "steps": 2, "step_seconds": 0, **session})
        assert again["job"]["state"] == "done"
        assert (await call(client, "list_jobs", session))["count"] == 2


async def test_a_cancel_through_one_replica_stops_a_job_running_on_another(jobs_stack: Stack) -> None:
    """Sessionless clients, each speaking to one replica directly: the job runs on the first, the second
    and third see it running, the third cancels it, and the job stops at its next step."""
    one, two, three = jobs_stack.config.replica_names()
    progress: list[float] = []
    running = asyncio.Event()

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(done)
        if done >= 3:
            running.set()

    async with (
        InlineClient(replica_url(jobs_stack, one), timeout=WAIT_SECONDS * 2) as runner,  # streams its progress
        Client(replica_url(jobs_stack, two), timeout=WAIT_SECONDS) as watcher,
        Client(replica_url(jobs_stack, three), timeout=WAIT_SECONDS) as canceller,
    ):
        handle = (await runner.call_tool("create_session", {})).data["session_id"]
        session = {"session_id": handle}
        started = asyncio.create_task(
            call(runner, "start_job", {"name": "long", **LONG, **session}, progress_handler=on_progress)
        )
        try:
            await asyncio.wait_for(running.wait(), WAIT_SECONDS)
            listed = await call(watcher, "list_jobs", session)
            assert listed["count"] == 1 and listed["instance"] == two
            (seen,) = listed["jobs"]
            assert seen["state"] == "running" and seen["done"] >= 3
            status = await call(canceller, "job_status", {"job_id": seen["id"], **session})
            assert status["job"]["state"] == "running" and status["job"]["done"] >= seen["done"]

            cancelled = await call(canceller, "cancel_job", {"job_id": seen["id"], **session})
            assert cancelled["instance"] == three and cancelled["job"]["state"] == "cancelled"
            ended = await asyncio.wait_for(started, WAIT_SECONDS)
        finally:
            started.cancel()  # a no-op once it ended; else the test failed, and the call is let go
        job = ended["job"]
        assert ended["instance"] == one
        assert job["id"] == seen["id"] and job["state"] == "cancelled"
        assert status["job"]["done"] <= job["done"] < LONG["steps"]
        # It stopped where the store says it did, and reported no step it did not record.
        assert max(progress) == job["done"]
        assert (await call(watcher, "job_status", {"job_id": job["id"], **session}))["job"] == job
        # Cancelling an ended job leaves it as it is.
        assert (await call(watcher, "cancel_job", {"job_id": job["id"], **session}))["job"] == job


async def test_a_session_era_job_is_seen_from_another_replica(jobs_stack: Stack, http: httpx2.AsyncClient) -> None:
    raw = RawSession(http, jobs_stack.config.mcp_url)
    await raw.initialize()
    started = await raw.call("start_job", {"name": "here", "steps": 3, "step_seconds": 0.01})
    elsewhere = next(name for name in jobs_stack.config.replica_names() if name != started["instance"])
    other = raw.at(replica_url(jobs_stack, elsewhere))  # the same session, adopted there
    status = await other.call("job_status", {"job_id": started["job"]["id"]})
    assert status == {"job": started["job"], "instance": elsewhere}
    assert (await other.call("list_jobs"))["jobs"] == [started["job"]]


def keyed_start(arguments: dict[str, Any], key: str, token: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {IDEMPOTENCY_KEY: key}
    if token is not None:
        meta["progressToken"] = token
    return {"name": "start_job", "arguments": arguments, "_meta": meta}


def answer_and_progress(response: httpx2.Response) -> tuple[dict[str, Any], list[float]]:
    messages = jsonrpc_messages(response)
    answer = messages[-1]
    assert "result" in answer and not answer["result"].get("isError"), answer
    progress = [m["params"]["progress"] for m in messages if m.get("method") == "notifications/progress"]
    return answer["result"]["structuredContent"], progress


async def test_one_start_job_sent_twice_with_one_key_creates_one_job(
    jobs_stack: Stack, http: httpx2.AsyncClient
) -> None:
    raw = RawSession(http, jobs_stack.config.mcp_url)
    await raw.initialize()
    arguments = {"name": "once", "steps": 4, "step_seconds": 0.01}
    key = uuid.uuid4().hex
    first, _ = answer_and_progress(await raw.post("tools/call", keyed_start(arguments, key)))
    again, _ = answer_and_progress(await raw.post("tools/call", keyed_start(arguments, key)))
    assert again["job"] == first["job"] and first["job"]["state"] == "done"
    # Both at once, under another key: two runs of one call, one job, every step of it recorded.
    key = uuid.uuid4().hex
    arguments = {"name": "twice at once", "steps": 20, "step_seconds": 0.02}
    both = await asyncio.gather(*(raw.post("tools/call", keyed_start(arguments, key)) for _ in range(2)))
    (a, _), (b, _) = (answer_and_progress(response) for response in both)
    assert a["job"] == b["job"] and a["job"]["done"] == 20 and a["job"]["state"] == "done"
    listed = await raw.call("list_jobs")
    assert listed["count"] == 2 and [job["id"] for job in listed["jobs"]] == [first["job"]["id"], a["job"]["id"]]


async def test_a_retry_after_its_replica_died_resumes_from_the_last_step_recorded(
    whole_stack: Stack, http: httpx2.AsyncClient
) -> None:
    """The call streams from its replica, which is killed mid-job; the client sends it again through
    HAProxy with the same key, and another replica carries on the same job from where the store has it."""
    stack = whole_stack
    raw = RawSession(http, stack.config.mcp_url)
    await raw.initialize()
    replica = (await raw.call("list_jobs"))["instance"]
    direct = raw.at(replica_url(stack, replica))
    arguments = {"name": "resumed", "steps": 30, "step_seconds": 0.05}
    key = uuid.uuid4().hex
    seen = 0.0
    async with asyncio.timeout(WAIT_SECONDS), direct.stream("tools/call", keyed_start(arguments, key, "p")) as events:
        async for event in events:
            if event.message is not None and event.message.get("method") == "notifications/progress":
                seen = event.message["params"]["progress"]
                if seen >= 5:
                    stack.signal(replica, signal.SIGKILL)
                    break
    assert seen >= 5, "the call did not stream its progress"
    # HAProxy takes the dead replica out first: a retry sent sooner could be cut by that mark-down.
    deadline = time.monotonic() + WAIT_SECONDS
    while stack.backend_status().get(replica, "DOWN").startswith("UP") and time.monotonic() < deadline:  # noqa: ASYNC110 (HAProxy's state, in another process)
        await asyncio.sleep(0.1)

    retried, progress = answer_and_progress(await raw.post("tools/call", keyed_start(arguments, key, "p")))
    job = retried["job"]
    assert retried["instance"] != replica
    assert job["state"] == "done" and job["done"] == 30
    # Resumed, not run again from the start: its first step is past every step the first run reported.
    assert progress and progress[0] > seen and progress[-1] == 30, progress
    assert progress == list(range(int(progress[0]), 31))
    listed = await raw.call("list_jobs")
    assert listed["jobs"] == [job]


async def test_a_streamed_job_whose_replica_dies_is_finished_elsewhere_once(whole_stack: Stack) -> None:
    """FastMCP's session-era client resumes the cut stream on another replica, which runs the call again
    under its key (the kit's re-run): the client gets the job finished, and the session holds one job."""
    stack = whole_stack
    progress: list[float] = []
    enough = asyncio.Event()

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(done)
        if done >= 3:
            enough.set()

    async with Client(stack.config.mcp_url, mode="legacy", timeout=WAIT_SECONDS) as client:
        replica = (await call(client, "list_jobs", {}))["instance"]
        arguments = {"name": "streamed", "steps": 25, "step_seconds": 0.1}
        started = asyncio.create_task(call(client, "start_job", arguments, progress_handler=on_progress))
        try:
            await asyncio.wait_for(enough.wait(), WAIT_SECONDS)
            stack.signal(replica, signal.SIGKILL)
            ended = await asyncio.wait_for(started, WAIT_SECONDS)
        finally:
            started.cancel()
        job = ended["job"]
        assert ended["instance"] != replica
        assert job["state"] == "done" and job["done"] == 25
        assert progress[-1] == 25 and progress == sorted(progress)
        assert (await call(client, "list_jobs", {}))["jobs"] == [job]
        session_id = client.transport.get_session_id()
    logs = [path.read_text(errors="replace") for path in stack.log_dir.glob("mcp-server-*.log")]
    assert any("re-running call" in line and str(session_id) in line for text in logs for line in text.splitlines())


@pytest.mark.parametrize("answer", ["accept", "decline"])
@pytest.mark.parametrize("generation", ["session-era", "sessionless"])
async def test_delete_all_jobs_asks_first(jobs_stack: Stack, generation: str, answer: str) -> None:
    asked: list[str] = []

    async def handler(message: str, response_type: type, params: object, context: object) -> object:
        asked.append(message)
        if answer == "decline":
            return ElicitResult(action="decline")
        return True

    async with connected(jobs_stack.config.mcp_url, generation, elicitation_handler=handler) as (client, session):
        for name in ("a", "b"):
            await call(client, "start_job", {"name": name, "steps": 1, "step_seconds": 0, **session})
        done = await call(client, "delete_all_jobs", session)
        assert asked == ["Delete every job of this session (2 in all)?"]
        listed = await call(client, "list_jobs", session)
    if answer == "accept":
        assert done["deleted"] == 2 and listed["count"] == 0 and listed["jobs"] == []
    else:
        assert done["deleted"] == 0 and listed["count"] == 2


@pytest.mark.parametrize("generation", ["session-era", "sessionless"])
async def test_a_rerun_of_delete_all_jobs_does_not_ask_again(jobs_stack: Stack, generation: str) -> None:
    """The call sent again under its key (as after its replica died): the user was asked once, and the
    re-run answers as the first run did (ha.elicit records the answer with the call's writes). Declined,
    so that the re-run reaches the question again."""
    asked: list[str] = []

    async def handler(message: str, response_type: type, params: object, context: object) -> object:
        asked.append(message)
        return ElicitResult(action="decline")

    key = {"io.github.mcp-ha-kit/idempotency-key": f"delete-{uuid.uuid4().hex}"}
    async with connected(jobs_stack.config.mcp_url, generation, elicitation_handler=handler) as (client, session):
        await call(client, "start_job", {"name": "a", "steps": 1, "step_seconds": 0, **session})
        first = await call(client, "delete_all_jobs", session, meta=key)
        again = await call(client, "delete_all_jobs", session, meta=key)
    # A 2026-07-28 re-run starts again from its first leg, whose answer the client gives again: the
    # server never holds the question open, so only a session-era call can be re-run mid-question.
    assert len(asked) == (1 if generation == "session-era" else 2)
    assert without_instance(first) == without_instance(again) == {"deleted": 0}


async def test_delete_all_jobs_refuses_a_client_that_cannot_be_asked(
    jobs_stack: Stack, http: httpx2.AsyncClient
) -> None:
    raw = RawSession(http, jobs_stack.config.mcp_url)  # declares no elicitation capability
    await raw.initialize()
    await raw.call("start_job", {"name": "kept", "steps": 1, "step_seconds": 0})
    answer = jsonrpc_messages(await raw.post("tools/call", {"name": "delete_all_jobs", "arguments": {}}))[-1]
    assert answer["result"]["isError"] and "no elicitation capability" in answer["result"]["content"][0]["text"]
    assert (await raw.call("list_jobs"))["count"] == 1


async def test_a_deleted_job_stops_and_says_so(jobs_stack: Stack) -> None:
    running = asyncio.Event()

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        running.set()

    async def confirm(message: str, response_type: type, params: object, context: object) -> object:
        return True

    async with connected(jobs_stack.config.mcp_url, "sessionless", elicitation_handler=confirm) as (client, session):
        started = asyncio.create_task(
            call(client, "start_job", {"name": "doomed", **LONG, **session}, progress_handler=on_progress)
        )
        try:
            await asyncio.wait_for(running.wait(), WAIT_SECONDS)
            assert (await call(client, "delete_all_jobs", session))["deleted"] == 1
            with pytest.raises(ToolError, match="was deleted"):
                await asyncio.wait_for(started, WAIT_SECONDS)
        finally:
            started.cancel()
        assert (await call(client, "list_jobs", session))["count"] == 0


@pytest.mark.parametrize(
    "arguments",
    [
        {"name": "x", "steps": 1001},
        {"name": "x", "steps": -1},
        {"name": "x", "step_seconds": 5.5},
        {"name": "x", "step_seconds": -0.1},
        {"name": "x" * 101},
        {"name": ""},
    ],
)
async def test_start_job_refuses_arguments_out_of_bounds(jobs_stack: Stack, arguments: dict[str, Any]) -> None:
    async with connected(jobs_stack.config.mcp_url, "session-era") as (client, _):
        with pytest.raises(ToolError):
            await client.call_tool("start_job", arguments)
        assert (await call(client, "list_jobs", {}))["count"] == 0


@pytest.mark.parametrize("tool", ["job_status", "cancel_job"])
@pytest.mark.parametrize("job_id", ["0123456789abcdef", "not an id", "x" * 64])
async def test_an_unknown_job_is_a_clear_tool_error(jobs_stack: Stack, tool: str, job_id: str) -> None:
    async with connected(jobs_stack.config.mcp_url, "session-era") as (client, _):
        await call(client, "start_job", {"name": "known", "steps": 0})
        with pytest.raises(ToolError, match="This session has no job"):
            await client.call_tool(tool, {"job_id": job_id})
