"""The shipped monitoring config (assets/monitoring): the Grafana dashboard, its panels,
and every query in it and in the alert rules."""

from __future__ import annotations

import json
from typing import Any

import yaml
from live_server import ROOT

__all__ = ["MONITORING", "dashboard", "exprs", "panels"]

MONITORING = ROOT / "assets" / "monitoring"


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return loaded


def panels(within: dict[str, Any]) -> list[dict[str, Any]]:
    """Every graph panel, those inside rows (a collapsed row holds its own) included."""
    found = []
    for panel in within["panels"]:
        found += panels(panel) if panel["type"] == "row" else [panel]
    return found


def exprs() -> list[str]:
    """Every query in the alert rules and the dashboard, its variables' included."""
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    found = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    found += [target["expr"] for panel in panels(dashboard()) for target in panel["targets"]]
    found += [variable["query"] for variable in dashboard()["templating"]["list"]
              if variable["type"] == "query"]
    return found
