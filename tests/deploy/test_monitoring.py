"""deploy/monitoring/: the alert rules, the Prometheus Operator's resources and the dashboard the kit ships
(`mcp-ha deploy` writes them out). Which metrics they read is held by tests/mcp_ha/test_metrics.py, on a
stack that serves them; this file holds their shape, offline: no cluster runs here, and the operator's
kinds are CRDs the bundled Kubernetes schemas do not know."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
SEVERITIES = {"critical", "warning"}

pytestmark = pytest.mark.quick


def load(name: str) -> dict:
    return yaml.safe_load((MONITORING / name).read_text())


def test_every_alert_says_its_severity_and_what_happened() -> None:
    rules = [rule for group in load("alerts.yaml")["groups"] for rule in group["rules"]]
    assert len(rules) >= 5
    assert len({rule["alert"] for rule in rules}) == len(rules), "two alerts share a name"
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["labels"]["severity"] in SEVERITIES, rule
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["expr"]


def test_the_operators_rules_are_the_rule_files() -> None:
    """One set of rules, in the two forms Prometheus takes them: a rule file, and a PrometheusRule."""
    resource = load("prometheusrule.yaml")
    assert (resource["apiVersion"], resource["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert resource["spec"] == load("alerts.yaml")


def test_the_service_monitor_scrapes_each_replica_through_the_kits_service() -> None:
    """It selects the headless mcp-server Service by its labels, on a port that Service names: each pod is
    scraped on its own, as /metrics must be (through HAProxy a scrape reaches one replica at random)."""
    monitor = load("servicemonitor.yaml")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    service = next(
        doc
        for doc in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "mcp-server.yaml").read_text())
        if doc["kind"] == "Service" and doc["metadata"]["name"] == "mcp-server"
    )
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_the_kustomization_applies_both_and_the_dashboard_is_grafanas() -> None:
    assert load("kustomization.yaml")["resources"] == ["servicemonitor.yaml", "prometheusrule.yaml"]
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    assert dashboard["title"] and dashboard["panels"] and all(panel["targets"] for panel in dashboard["panels"])
