"""Durable tasks (mcp_ha/tasks.py): a `task=True` tool runs as a task for FastMCP's default client, survives
the death of its replica, runs once while it lives, is cancelled from any replica, belongs to its principal,
and is bounded. The stack is real (`tasks_stack`: Redis as the kit's ACL user, two replicas of
tests/mcp_ha/tasks_server.py, HAProxy); the quick tests at the end run in process."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastmcp_tasks", reason="durable tasks need the kit's tasks extra (fastmcp-tasks)")

import fastmcp_tasks
from conftest import TASK_BOUNDS, replica_on, running_stack, stack_config
from fastmcp import Client
from fastmcp.exceptions import ToolError
from fastmcp_tasks import ToolTask, call_tool_task
from mcp.shared.exceptions import MCPError

from mcp_ha.ops.stack import Stack
from mcp_ha.session_store import SessionStore
from mcp_ha.settings import Settings, SettingsError
from mcp_ha.stores.memory_store import InMemorySessionStore
from mcp_ha.streams.lease import Runs
from mcp_ha.tasks import DOCKET_NAME, RUNNER_META, TaskRuns, docket_url

assert fastmcp_tasks.__version__
# Kill -9 runs of the takeover test: TASK_KILL_RUNS=5 pytest tests/mcp_ha/test_tasks.py -k kill -s prints them.
KILL_RUNS = int(os.environ.get("TASK_KILL_RUNS", "1"))
# How long the store outage test keeps every Redis node down: several of the worker's reconnection attempts.
OUTAGE_SECONDS = 4


def runs_log(stack: Stack) -> list[list[str]]:
    path = stack.config.state_dir / "runs.log"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def runs_of(stack: Stack, task_id: str) -> list[tuple[str, str]]:
    """(event, replica) of each start and end of the task's body, in order."""
    return [(event, replica) for event, replica, tid, _ in runs_log(stack) if tid == task_id]


async def started_on(stack: Stack, task_id: str, limit: float = 15) -> str:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        starts = [replica for event, replica in runs_of(stack, task_id) if event == "START"]
        if starts:
            return starts[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"task {task_id} never started")


async def until(
    task: ToolTask, statuses: tuple[str, ...], limit: float = 30, every: float = 0.1, messages: list[str] | None = None
) -> Any:
    """Poll `tasks/get` until one of `statuses`; a poll that fails (its replica just died) is tried again.
    Each `statusMessage` seen goes into `messages`."""
    deadline = time.monotonic() + limit
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = await task.status()
        except Exception as exc:
            last = exc
        else:
            if messages is not None and last.status_message:
                messages.append(last.status_message)
            if last.status in statuses:
                return last
        await asyncio.sleep(every)
    raise AssertionError(f"task {task.task_id} not {statuses} within {limit} s: {last!r}")


async def named_runner(task: ToolTask, limit: float = 15) -> str:
    """The replica `tasks/get` names as running the task, once it names one."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        got = await task.status()
        if runner := (got.meta or {}).get(RUNNER_META):
            return runner
        await asyncio.sleep(0.05)
    raise AssertionError(f"tasks/get never named the replica running task {task.task_id}")


def replica_url(stack: Stack, name: str) -> str:
    port = stack.config.replica_ports[stack.config.replica_names().index(name)]
    return f"http://{stack.config.host}:{port}/mcp"


@pytest.fixture
async def alice(tasks_stack: Stack, auth_tokens: dict[str, str]) -> AsyncIterator[Client]:
    """FastMCP's default client (2026-07-28, tasks on), as alice, through HAProxy."""
    async with Client(tasks_stack.config.mcp_url, auth=auth_tokens["alice"], timeout=30) as c:
        yield c


@pytest.fixture
async def bob(tasks_stack: Stack, auth_tokens: dict[str, str]) -> AsyncIterator[Client]:
    async with Client(tasks_stack.config.mcp_url, auth=auth_tokens["bob"], timeout=30) as c:
        yield c


async def handle(client: Client) -> str:
    return (await client.call_tool("create_session", {})).data["session_id"]


