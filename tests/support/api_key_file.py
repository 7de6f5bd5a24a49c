"""An API key file as a user writes one (``VRAMGUARD_API_KEY_FILE``), for the gate's tests
in process and against real servers."""

from __future__ import annotations

from pathlib import Path

__all__ = ["KEY", "key_file"]

KEY = "k" * 20 + "-3xAmpl3_Key.40chars~"


def key_file(folder: Path, text: str = KEY + "\n", mode: int = 0o600) -> Path:
    path = folder / "api-key"
    path.write_text(text)
    path.chmod(mode)
    return path
