"""The typed contracts hold where Python's type checker cannot see: the dashboard's
JavaScript and the live events read only fields the schemas document."""

from __future__ import annotations

import re
from pathlib import Path

from app.memory.guard import GuardState
from app.schemas import LiveSample, MemoryReport

DASHBOARD = Path(__file__).resolve().parents[3] / "app" / "ui" / "dashboard.html"
# `sample.x`, `last.x` and `s.x` are live samples in the page; `s[key]` reads the
# keys handed to line("...").
SAMPLE_READ = re.compile(r"\b(?:sample|last|s)\.([a-z_]+)\b")
LINE_KEY = re.compile(r'\bline\("([a-z_]+)"')


def fields_the_dashboard_reads() -> set[str]:
    script = DASHBOARD.read_text(encoding="utf-8")
    return set(SAMPLE_READ.findall(script)) | set(LINE_KEY.findall(script))


def test_the_dashboard_reads_only_live_sample_fields():
    read = fields_the_dashboard_reads()
    assert {"budget_bytes", "usage_bytes", "state", "t"} <= read  # the pattern finds reads
    assert read - set(LiveSample.model_fields) == set()


def test_a_live_sample_is_the_memory_report_plus_queue_figures():
    assert set(MemoryReport.model_fields) < set(LiveSample.model_fields)
    assert MemoryReport.model_fields["state"].annotation is GuardState


def test_the_memory_route_documents_its_schema():
    from app.api.memory import router

    route = next(r for r in router.routes if getattr(r, "path", "") == "/v1/memory")
    assert getattr(route, "response_model", None) is MemoryReport
