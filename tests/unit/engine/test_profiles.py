"""Per-model profiles on disk: reused only for the same model, weights, device, driver and
torch; nothing read back is trusted."""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import replace
from pathlib import Path

import pytest

from app.engine.profiles import MAX_AGE_S, ModelProfile, ProfileKey, ProfileStore
from app.engine.warmup import BatchTiming
from app.memory.fit import MemoryFit

KEY = ProfileKey("efficientnet_lite0", "abc123", "cpu Test CPU x2", "none", "2.14.1")


def profile(**changes: object) -> ModelProfile:
    made = ModelProfile(KEY, 18_000_000, MemoryFit(1_000, 40_000_000),
                        [(1, 40_001_000), (2, 80_001_000)],
                        [BatchTiming(1, 0.03), BatchTiming(2, 0.05)], 2)
    return replace(made, **changes)  # type: ignore[arg-type]


def test_round_trip(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path / "profiles")
    store.put(profile())
    back = store.get(KEY)
    assert back is not None
    assert back.to_json() == profile().to_json() | {"measured_at": back.measured_at}
    assert back.footprint_peak() == 1_000 + 2 * 40_000_000
    assert stat.S_IMODE((tmp_path / "profiles").stat().st_mode) == 0o700
    assert [p.suffix for p in (tmp_path / "profiles").iterdir()] == [".json"]  # no temp left


@pytest.mark.parametrize("field", ["model", "weights_version", "device", "driver", "torch"])
def test_any_change_of_model_weights_device_driver_or_torch_is_a_miss(
        tmp_path: Path, field: str) -> None:
    store = ProfileStore(tmp_path)
    store.put(profile())
    assert store.get(replace(KEY, **{field: "changed"})) is None


@pytest.mark.parametrize("tamper", [
    lambda d: d.update(format=2),
    lambda d: d.update(bytes_per_sample=0),
    lambda d: d.update(bytes_per_sample=-5),
    lambda d: d.update(points=[]),
    lambda d: d.update(points=[[1, 2]] * 65),
    lambda d: d.update(timings=[[1, float("nan")]]),
    lambda d: d.update(timings=[[1, True]]),
    lambda d: d.update(chosen_batch_size="4"),
    lambda d: d["key"].update(model="resnet50"),
    lambda d: d.pop("weights_bytes"),
])
def test_a_tampered_or_foreign_file_is_ignored(tmp_path: Path, tamper, caplog) -> None:  # type: ignore[no-untyped-def]
    store = ProfileStore(tmp_path)
    store.put(profile())
    path = tmp_path / KEY.file_name()
    data = json.loads(path.read_text())
    tamper(data)
    path.write_text(json.dumps(data))
    assert store.get(KEY) is None
    assert "measuring again" in caplog.text


def test_garbage_and_an_unwritable_folder_cost_only_a_measurement(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path)
    (tmp_path / KEY.file_name()).write_bytes(b"\x00\xff not json")
    assert store.get(KEY) is None
    blocked = ProfileStore(tmp_path / "file")
    (tmp_path / "file").write_text("a file where the folder should be")
    blocked.put(profile())  # logged, not raised
    assert blocked.get(KEY) is None


def test_age(tmp_path: Path) -> None:
    assert not profile().stale
    assert profile(measured_at=time.time() - MAX_AGE_S - 60).stale
    assert os.path.basename(KEY.file_name()) == KEY.file_name()  # a name, never a path
