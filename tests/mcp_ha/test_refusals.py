"""refusals.py: each refusal of a bound counted by the setting's name, and logged at most once per bound per
LOG_EVERY_SECONDS with the count since (a client hammering a bound cannot flood the log)."""

from __future__ import annotations

import logging

import pytest

from mcp_ha import refusals


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """A clock of the test's own, and the module's counts as if nothing had been refused yet."""
    now = [1000.0]
    monkeypatch.setattr(refusals, "_now", lambda: now[0])
    monkeypatch.setattr(refusals, "_totals", refusals.Counter())
    monkeypatch.setattr(refusals, "_unlogged", refusals.Counter())
    monkeypatch.setattr(refusals, "_logged_at", {})
    return now


def test_a_burst_is_counted_whole_and_logged_once_per_window(
    clock: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=refusals.__name__)
    for _ in range(50):
        refusals.refused("MAX_CALLS_PER_CLIENT")
    refusals.refused("MAX_BODY_BYTES", "2 MiB from 127.0.0.5")
    assert refusals.totals() == {"MAX_CALLS_PER_CLIENT": 50, "MAX_BODY_BYTES": 1}
    assert [r.getMessage() for r in caplog.records] == [
        "refused 1 request past MAX_CALLS_PER_CLIENT",
        "refused 1 request past MAX_BODY_BYTES: 2 MiB from 127.0.0.5",
    ]
    clock[0] += refusals.LOG_EVERY_SECONDS
    refusals.refused("MAX_CALLS_PER_CLIENT")
    assert caplog.records[-1].getMessage() == "refused 50 requests past MAX_CALLS_PER_CLIENT in the last 10 s"
    assert refusals.totals()["MAX_CALLS_PER_CLIENT"] == 51
