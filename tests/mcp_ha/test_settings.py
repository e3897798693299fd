"""Settings: one type read from the environment, refused by name when it cannot work, and documented once."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import NOT_THE_LAYER

from mcp_ha.settings import Settings, SettingsError

pytestmark = pytest.mark.quick
ROOT = Path(__file__).resolve().parents[2]


def test_an_empty_environment_gives_the_defaults() -> None:
    assert Settings.from_env({}) == Settings()
    assert not Settings().uses_redis


def test_every_variable_is_read_into_its_field() -> None:
    settings = Settings.from_env(
        {
            "INSTANCE_ID": "mcp-server-7",
            "HOST": "127.0.0.2",
            "PORT": "9001",
            "SESSION_TTL_SECONDS": "60",
            "EVENT_TTL_SECONDS": "30",
            "OP_TTL_SECONDS": "40",
            "REDIS_SENTINELS": "127.0.0.1:26380, 127.0.0.1:26381",
            "REDIS_MASTER_NAME": "primary",
            "REDIS_USERNAME": "mcp",
            "REDIS_PASSWORD": " p a s s ",
            "REDIS_WAIT_REPLICAS": "1",
            "REDIS_RETRY_SECONDS": "2.5",
            "LOG_FORMAT": "TEXT",
            "LOG_LEVEL": "Warning",
            "METRICS": "off",
            "MCP_AUTH": "static",
            "MCP_AUTH_TOKENS": "alice:" + "a" * 20,
            "MCP_AUTH_REQUIRED_SCOPES": "read, write",
        }
    )
    assert (settings.instance_id, settings.host, settings.port) == ("mcp-server-7", "127.0.0.2", 9001)
    assert (settings.session_ttl_seconds, settings.event_ttl_seconds, settings.op_ttl_seconds) == (60, 30, 40)
    assert settings.redis_sentinels == (("127.0.0.1", 26380), ("127.0.0.1", 26381)) and settings.uses_redis
    assert settings.redis_password == " p a s s "  # a password is kept exactly as given
    assert (settings.redis_wait_replicas, settings.redis_retry_seconds) == (1, 2.5)
    assert (settings.log_format, settings.log_level, settings.metrics) == ("text", "warning", False)
    assert settings.auth_tokens == {"a" * 20: "alice"}
    assert settings.auth_required_scopes == ("read", "write")


def test_the_request_state_ring_is_read_in_order() -> None:
    first, second = "a" * 32, "b" * 40
    settings = Settings.from_env({"REQUEST_STATE_KEYS": f" {first} , {second} ", "REQUEST_STATE_TTL_SECONDS": "30"})
    assert settings.request_state_keys == (first, second) and settings.request_state_ttl_seconds == 30
    assert first not in repr(settings)  # a secret is never printed


def test_tokens_are_read_only_when_static_auth_uses_them() -> None:
    assert Settings.from_env({"MCP_AUTH": "none", "MCP_AUTH_TOKENS": "not even name:token"}).auth_tokens == {}


@pytest.mark.parametrize(
    ("environ", "variable"),
    [
        ({"PORT": "eighty"}, "PORT"),
        ({"PORT": "70000"}, "PORT"),
        ({"SESSION_TTL_SECONDS": "0"}, "SESSION_TTL_SECONDS"),
        ({"REDIS_WAIT_REPLICAS": "-1"}, "REDIS_WAIT_REPLICAS"),
        ({"REDIS_RETRY_SECONDS": "soon"}, "REDIS_RETRY_SECONDS"),
        ({"REDIS_SENTINELS": "127.0.0.1"}, "REDIS_SENTINELS"),
        ({"LOG_FORMAT": "xml"}, "LOG_FORMAT"),
        ({"LOG_LEVEL": "loud"}, "LOG_LEVEL"),
        ({"METRICS": "maybe"}, "METRICS"),
        ({"MCP_AUTH": "oauth"}, "MCP_AUTH"),
        ({"MCP_AUTH": "static", "MCP_AUTH_TOKENS": "alice:short"}, "MCP_AUTH_TOKENS"),
        ({"REQUEST_STATE_KEYS": "k" * 32 + ",short"}, "REQUEST_STATE_KEYS"),
        ({"REQUEST_STATE_KEYS": ",".join(["k" * 32] * 2)}, "REQUEST_STATE_KEYS"),
        ({"REQUEST_STATE_TTL_SECONDS": "0"}, "REQUEST_STATE_TTL_SECONDS"),
        # nan passes every comparison's check, inf every bound's.
        ({"ABANDONED_CALL_SECONDS": "nan"}, "ABANDONED_CALL_SECONDS"),
        ({"CALL_QUEUE_SECONDS": "nan"}, "CALL_QUEUE_SECONDS"),
        ({"REDIS_RETRY_SECONDS": "inf"}, "REDIS_RETRY_SECONDS"),
        ({"TASK_REDELIVERY_SECONDS": "-inf"}, "TASK_REDELIVERY_SECONDS"),
        ({"REDIS_URL": "localhost:6379"}, "REDIS_URL"),
        ({"REDIS_URL": "redis://"}, "REDIS_URL"),
        ({"REDIS_URL": "redis://127.0.0.1:99999/0"}, "REDIS_URL"),
        ({"REDIS_URL": "http://127.0.0.1:6379"}, "REDIS_URL"),
    ],
)
def test_a_setting_that_cannot_work_is_refused_by_its_name(environ: dict[str, str], variable: str) -> None:
    with pytest.raises(SettingsError, match=variable):
        Settings.from_env(environ)


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:6379/0", "redis://mcp:s3cret@redis:6379", "rediss://redis.example/1", "unix:///run/r.sock"],
)
def test_each_form_of_redis_url_redis_py_reads_is_taken(url: str) -> None:
    assert Settings.from_env({"REDIS_URL": url}).redis_url == url


def test_a_refused_redis_url_is_not_echoed_it_may_carry_a_password() -> None:
    with pytest.raises(SettingsError) as refused:
        Settings.from_env({"REDIS_URL": "mcp:s3cret@redis:6379"})
    assert "s3cret" not in str(refused.value)


def test_the_docs_table_lists_exactly_the_settings() -> None:
    """docs/operations.md's settings table is the one place the variables are listed; it and the type agree."""
    text = (ROOT / "docs" / "operations.md").read_text()
    table = text[text.index("| variable | default | meaning |") :]
    table = table[: table.index("\n\n")] if "\n\n" in table else table
    documented = set(re.findall(r"^\| `([A-Z0-9_]+)`", table, flags=re.MULTILINE))
    assert documented == {f.metadata["env"] for f in fields(Settings)}


def test_nothing_else_in_the_layer_reads_the_environment() -> None:
    readers = [
        p.name
        for p in (ROOT / "mcp_ha").glob("*.py")
        if p.name not in ("settings.py", *NOT_THE_LAYER) and re.search(r"os\.environ|os\.getenv", p.read_text())
    ]
    assert readers == []