async def counted(client: Client, session_id: str) -> int:
    return (await client.call_tool("count", {"session_id": session_id})).data["steps"]


async def test_a_task_tool_runs_as_a_task_for_the_default_client(tasks_stack: Stack, alice: Client) -> None:
    h = await handle(alice)
    task = await call_tool_task(alice, "job", {"steps": 3, "step_seconds": 0.05, "session_id": h})
    assert (await task.result()).data["steps"] == 3
    assert [event for event, _ in runs_of(tasks_stack, task.task_id)] == ["START", "END"]
    # FastMCP's call_tool drives the task to its end by itself.
    assert (await alice.call_tool("job", {"steps": 2, "step_seconds": 0.05, "session_id": h})).data["counted"] == 5
    assert await counted(alice, h) == 5


async def test_a_session_era_client_gets_the_same_tool_inline(tasks_stack: Stack, auth_tokens: dict[str, str]) -> None:
    async with Client(tasks_stack.config.mcp_url, mode="legacy", auth=auth_tokens["alice"], timeout=30) as legacy:
        before = len(runs_log(tasks_stack))
        result = await legacy.call_tool("job", {"steps": 2, "step_seconds": 0.05})
        assert result.data["steps"] == 2 and result.data["counted"] == 2
        # Run in the call, not as a task (no task id).
        assert [(event, tid) for event, _, tid, _ in runs_log(tasks_stack)[before:]] == [
            ("START", "None"),
            ("END", "None"),
        ]
        with pytest.raises(ToolError, match="did not run as a task"):
            await call_tool_task(legacy, "job", {"steps": 1, "step_seconds": 0.01})


async def test_kill_9_of_the_replica_running_a_task_another_completes_it_once(
    tasks_stack: Stack, alice: Client
) -> None:
    """The issue's promise: taken over after the death (about TASK_REDELIVERY_SECONDS=4 later: printed), run
    again from its start on the other replica, every write applied once, the right result."""
    figures = []
    for _ in range(KILL_RUNS):
        h = await handle(alice)
        steps = 16
        task = await call_tool_task(alice, "job", {"steps": steps, "step_seconds": 0.25, "session_id": h})
        runner = await started_on(tasks_stack, task.task_id)
        assert await named_runner(task) == runner  # tasks/get says which replica runs it
        await asyncio.sleep(1.5)  # a few steps written
        assert 0 < await counted(alice, h) < steps
        killed_at = time.time()
        tasks_stack.signal(runner, signal.SIGKILL)
        try:
            seen: list[str] = []
            final = await until(task, ("completed", "failed", "cancelled"), limit=40, every=0.05, messages=seen)
            done_at = time.time()
            assert final.status == "completed", final
            survivor = next(n for n in tasks_stack.config.replica_names() if n != runner)
            # The re-run starts again from step 1; what the client sees never goes back.
            reached = [int(m.split()[1].split("/")[0]) for m in seen]
            assert reached == sorted(reached) and reached[-1] > reached[0], seen
            assert any(m.endswith(f"on {survivor}") for m in seen), seen
            assert final.result["structuredContent"] == {"steps": steps, "counted": steps, "instance": survivor}
            assert await counted(alice, h) == steps  # the first run's writes replayed, not applied again
            assert runs_of(tasks_stack, task.task_id) == [("START", runner), ("START", survivor), ("END", survivor)]
            rerun_at = [float(at) for event, _, tid, at in runs_log(tasks_stack) if tid == task.task_id][1]
            # Taken over about TASK_REDELIVERY_SECONDS after the death: a figure, not asserted (a time on a
            # shared 2-core machine); that it was taken over at all, and ran once more, is asserted above.
            figures.append((round(rerun_at - killed_at, 2), round(done_at - killed_at, 2)))
        finally:
            tasks_stack.start(runner)
    print("\nkill -9 -> re-run started on the other replica, kill -9 -> task completed (s):", figures)


