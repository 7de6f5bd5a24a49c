"""The pieces of bench/two_models.py and bench/start_time.py that need no server.

The benchmarks themselves are run by hand (docs/benchmarks.md); these check that their
bookkeeping reads logs and memory and pools results the way the reports say."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

from bench.loadgen import LoadResult
from bench.start_time import LOG_MARKS, _log_marks, _peak_rss
from bench.two_models import Pooled, TreeMemory, tree_memory


def test_log_marks_are_offsets_from_the_launch(tmp_path: Path) -> None:
    launched = datetime(2026, 11, 30, 16, 15, 3, 500_000).timestamp()
    log = tmp_path / "vramguard.log"
    log.write_text(
        "2026-11-30 16:15:11,261 INFO vramguard: vramguard 0.1.0 starting; log file x\n"
        "2026-11-30 16:15:11,328 INFO uvicorn.error: Application startup complete.\n"
        "2026-11-30 16:15:14,701 INFO vramguard.engine: ready: efficientnet_lite0 on cpu\n"
        "2026-11-30 16:15:20,000 INFO vramguard.engine: ready: efficientnet_lite1 on cpu\n")
    marks = _log_marks(log, launched)
    assert set(marks) == set(LOG_MARKS.values())
    assert abs(marks["imports done"] - 7.761) < 1e-3
    assert abs(marks["uvicorn up"] - 7.828) < 1e-3
    assert abs(marks["model ready"] - 11.201) < 1e-3  # the first "ready" line counts


def test_memory_of_a_process_without_children() -> None:
    """A lone process, so that the tree's figures and its own peak describe the same
    memory (this test process may have servers as children)."""
    lone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)
        reading = tree_memory([lone.pid])
        assert 0 < reading.uss <= reading.rss
        assert 0 < reading.pss <= reading.rss
        assert _peak_rss([lone.pid]) >= reading.rss // 2
    finally:
        lone.kill()
        lone.wait()


def test_pooled_rounds_add_throughput_over_models_and_keep_memory_peaks() -> None:
    def result(ok: int, seconds: float) -> LoadResult:
        return LoadResult(16, seconds, [0.1] * ok, Counter({"200": ok}))

    pooled = Pooled()
    pooled.add({"a": result(100, 10), "b": result(50, 10)}, TreeMemory(pss=5, uss=3, rss=9))
    pooled.add({"a": result(300, 10), "b": result(50, 10)}, TreeMemory(pss=7, uss=2, rss=8))
    assert pooled.throughput() == 20 + 5
    assert pooled.errors() == 0
    assert (pooled.peak("pss"), pooled.peak("uss"), pooled.peak("rss")) == (7, 3, 9)
