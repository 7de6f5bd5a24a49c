"""The shipped monitoring config on its own: the alert rules are well formed, and the
dashboard's Replicas row (checked against a real scrape: live/test_metrics.py)."""

from __future__ import annotations

import re

import yaml
from monitoring_config import MONITORING, dashboard


def test_alert_rules_are_well_formed():
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    names = [rule["alert"] for group in rules["groups"] for rule in group["rules"]]
    assert len(names) == len(set(names)) >= 5
    for group in rules["groups"]:
        for rule in group["rules"]:
            assert rule["expr"] and rule["annotations"]["summary"]
            assert rule["labels"]["severity"] in {"info", "warning", "critical"}


def test_the_replica_row_shows_each_replica_and_leaves_the_appliance_panels_alone():
    """Cluster replicas label their series ``replica``; the appliance's have no such
    label, so only the collapsed Replicas row may filter or group by it."""
    variable = next(v for v in dashboard()["templating"]["list"] if v["name"] == "replica")
    assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*"
    assert re.fullmatch(r"label_values\(vramguard_[a-z_]+, replica\)", variable["query"])
    rows = [p for p in dashboard()["panels"] if p["type"] == "row"]
    assert [(r["title"], r["collapsed"]) for r in rows] == [("Replicas", True)]
    queries = [t["expr"] for p in rows[0]["panels"] for t in p["targets"]]
    assert all("by (replica" in q and 'replica=~"$replica"' in q for q in queries)
    used = {name for q in queries for name in re.findall(r"vramguard_[a-z_]+", q)}
    assert used >= {"vramguard_requests_total", "vramguard_request_duration_seconds_bucket",
                    "vramguard_memory_usage_bytes", "vramguard_memory_budget_bytes",
                    "vramguard_queue_depth", "vramguard_rate_limit_fallback"}
    appliance = [t["expr"] for p in dashboard()["panels"] if p["type"] != "row"
                 for t in p["targets"]]
    assert not [q for q in appliance if "replica" in q]
