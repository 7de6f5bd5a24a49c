"""Who else uses the GPU, on the NVML stand-in: the programs NVML lists (compute and
graphics), named by the operating system, the largest first, this vramguard left out; a
program whose memory the driver does not give (Windows' WDDM) is listed as unknown. Then
what a person sees: the tray's menu line (/v1/memory's list is in test_diagnostics.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest
from cuda_standin import GiB, MiB, install_gpu
from samples import sample

from app.memory.gpu_programs import other_programs
from app.memory.nvml import Nvml
from app.schemas import GpuProgram, programs_line
from tray.text import menu_lines


@pytest.fixture
def others() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Three real processes for NVML to list: their names come from the system."""
    started = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
               for _ in range(3)]
    yield started
    for process in started:
        process.kill()
        process.wait()


def test_the_other_programs_are_named_largest_first_and_this_one_left_out(monkeypatch, others):
    _, nvml = install_gpu(monkeypatch, total=8 * GiB)
    game, browser, tool = (p.pid for p in others)
    nvml.graphics_processes = {game: 2 * GiB, browser: None}  # WDDM gives no figure
    nvml.other_processes = {tool: 300 * MiB, 999_999_999: GiB}  # a PID this computer lacks
    programs = other_programs(Nvml.open())
    name = psutil.Process(game).name()
    assert [(p.pid, p.used_bytes) for p in programs] == [
        (game, 2 * GiB), (tool, 300 * MiB), (browser, None)]
    assert all(p.name == name for p in programs) and os.getpid() not in {p.pid for p in programs}
    assert programs_line(programs) == (f"{name} 2.0 GiB, {name} 300 MiB, "
                                       f"{name} (memory unknown)")
    assert other_programs(None) == []


def test_a_process_in_both_lists_is_listed_once_with_its_figure(monkeypatch, others):
    _, nvml = install_gpu(monkeypatch, total=8 * GiB)
    both = others[0].pid
    nvml.other_processes = {both: None}
    nvml.graphics_processes = {both: 512 * MiB}
    assert [(p.pid, p.used_bytes) for p in other_programs(Nvml.open())] == [(both, 512 * MiB)]
    nvml.fail("nvmlDeviceGetGraphicsRunningProcesses")
    assert [(p.pid, p.used_bytes) for p in other_programs(Nvml.open())] == [(both, None)]


def test_the_tray_names_three_and_counts_the_rest():
    game = GpuProgram(pid=1, name="game.exe", used_bytes=2 * GiB)
    browser = GpuProgram(pid=2, name="chrome.exe", used_bytes=None)
    lines = menu_lines(sample(other_programs=[game, browser, game, game, browser]))
    assert [line for line in lines if line.startswith("Other programs")] == [
        "Other programs: game.exe 2.0 GiB, chrome.exe (memory unknown), game.exe 2.0 GiB "
        "and 2 more"]
    assert not [line for line in menu_lines(sample()) if line.startswith("Other programs")]
