"""The API contract file is the app's own, up to date."""

from __future__ import annotations

from app.http.openapi_file import CONTRACT, render


def test_docs_openapi_json_is_up_to_date() -> None:
    assert CONTRACT.is_file(), "docs/openapi.json is missing"
    assert CONTRACT.read_text(encoding="utf-8") == render(), (
        "docs/openapi.json is out of date: run python -m app.http.openapi_file")
