"""mcp_ha/ops/check/load.py: effects lost or doubled, per session, from the writes acknowledged and the count."""

from __future__ import annotations

import pytest

from mcp_ha.ops.check.load import CallRecord, SessionRun, figures, load_with_fault
from mcp_ha.ops.check.shape import Call, Shape

pytestmark = pytest.mark.quick


def run(ok: int, failed: int, final: int | None) -> SessionRun:
    calls = [CallRecord(i, i + 0.1, True, "mcp-server-1") for i in range(ok)]
    calls += [CallRecord(ok + i, ok + i + 2.5, False, error="HTTP 502: bad gateway") for i in range(failed)]
    return SessionRun("plain", calls, final=final)


def test_exact_counts_lose_and_double_nothing() -> None:
    f = figures("plain", [run(10, 0, 10), run(7, 0, 7)], retries=False)
    assert (f.calls, f.failed, f.acknowledged, f.final, f.lost, f.doubled) == (17, 0, 17, 17, 0, 0)
    assert f.longest_call_s == 0.1


def test_a_failed_write_may_have_applied_once_for_a_client_that_does_not_retry() -> None:
    # Acknowledged 10, one failed: 10 or 11 are both honest counts; 12 is a write applied twice.
    assert figures("plain", [run(10, 1, 11)], retries=False).doubled == 0
    assert figures("plain", [run(10, 1, 12)], retries=False).doubled == 1
    # A client that retries by itself is never left not knowing: any excess is a double.
    assert figures("resilient", [run(10, 1, 11)], retries=True).doubled == 1


def test_fewer_effects_than_writes_acknowledged_is_a_loss_and_an_unread_count_is_named() -> None:
    f = figures("plain", [run(10, 0, 8), run(5, 0, None)], retries=False)
    assert (f.lost, f.unreadable, f.final) == (2, 1, None)
    assert f.errors == []
    assert figures("plain", [run(1, 3, 1)], retries=False).errors == ["3× HTTP 502: bad gateway"]
    assert figures("plain", [run(1, 3, 1)], retries=False).longest_call_s == 2.5


async def test_a_load_with_no_session_to_drive_still_runs_its_fault_and_ends() -> None:
    """No client could open a session (a refused initialize, say): the fault and the load's span, not a crash."""
    struck: list[str] = []

    async def fault() -> float:
        struck.append("struck")
        return 12.5

    shape = Shape(write=Call("w"), read=Call("r"), count=lambda result: 0)
    span = await load_with_fault([], shape, fault, fault_at=0.01, duration=0.02)
    assert struck == ["struck"] and span.struck == 12.5 and span.start <= span.over <= span.end
