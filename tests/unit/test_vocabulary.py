"""One name for each memory quantity (issue 24): the table in docs/memory.md is
``app/vocabulary.py``, and the tray, the dashboard, doctor's worked example and the
descriptions of /v1/memory say those names, not the retired ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from samples import sample

from app.memory.budget import Budget
from app.schemas import MemoryReport
from app.vocabulary import EMPTY_GPU_CACHE, MEMORY_NAMES, STATE_WORDS
from tray.text import menu_lines, tooltip

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = (ROOT / "app" / "ui" / "dashboard.html").read_text(encoding="utf-8")
# Words that named a quantity twice, or two quantities once, before issue 24.
RETIRED = ("budget", "Reserved", "Allocated", "in use", "Per image", "watermark",
           "slowing down", "Empty cache")


def test_docs_memory_md_has_every_name_in_one_table():
    text = (ROOT / "docs" / "memory.md").read_text(encoding="utf-8")
    section = text.split("## The names people see", 1)[1].split("\n## ", 1)[0]
    rows = {match.group(1): (match.group(2), match.group(3)) for match in
            re.finditer(r"^\| ([^|]+?) \| ([^|]+?) \| `([^`]+)`", section, re.MULTILINE)
            if match.group(1) != "name"}
    assert set(rows) == {name.name for name in MEMORY_NAMES}
    for name in MEMORY_NAMES:
        assert rows[name.name] == (name.meaning, name.fields), name.name
    for word in (*STATE_WORDS.values(), EMPTY_GPU_CACHE):
        if word != "not running":
            assert word in section, word


def test_the_tray_says_the_names():
    text = "\n".join([tooltip(sample()), *menu_lines(sample())])
    for name in ("Used", "limit", "Models", "images in progress", "GPU cache", "Peak"):
        assert name in text, name
    for word in RETIRED:
        assert word not in text, word


@pytest.mark.parametrize("name", ["Models", "Images in progress", "GPU cache", "Limit",
                                  "Room for images", "Peak", "Other programs",
                                  "Memory per image", EMPTY_GPU_CACHE])
def test_the_dashboard_says_the_names(name):
    assert name in DASHBOARD


def test_the_dashboard_shows_no_retired_word_to_a_person():
    """Retired words may stay in field names (budget_bytes), never in what is shown:
    quoted strings and the page's text."""
    parts = re.findall(r'"([^"\n]*)"|`([^`]*)`|>([^<>{}\n]+)<', DASHBOARD)
    shown = " ".join(part for match in parts for part in match if part)
    shown = re.sub(r"\b[a-z_]+_bytes\b|\$\{[^}]*\}", "", shown)
    for word in RETIRED:
        assert word not in shown, word
    for state, words in STATE_WORDS.items():
        assert f'{state}: "{words}"' in DASHBOARD


def test_doctors_worked_example_says_the_names():
    gib = 1024**3
    text = "\n".join(Budget(total=24 * gib, fraction=0.7, weights=4 * gib,
                            overhead=2 * gib).lines())
    for name in ("GPU memory", "limit", "models", "room for images"):
        assert name in text
    assert "budget" not in text


@pytest.mark.parametrize("field", sorted({field for name in MEMORY_NAMES
                                          for field in re.findall(r"[a-z_]+_bytes",
                                                                  name.fields)}))
def test_the_memory_report_describes_its_fields_with_the_names(field):
    described = MemoryReport.model_fields[field].description or ""
    names = [name.name for name in MEMORY_NAMES if field in name.fields]
    assert any(name.lower() in described.lower() for name in names), (field, described)