async def test_a_task_asks_through_ha_elicit_once_even_when_its_replica_dies(
    tasks_stack: Stack, auth_tokens: dict[str, str]
) -> None:
    """`ha.elicit` inside a task: the task waits for its client's input (tasks/update, which FastMCP's client
    answers through its elicitation handler), then counts; its replica killed mid-count, the run that takes
    it over finds the answer and does not ask again."""
    asked: list[str] = []

    async def answer(message: str, response_type: Any, params: Any, context: Any) -> Any:
        asked.append(message)
        return {"value": True}

    token = auth_tokens["alice"]
    async with Client(tasks_stack.config.mcp_url, auth=token, timeout=30, elicitation_handler=answer) as c:
        h = await handle(c)
        steps = 16
        task = await call_tool_task(c, "confirmed_job", {"steps": steps, "step_seconds": 0.25, "session_id": h})
        outcome = asyncio.create_task(task.result())  # answers the question, then polls to the end
        runner = await started_on(tasks_stack, task.task_id)  # the body counts once answered
        await asyncio.sleep(1.5)
        tasks_stack.signal(runner, signal.SIGKILL)
        try:
            result = await asyncio.wait_for(outcome, 60)
        finally:
            tasks_stack.start(runner)
        assert asked == [f"Count {steps} steps?"]  # asked once, not again by the run that took over
        assert result.data["counted"] == steps and result.data["instance"] != runner
        assert await counted(c, h) == steps
        starts = [replica for event, replica in runs_of(tasks_stack, task.task_id) if event == "START"]
        assert starts == [runner, result.data["instance"]]


async def test_a_live_task_delivered_again_is_not_run_twice(tasks_stack: Stack, alice: Client) -> None:
    """Every connection of the kit's Redis user cut once (`CLIENT KILL USER`): the runner's Docket worker stops
    renewing the task's lease until the task ends, and the other replica's worker takes the task after
    TASK_REDELIVERY_SECONDS, while it still runs. The second delivery finds the first run's replica alive and
    waits for its outcome: one run, one result, every write once."""
    h = await handle(alice)
    steps = 24
    task = await call_tool_task(alice, "job", {"steps": steps, "step_seconds": 0.5, "session_id": h})
    runner = await started_on(tasks_stack, task.task_id)
    await asyncio.sleep(1)
    tasks_stack.redis_command("redis", "CLIENT", "KILL", "USER", tasks_stack.config.redis_user)
    final = await until(task, ("completed", "failed", "cancelled"), limit=60)
    assert final.status == "completed", final
    assert final.result["structuredContent"] == {"steps": steps, "counted": steps, "instance": runner}
    assert runs_of(tasks_stack, task.task_id) == [("START", runner), ("END", runner)]
    assert await counted(alice, h) == steps
    other = next(n for n in tasks_stack.config.replica_names() if n != runner)
    # It was delivered again (else this test shows nothing), and that delivery waited.
    assert "delivered again while it runs elsewhere" in (tasks_stack.log_dir / f"{other}.log").read_text()


async def test_a_replica_told_to_stop_finishes_its_task_and_nobody_runs_it_again(
    tasks_stack: Stack, alice: Client
) -> None:
    """SIGTERM mid-task: the replica drains, and its task worker finishes the task before the process exits,
    holding the replica's lease until then (replica.py's lifespan), so the other replica, which Docket may
    hand the task meanwhile, waits instead of running it too."""
    h = await handle(alice)
    steps = 28
    task = await call_tool_task(alice, "job", {"steps": steps, "step_seconds": 0.25, "session_id": h})
    runner = await started_on(tasks_stack, task.task_id)
    await asyncio.sleep(0.5)
    try:
        tasks_stack.stop(runner)  # SIGTERM; returns once the process has exited
        final = await until(task, ("completed", "failed", "cancelled"), limit=30)
        assert final.status == "completed", final
        assert final.result["structuredContent"] == {"steps": steps, "counted": steps, "instance": runner}
        assert runs_of(tasks_stack, task.task_id) == [("START", runner), ("END", runner)]
        assert await counted(alice, h) == steps
    finally:
        tasks_stack.start(runner)


