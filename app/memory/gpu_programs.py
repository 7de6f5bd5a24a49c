"""Who else is using the GPU: the first question when memory runs short.

NVML lists the processes on the GPU (compute and graphics); their names come from the
operating system. vramguard itself is left out, and so are processes NVML lists by a
number this computer does not know (a container sees the host's). Where the driver gives
no figure per process (Windows' WDDM often does not), the program is listed with its
memory unknown: the total other programs use is still known from the device.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import psutil

from app.memory.nvml import Nvml
from app.schemas import GpuProgram


def process_name(pid: int) -> str | None:
    """The program's name, or None when this computer has no such process."""
    try:
        return psutil.Process(pid).name()
    except (psutil.Error, OSError):
        return None


def other_programs(nvml: Nvml | None, own_pid: int | None = None,
                   name_of: Callable[[int], str | None] = process_name) -> list[GpuProgram]:
    """The other programs on the GPU, the largest first (unknown sizes last)."""
    if nvml is None:
        return []
    own = os.getpid() if own_pid is None else own_pid
    programs = [GpuProgram(pid=pid, name=name, used_bytes=used)
                for pid, used in nvml.processes().items()
                if pid != own and (name := name_of(pid)) is not None]
    return sorted(programs, key=lambda p: (p.used_bytes is None, -(p.used_bytes or 0), p.name))

