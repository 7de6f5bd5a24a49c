"""Byte counts as people read them."""

from __future__ import annotations


def human_bytes(value: float) -> str:
    """812 MiB, 10.8 GiB: binary units, one decimal for GiB."""
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value >= 1024**3:
        return f"{sign}{value / 1024**3:.1f} GiB"
    if value >= 1024**2:
        return f"{sign}{value / 1024**2:.0f} MiB"
    if value >= 1024:
        return f"{sign}{value / 1024:.0f} KiB"
    return f"{sign}{value:.0f} B"