async def test_a_cancel_through_another_replica_wins(
    tasks_stack: Stack, alice: Client, auth_tokens: dict[str, str]
) -> None:
    h = await handle(alice)
    steps = 40
    task = await call_tool_task(alice, "job", {"steps": steps, "step_seconds": 0.25, "session_id": h})
    runner = await started_on(tasks_stack, task.task_id)
    other = next(n for n in tasks_stack.config.replica_names() if n != runner)
    await asyncio.sleep(1)
    async with Client(replica_url(tasks_stack, other), auth=auth_tokens["alice"], timeout=30) as direct:
        there = ToolTask(direct, "job", task.create_result)
        await there.cancel()
        final = await until(there, ("cancelled", "completed", "failed"), limit=10, every=0.02)
        assert final.status == "cancelled", final
    stopped = await counted(alice, h)
    await asyncio.sleep(1)
    assert await counted(alice, h) == stopped < steps  # the run on the other replica stopped
    assert runs_of(tasks_stack, task.task_id) == [("START", runner)]
    assert (await task.status()).status == "cancelled"


async def test_another_principals_task_is_not_found_as_one_that_never_existed(
    tasks_stack: Stack, alice: Client, bob: Client
) -> None:
    task = await call_tool_task(alice, "job", {"steps": 4, "step_seconds": 0.25})
    made_up = task.create_result.model_copy(update={"task_id": "x" * len(task.task_id)})
    errors = []
    for create_result, client in ((task.create_result, bob), (made_up, bob)):
        as_bob = ToolTask(client, "job", create_result)
        with pytest.raises(MCPError) as got:
            await as_bob.status()
        with pytest.raises(MCPError) as cancel:
            await as_bob.cancel()
        errors.append(
            [(e.value.error.code, e.value.error.message.replace(create_result.task_id, "ID")) for e in (got, cancel)]
        )
    assert errors[0] == errors[1] == [(-32602, "Task ID not found")] * 2
    assert (await until(task, ("completed",))).status == "completed"  # bob's cancel touched nothing


async def test_each_bound_refuses_clearly(tasks_stack: Stack, alice: Client, bob: Client) -> None:
    limit = int(TASK_BOUNDS["MAX_TASKS_PER_CLIENT"])
    h, hb = await handle(alice), await handle(bob)
    job = {"steps": 100, "step_seconds": 0.2, "session_id": h}
    held = [await call_tool_task(alice, "job", job) for _ in range(limit)]
    try:
        for task in held:
            await until(task, ("working",))
        quick = {"steps": 1, "step_seconds": 0.01}
        refused = await alice.call_tool("job", {**quick, "session_id": h}, raise_on_error=False)
        assert refused.is_error and "MAX_TASKS_PER_CLIENT" in refused.content[0].text, refused
        # Another client is not held back.
        assert (await bob.call_tool("job", {**quick, "session_id": hb})).data["steps"] == 1
        # A finished (here cancelled) task frees its place.
        await held[0].cancel()
        await until(held[0], ("cancelled",))
        await asyncio.sleep(1.1)  # a full client's slots are looked at again at most once a second
        assert (await alice.call_tool("job", {**quick, "session_id": h})).data["steps"] == 1
    finally:
        for task in held:
            await task.cancel()
        for task in held:
            await until(task, ("cancelled",))
    too_big = await alice.call_tool(
        "sized", {"size": 2 * int(TASK_BOUNDS["MAX_TASK_RESULT_BYTES"])}, raise_on_error=False
    )
    assert too_big.is_error and "MAX_TASK_RESULT_BYTES" in too_big.content[0].text, too_big
    assert (await alice.call_tool("sized", {"size": 100})).data == "x" * 100
    # A finished task is kept TASK_TTL_SECONDS, then gone.
    ttl = int(TASK_BOUNDS["TASK_TTL_SECONDS"])
    kept = await call_tool_task(alice, "sized", {"size": 10})
    assert kept.create_result.ttl_ms == ttl * 1000
    await until(kept, ("completed",))
    keys = tasks_stack.redis_command("redis", "KEYS", f"{DOCKET_NAME}:runs:*{kept.task_id}*")
    assert isinstance(keys, list) and keys, keys
    assert all(0 < tasks_stack.redis_command("redis", "TTL", key) <= ttl for key in keys)  # type: ignore[operator]


