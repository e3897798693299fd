"""/metrics on every replica and on HAProxy's stats port, read after real calls through HAProxy."""

from __future__ import annotations

import importlib.metadata
import json
import re
import time
import uuid
from pathlib import Path

import httpx2
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from mcp_ha.ops.check.wire import RawSession, last_jsonrpc_message
from mcp_ha.ops.stack import Stack

Samples = dict[tuple[str, frozenset], float]
# The dashboard and the alert rules the kit ships (mcp-ha deploy writes them out too).
MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"


async def scrape(http: httpx2.AsyncClient, url: str, auth: tuple[str, str] | None = None) -> tuple[Samples, str]:
    response = await http.get(url, auth=auth)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain"), response.headers["content-type"]
    samples = {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }
    return samples, response.text


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def change(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def replica_metrics(stack: Stack, replica: str) -> str:
    return f"http://127.0.0.1:{stack.service(replica).port}/metrics"


async def test_tool_calls_are_counted_by_tool_and_outcome_and_timed(
    stack: Stack, raw: RawSession, http: httpx2.AsyncClient
) -> None:
    replica = (await raw.call("get_counter"))["instance"]  # the session sticks to it from here on
    before, _ = await scrape(http, replica_metrics(stack, replica))

    calling = time.monotonic()
    for _ in range(3):
        assert (await raw.call("increment_counter"))["instance"] == replica
    calls_took = time.monotonic() - calling  # each timed on the replica within its round trip timed here
    failed = await raw.post("tools/call", {"name": "get_counter", "arguments": {"session_id": "not-a-handle"}})
    assert last_jsonrpc_message(failed)["result"]["isError"]
    unknown = f"no_such_tool_{uuid.uuid4().hex}"
    refused = await raw.post("tools/call", {"name": unknown, "arguments": {}})
    assert last_jsonrpc_message(refused)["result"]["isError"]
    invalid = await raw.post("tools/call", {"name": "analyze_data", "arguments": {"num_items": 5000}})
    assert last_jsonrpc_message(invalid)["result"]["isError"]

    after, text = await scrape(http, replica_metrics(stack, replica))

    assert change(before, after, "mcp_tool_calls_total", tool="increment_counter", outcome="ok") == 3
    assert change(before, after, "mcp_tool_calls_total", tool="increment_counter", outcome="tool_error") == 0
    assert change(before, after, "mcp_tool_calls_total", tool="get_counter", outcome="tool_error") == 1
    assert change(before, after, "mcp_tool_calls_total", tool="get_counter", outcome="ok") == 0
    assert change(before, after, "mcp_tool_call_duration_seconds_count", tool="increment_counter") == 3
    assert 0 < change(before, after, "mcp_tool_call_duration_seconds_sum", tool="increment_counter") <= calls_took
    # A name the server does not have is one series for all such names: clients cannot grow the page.
    assert change(before, after, "mcp_tool_calls_total", tool="(other)", outcome="tool_error") == 1
    assert change(before, after, "mcp_tool_calls_total", tool="analyze_data", outcome="tool_error") == 1
    assert unknown not in text
    # Each increment is one store write, timed.
    assert change(before, after, "mcp_store_operation_duration_seconds_count", operation="incr") == 3
    assert value(after, "mcp_sessions_held") >= 1
    # stamina's retry counter is served from the same registry.
    assert "# TYPE stamina_retries_total counter" in text


async def test_a_reused_idempotency_key_is_a_protocol_error_and_a_store_error(
    stack: Stack, raw: RawSession, http: httpx2.AsyncClient
) -> None:
    replica = (await raw.call("get_counter"))["instance"]
    before, _ = await scrape(http, replica_metrics(stack, replica))
    meta = {"io.github.mcp-ha-kit/idempotency-key": uuid.uuid4().hex}
    first = await raw.post("tools/call", {"name": "add_note", "arguments": {"note": "a"}, "_meta": meta})
    assert "result" in last_jsonrpc_message(first)
    reused = await raw.post("tools/call", {"name": "add_note", "arguments": {"note": "b"}, "_meta": meta})
    assert last_jsonrpc_message(reused)["error"]["code"] == -32602
    after, _ = await scrape(http, replica_metrics(stack, replica))

    assert change(before, after, "mcp_tool_calls_total", tool="add_note", outcome="ok") == 1
    assert change(before, after, "mcp_tool_calls_total", tool="add_note", outcome="protocol_error") == 1
    assert change(before, after, "mcp_store_errors_total", operation="append", kind="op_reused") == 1
    assert change(before, after, "mcp_store_errors_total", operation="append", kind="fenced") == 0


async def test_a_repeated_call_is_counted_as_a_replay_not_a_second_write(
    stack: Stack, raw: RawSession, http: httpx2.AsyncClient
) -> None:
    replica = (await raw.call("get_counter"))["instance"]
    before, _ = await scrape(http, replica_metrics(stack, replica))
    meta = {"io.github.mcp-ha-kit/idempotency-key": uuid.uuid4().hex}
    answers = []
    for _ in range(2):
        response = await raw.post("tools/call", {"name": "increment_counter", "arguments": {}, "_meta": meta})
        answers.append(last_jsonrpc_message(response)["result"]["structuredContent"]["counter"])
    assert answers == [1, 1]
    after, _ = await scrape(http, replica_metrics(stack, replica))
    assert value(after, "mcp_idempotent_replays_total") - value(before, "mcp_idempotent_replays_total") == 1


async def test_resume_session_is_counted_only_when_it_copied_state(
    stack: Stack, raw: RawSession, http: httpx2.AsyncClient, mcp_url: str
) -> None:
    await raw.call("increment_counter")
    fresh = RawSession(http, mcp_url)
    await fresh.initialize()
    replica = (await fresh.call("get_counter"))["instance"]
    before, _ = await scrape(http, replica_metrics(stack, replica))
    assert (await fresh.call("resume_session", {"old_session_id": uuid.uuid4().hex}))["keys_copied"] == 0
    assert (await fresh.call("resume_session", {"old_session_id": raw.session_id}))["keys_copied"] == 1
    after, _ = await scrape(http, replica_metrics(stack, replica))
    assert value(after, "mcp_sessions_resumed_total") - value(before, "mcp_sessions_resumed_total") == 1


async def test_a_resumed_stream_is_counted(stack: Stack, raw: RawSession, http: httpx2.AsyncClient) -> None:
    replica = (await raw.call("get_counter"))["instance"]
    # A call with something to stream (one that streams nothing is answered as JSON, and kept nowhere).
    response = await raw.post("tools/call", {"name": "analyze_data", "arguments": {"num_items": 0}})
    first = next(line[3:].strip() for line in response.text.splitlines() if line.startswith("id:"))
    before, _ = await scrape(http, replica_metrics(stack, replica))
    async with raw.resume(first) as stream:
        assert stream.response.status_code == 200
        messages = [event.message async for event in stream if event.message]
        assert messages[-1]["result"]["structuredContent"]["items_processed"] == 0
    async with raw.resume("1-1.00000000") as stream:  # no such event: 404, not counted
        assert stream.response.status_code == 404
    after, _ = await scrape(http, replica_metrics(stack, replica))
    assert value(after, "mcp_streams_resumed_total") - value(before, "mcp_streams_resumed_total") == 1


async def test_adopting_a_stopped_replicas_session_is_counted(
    healed_stack: Stack, raw: RawSession, http: httpx2.AsyncClient
) -> None:
    owner = (await raw.call("increment_counter"))["instance"]
    others = [name for name in healed_stack.config.replica_names() if name != owner]
    before = {name: (await scrape(http, replica_metrics(healed_stack, name)))[0] for name in others}
    healed_stack.stop(owner)
    adopter = (await raw.call("increment_counter"))["instance"]
    assert adopter in others
    adopted = {
        name: value((await scrape(http, replica_metrics(healed_stack, name)))[0], "mcp_sessions_adopted_total")
        - value(before[name], "mcp_sessions_adopted_total")
        for name in others
    }
    assert adopted == {name: 1 if name == adopter else 0 for name in others}


async def test_haproxy_serves_its_metrics_on_the_stats_port_only(stack: Stack, http: httpx2.AsyncClient) -> None:
    url = f"http://127.0.0.1:{stack.config.stats_port}/metrics"
    # Behind the stats credentials, as the stats page is (Prometheus: basic_auth).
    assert (await http.get(url)).status_code == 401
    samples, _ = await scrape(http, url, auth=stack.config.stats_auth)
    active = value(samples, "haproxy_backend_active_servers", proxy="mcp_servers")
    assert active == len(stack.backends_up()) == len(stack.config.replica_names())
    # Through the MCP frontend a scrape would reach one replica at random: refused.
    assert (await http.get(stack.config.mcp_url.removesuffix("/mcp") + "/metrics")).status_code == 404


async def test_metrics_answers_any_query_or_accept_header_without_a_5xx(stack: Stack, http: httpx2.AsyncClient) -> None:
    url = replica_metrics(stack, stack.config.replica_names()[0])
    for headers in ({"Accept": "application/openmetrics-text; version=1.0.0"}, {"Accept": "*/*;q=nonsense,,;"}):
        assert (await http.get(url, headers=headers)).status_code == 200
    assert (await http.get(url + "?name[]=%00&x=" + "y" * 5000)).status_code == 200
    assert (await http.post(url)).status_code == 405


async def test_the_dashboard_and_the_alerts_read_only_metrics_the_stack_serves(
    stack: Stack, http: httpx2.AsyncClient
) -> None:
    # Small files of the repository, read once: blocking the loop for them costs nothing.
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    alerts = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    exprs += [rule["expr"] for group in alerts["groups"] for rule in group["rules"]]
    names = {name for expr in exprs for name in re.findall(r"\b(?:mcp|stamina|haproxy)_[a-z_]+", expr)}
    assert len(names) >= 15, names
    _, replica_text = await scrape(http, replica_metrics(stack, stack.config.replica_names()[0]))
    _, haproxy_text = await scrape(
        http, f"http://127.0.0.1:{stack.config.stats_port}/metrics", auth=stack.config.stats_auth
    )
    served = replica_text + haproxy_text
    assert [name for name in sorted(names) if name not in served] == []
    assert 'state="UP"' in haproxy_text  # a label the "replicas up" panel filters on


async def test_each_replica_says_its_build_that_it_serves_and_that_its_store_answers(
    stack: Stack, http: httpx2.AsyncClient
) -> None:
    """What an operator alerts on, on every replica: the build it runs, whether it drains, whether its store
    answered its last health check."""
    replica = stack.config.replica_names()[0]
    assert (await http.get(f"http://127.0.0.1:{stack.service(replica).port}/health")).status_code == 200
    samples, _ = await scrape(http, replica_metrics(stack, replica))
    builds = [dict(labels) for name, labels in samples if name == "mcp_ha_build_info"]
    assert len(builds) == 1 and builds[0]["version"] == importlib.metadata.version("mcp-ha-kit"), builds
    assert builds[0]["fastmcp"] == importlib.metadata.version("fastmcp")
    assert value(samples, "mcp_draining") == 0 and value(samples, "mcp_store_up") == 1


async def test_a_refusal_past_a_bound_is_counted_by_its_setting_and_logged(
    stack: Stack, http: httpx2.AsyncClient
) -> None:
    """A body over MAX_BODY_BYTES sent straight to a replica (HAProxy's own bound would meet it first): its
    413 is counted under the setting's name, and the replica's log says so."""
    replica = stack.config.replica_names()[0]
    before, _ = await scrape(http, replica_metrics(stack, replica))
    url = f"http://127.0.0.1:{stack.service(replica).port}/mcp"
    body = b"x" * (stack.config.max_body_bytes + 1)
    response = await http.post(url, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text
    after, _ = await scrape(http, replica_metrics(stack, replica))
    assert change(before, after, "mcp_refusals_total", bound="MAX_BODY_BYTES") == 1
    log = (stack.log_dir / f"{replica}.log").read_text()
    assert "past MAX_BODY_BYTES" in log


@pytest.mark.quick
def test_draining_and_the_store_are_read_at_each_scrape() -> None:
    from prometheus_client import REGISTRY, generate_latest

    from mcp_ha import metrics

    state = {"draining": False, "up": True}
    metrics.watch_replica(draining=lambda: state["draining"], store_up=lambda: state["up"])

    def read() -> tuple[float, float]:
        found = {
            sample.name: sample.value
            for family in text_string_to_metric_families(generate_latest(REGISTRY).decode())
            for sample in family.samples
        }
        return found["mcp_draining"], found["mcp_store_up"]

    assert read() == (0, 1)
    state.update(draining=True, up=False)
    assert read() == (1, 0)


@pytest.mark.quick
async def test_every_async_operation_of_the_store_contract_is_timed_and_its_errors_counted() -> None:
    """MeteredStore forwards nothing by hand: an operation the contract gains is timed with no change here."""
    from prometheus_client import REGISTRY

    from mcp_ha.metrics import UNTIMED, metered, timed_operations
    from mcp_ha.session_store import Op, OpReused, SessionStore
    from mcp_ha.stores.memory_store import InMemorySessionStore

    untimed = UNTIMED | {"replayed"}
    assert timed_operations() == SessionStore.__abstractmethods__ - untimed

    def count(name: str, operation: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, {"operation": operation, **labels}) or 0.0

    store = metered(InMemorySessionStore())
    sid = uuid.uuid4().hex
    timed = count("mcp_store_operation_duration_seconds_count", "incr")
    reused = count("mcp_store_errors_total", "incr", kind="op_reused")
    assert await store.incr(sid, "n", op=Op("k", "one call")) == 1
    with pytest.raises(OpReused):
        await store.incr(sid, "n", op=Op("k", "another call"))
    assert count("mcp_store_operation_duration_seconds_count", "incr") == timed + 2
    assert count("mcp_store_errors_total", "incr", kind="op_reused") == reused + 1
    assert store.ttl_seconds == InMemorySessionStore().ttl_seconds  # the rest is the store's own
