"""``docs/openapi.json``: the API contract as a file, generated from the app itself.

Clients written elsewhere (other languages, code generators) read the contract without
running vramguard; ``tests/inprocess/test_openapi_file.py`` fails when the file is out of date.
Regenerate it with ``python -m app.http.openapi_file``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from app.config import load_settings
from app.http.server import create_app

CONTRACT = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


def contract() -> dict[str, Any]:
    """The OpenAPI document of an app built with the default settings (nothing started)."""
    with tempfile.TemporaryDirectory() as home:
        settings = load_settings(token_file=Path(home) / "token", cache=False)
        app = create_app(settings)
        try:
            return app.openapi()
        finally:
            state = app.state.vg
            state.pool.shutdown()
            state.decoder.close()


def render() -> str:
    return json.dumps(contract(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    CONTRACT.write_text(render(), encoding="utf-8")
    print(f"wrote {CONTRACT}")