@pytest.mark.redis
@pytest.mark.slow
async def test_tasks_run_on_redis_behind_sentinel(tmp_path: Path) -> None:
    """REDIS_SENTINELS: Docket finds the primary through the sentinels, as the kit's user on both."""
    with running_stack(tmp_path, replicas=1, redis_mode="sentinel", server="tests.mcp_ha.tasks_server") as stack:
        async with Client(stack.config.mcp_url, timeout=30) as client:
            h = await handle(client)
            result = await client.call_tool("job", {"steps": 3, "step_seconds": 0.05, "session_id": h})
            assert result.data["counted"] == 3
        primary = stack.redis_primary()
        assert primary is not None and stack.redis_command(primary, "ACL", "LOG") == []
        assert stack.redis_command(primary, "EXISTS", f"{DOCKET_NAME}:stream") == 1


@pytest.mark.parametrize("mode", ["single", "cluster"])
@pytest.mark.redis
async def test_a_replica_runs_tasks_again_once_its_store_is_back(mode: str, tmp_path: Path) -> None:
    """Every Redis node stopped while a replica's worker waits for work, then started again: the replica,
    never restarted, runs the next task to its end (its worker came back by itself)."""
    redis = Stack(stack_config(tmp_path / "redis", replicas=1, redis_mode=mode))
    nodes = redis.config.redis_names()
    env = {"REDIS_URL": "", "REDIS_CLUSTER_NODES": redis.config.cluster_nodes} if mode == "cluster" else {}

    def start_store(gap: float = 0) -> None:
        # One node at a time, `gap` apart, as a StatefulSet brings its pods back (OrderedReady).
        for name in nodes:
            redis.start(name)
            time.sleep(gap)
        if mode == "cluster":
            redis.create_cluster()  # a cluster already made: waits for every slot served, loads the functions
        else:
            redis.load_functions("redis")

    try:
        start_store()
        with replica_on(redis, tmp_path, "mcp-server-1", module="tests.mcp_ha.tasks_server", **env) as replica:
            async with Client(replica.url, timeout=30) as client:
                h = await handle(client)
                task = await call_tool_task(client, "job", {"steps": 2, "step_seconds": 0.05, "session_id": h})
                assert (await task.result()).data["counted"] == 2
            redis.stop(*nodes)
            await asyncio.sleep(OUTAGE_SECONDS)
            start_store(gap=1)
            assert replica.proc.poll() is None
            async with Client(replica.url, timeout=30) as client:
                h = await handle(client)
                task = await call_tool_task(client, "job", {"steps": 2, "step_seconds": 0.05, "session_id": h})
                final = await until(task, ("completed", "failed", "cancelled"), limit=30)
            assert final.status == "completed", (final, replica.log.read_text()[-3000:])
            assert final.result["structuredContent"]["instance"] == "mcp-server-1"
            assert replica.proc.poll() is None
    finally:
        redis.down()


def test_docket_asked_the_kits_redis_user_for_nothing_its_acl_refuses(tasks_stack: Stack) -> None:
    """Last in the module: everything above ran as the kit's ACL user; Redis logs what it refused."""
    log = tasks_stack.redis_command("redis", "ACL", "LOG")
    assert log == [], log


# -- in process -------------------------------------------------------------------------------------------


