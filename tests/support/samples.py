"""A live sample with known figures, for the tray, the dashboard and the diagnostics."""

from __future__ import annotations

from app.schemas import LiveSample

MiB, GiB = 1024**2, 1024**3

FIGURES = {
    "budget_bytes": 10 * GiB, "low_watermark_bytes": int(7.5 * GiB),
    "high_watermark_bytes": 9 * GiB, "usage_bytes": int(3.8 * GiB),
    "weights_bytes": 500 * MiB, "peak_reserved_bytes": 500 * MiB + int(6.1 * GiB),
    "reserved_bytes": 500 * MiB + int(4.2 * GiB), "allocated_bytes": 812 * MiB,
    "state": "ok", "queue_depth": 3, "max_batch_now": 4, "paused": False,
}


def sample(**changes: object) -> LiveSample:
    """A live sample with the figures above; every other field zero or empty, or its
    default where it has one (the diagnostics: no GPU utilisation, no leak)."""
    fields = {name: 0 for name, field in LiveSample.model_fields.items() if field.is_required()}
    fields |= {"device": "cpu", "source": "system", "nvml": False, "profile_points": [],
               "cpu_memory_cap_bytes": None, "requests": {}, **FIGURES, **changes}
    return LiveSample.model_validate(fields)