@pytest.mark.quick
def test_docket_reaches_the_kits_redis_as_the_kits_user() -> None:
    assert docket_url(Settings()) == "memory://"
    assert docket_url(Settings(redis_url="redis://r:6380/0")) == "redis://r:6380/0?protocol=2"
    assert (
        docket_url(
            Settings(
                redis_url="rediss://old@r:6380/0?ssl_ca_certs=/ca&protocol=3",
                redis_username="mcp",
                redis_password="p@ss:/w",
            )
        )
        == "rediss://mcp:p%40ss%3A%2Fw@r:6380/0?ssl_ca_certs=%2Fca&protocol=2"
    )
    sentinels = Settings(
        redis_sentinels=(("s1", 26379), ("::1", 26380)),
        redis_master_name="primary",
        redis_username="mcp",
        redis_password="pw",
        redis_sentinel_username="mcp",
        redis_sentinel_password="s&p",
    )
    assert docket_url(sentinels) == (
        "redis+sentinel://mcp:pw@s1:26379,[::1]:26380/primary/0?sentinel_username=mcp&sentinel_password=s%26p"
        "&protocol=2"
    )
    # Under the store's own prefix: the kit's ACL user reaches it (~mcp:*).
    from mcp_ha.stores.redis_store import RedisSessionStore

    assert DOCKET_NAME.startswith(inspect.signature(RedisSessionStore).parameters["prefix"].default + ":")


@pytest.mark.quick
@pytest.mark.parametrize(
    "variable", ["TASK_REDELIVERY_SECONDS", "TASK_TTL_SECONDS", "MAX_TASKS_PER_CLIENT", "MAX_TASK_RESULT_BYTES"]
)
def test_a_task_bound_that_cannot_work_is_refused_by_name(variable: str) -> None:
    with pytest.raises(SettingsError, match=variable):
        Settings.from_env({variable: "0"})


async def _alive(store: SessionStore, runs: Runs) -> None:
    await store.claim(f"alive:{runs.run_id}", runs.run_id, 60)


@pytest.mark.quick
async def test_a_second_delivery_waits_for_a_live_run_and_answers_with_its_outcome() -> None:
    store = InMemorySessionStore()
    one, two = Runs(store, "one"), Runs(store, "two")
    await _alive(store, one)
    await _alive(store, two)
    first, second = TaskRuns(store, one), TaskRuns(store, two)
    bodies: list[str] = []
    gate = asyncio.Event()

    async def body(who: str) -> None:
        bodies.append(who)
        await gate.wait()

    async def never() -> bool:
        return False

    running = asyncio.ensure_future(first.run("task:x", lambda: body("one"), never))
    await asyncio.sleep(0.05)
    waiting = asyncio.ensure_future(second.run("task:x", lambda: body("two"), never))
    await asyncio.sleep(0.7)
    assert bodies == ["one"] and not waiting.done()
    gate.set()
    assert await running is None and await waiting is None
    assert bodies == ["one"]


@pytest.mark.quick
async def test_a_delivery_takes_over_a_run_whose_replica_is_gone() -> None:
    store = InMemorySessionStore()
    dead, two = Runs(store, "dead"), Runs(store, "two")
    await _alive(store, two)
    bodies: list[str] = []

    async def body(who: str) -> str:
        bodies.append(who)
        return who

    async def never() -> bool:
        return False

    # The dead replica's run claimed the leg, then its lease lapsed (none was ever renewed here).
    assert await store.claim("task:y:run", dead.run_id, 60)
    assert await TaskRuns(store, two).run("task:y", lambda: body("two"), never) == "two"
    assert bodies == ["two"]
    # Its outcome is recorded: a late delivery answers with it, running nothing.
    assert await store.claimed("task:y:done") is not None
    assert await store.claimed("task:y:run") is None


@pytest.mark.quick
def test_the_module_doc_names_the_settings_it_relies_on() -> None:
    doc = (Path(__file__).resolve().parents[2] / "mcp_ha" / "tasks.py").read_text()
    for variable in TASK_BOUNDS:
        assert variable in doc


@pytest.mark.quick
async def test_a_run_taken_for_dead_answers_with_the_outcome_of_the_run_that_ended_first() -> None:
    """A stalled replica looks dead and its leg is run again elsewhere: whichever run ends last answers with
    the first one's outcome, so the result Docket keeps (one key for both deliveries) is that one."""
    from fastmcp.tools.base import ToolResult

    store = InMemorySessionStore()
    stalled, two = Runs(store, "stalled"), Runs(store, "two")
    await _alive(store, two)  # `stalled` renews no lease: to `two` it is gone
    gate = asyncio.Event()

    async def slow() -> ToolResult:
        await gate.wait()
        return ToolResult(content="stalled")

    async def quick() -> ToolResult:
        return ToolResult(content="two")

    async def never() -> bool:
        return False

    first = asyncio.ensure_future(TaskRuns(store, stalled).run("task:z", slow, never))
    await asyncio.sleep(0.05)
    assert (await TaskRuns(store, two).run("task:z", quick, never)).content[0].text == "two"
    gate.set()
    assert (await first).content[0].text == "two"


async def test_a_task_keeps_no_credentials_and_refuses_arguments_it_cannot_keep(
    tasks_stack: Stack, alice: Client, auth_tokens: dict[str, str]
) -> None:
    """Docket keeps a task's arguments and context snapshot for the task's life: no bearer token or credential
    header among them; an argument the tool does not take, or arguments past MAX_TASK_ARGUMENT_BYTES, refused
    as a tool error before anything is stored."""
    h = await handle(alice)
    done = await call_tool_task(alice, "job", {"steps": 1, "step_seconds": 0.01, "session_id": h})
    await until(done, ("completed",))
    snapshots = tasks_stack.redis_command("redis", "KEYS", f"{DOCKET_NAME}:*{done.task_id}:snapshot")
    assert isinstance(snapshots, list) and snapshots, snapshots
    kept = str(tasks_stack.redis_command("redis", "GET", snapshots[0]))
    assert auth_tokens["alice"] not in kept and "authorization" not in kept.lower(), kept[:300]

    # New keys, not DBSIZE: earlier tests' keys (an ended task's charge, kept TASK_TTL_SECONDS) may expire meanwhile.
    before = set(tasks_stack.redis_command("redis", "KEYS", "*"))  # type: ignore[arg-type]
    unknown = await alice.call_tool(
        "job", {"steps": 1, "step_seconds": 0.01, "session_id": h, "extra": "x" * 1000}, raise_on_error=False
    )
    assert unknown.is_error and "no argument 'extra'" in unknown.content[0].text, unknown
    limit = 64 * 1024  # MAX_TASK_ARGUMENT_BYTES' default
    huge = await alice.call_tool(
        "job", {"steps": 1, "step_seconds": "9" * limit, "session_id": h}, raise_on_error=False
    )
    assert huge.is_error and "MAX_TASK_ARGUMENT_BYTES" in huge.content[0].text, huge
    added = set(tasks_stack.redis_command("redis", "KEYS", "*")) - before  # type: ignore[arg-type]
    assert added == set(), added  # nothing was stored for either


@pytest.mark.quick
async def test_the_worker_is_started_again_after_an_error_until_it_stops_as_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mcp_ha import tasks

    counted: list[None] = []

    def restarts() -> float:
        return len(counted)

    waits: list[float] = []
    sleep = asyncio.sleep

    async def recorded(delay: float) -> None:  # the backoff's delays, without waiting them out
        waits.append(delay)
        await sleep(0)

    monkeypatch.setattr(tasks, "WORKER_RESTART_MAX_SECONDS", 4.0)
    monkeypatch.setattr(asyncio, "sleep", recorded)
    runs = 0

    async def run(*, forever: bool) -> None:
        nonlocal runs
        runs += 1
        if runs <= 4:
            raise RuntimeError("Redis Cluster cannot be connected")  # as redis-py's RedisClusterException

    before = restarts()
    await tasks._supervised(run, on_restart=lambda: counted.append(None))(
        forever=True
    )  # returns once a run returns: the worker was told to stop
    assert runs == 5 and restarts() - before == 4
    assert waits == [1.0, 2.0, 4.0, 4.0]  # doubling from the first, held at the most

    async def stopped(*, forever: bool) -> None:
        raise asyncio.CancelledError  # the lifespan cancelling it: not restarted

    with pytest.raises(asyncio.CancelledError):
        await tasks._supervised(stopped, on_restart=None)(forever=True)
