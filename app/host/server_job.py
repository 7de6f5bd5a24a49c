"""On Windows the server a launcher starts runs in a Job object that ends with the
launcher, unless ``--keep-server``.

A launcher ended in Task Manager or by TerminateProcess runs no code of ours, so
without this its server lived on, holding the port, with no icon to stop it. The job is
made with JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE and its one handle is the launcher's: when
the launcher ends, however, Windows closes the handle and ends every process in the job
(the server and the decode workers it starts, which inherit the job). `vramguard stop`
still lets the server finish first (app/cli/process_control.py); the job is for the end
nobody asked for. Elsewhere this is not needed in the same way (a launcher ended with
SIGTERM ends its server itself), and nothing is done.

kernel32 is passed in, so the calls and the structure's layout are tested off Windows.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import Any

log = logging.getLogger("vramguard.tray")

JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE = 0x2000
JOB_OBJECT_EXTENDED_LIMIT_INFORMATION_CLASS = 9
PROCESS_SET_QUOTA = 0x0100
PROCESS_TERMINATE = 0x0001
DWORD = ctypes.c_uint32  # Windows' DWORD is 32 bits everywhere (c_ulong is not)


class IoCounters(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "ReadOperationCount", "WriteOperationCount", "OtherOperationCount",
        "ReadTransferCount", "WriteTransferCount", "OtherTransferCount")]


class BasicLimits(ctypes.Structure):
    _fields_ = [("PerProcessUserTimeLimit", ctypes.c_int64),
                ("PerJobUserTimeLimit", ctypes.c_int64),
                ("LimitFlags", DWORD),
                ("MinimumWorkingSetSize", ctypes.c_size_t),
                ("MaximumWorkingSetSize", ctypes.c_size_t),
                ("ActiveProcessLimit", DWORD),
                ("Affinity", ctypes.c_size_t),
                ("PriorityClass", DWORD),
                ("SchedulingClass", DWORD)]


class ExtendedLimits(ctypes.Structure):
    """JOBOBJECT_EXTENDED_LIMIT_INFORMATION (144 bytes on 64-bit Windows)."""

    _fields_ = [("BasicLimitInformation", BasicLimits),
                ("IoInfo", IoCounters),
                ("ProcessMemoryLimit", ctypes.c_size_t),
                ("JobMemoryLimit", ctypes.c_size_t),
                ("PeakProcessMemoryUsed", ctypes.c_size_t),
                ("PeakJobMemoryUsed", ctypes.c_size_t)]


def _kernel32() -> Any:
    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
    kernel32.CreateJobObjectW.restype = ctypes.c_void_p
    kernel32.CreateJobObjectW.argtypes = (ctypes.c_void_p, ctypes.c_wchar_p)
    kernel32.SetInformationJobObject.argtypes = (ctypes.c_void_p, ctypes.c_int,
                                                 ctypes.c_void_p, DWORD)
    kernel32.OpenProcess.restype = ctypes.c_void_p
    kernel32.OpenProcess.argtypes = (DWORD, ctypes.c_int, DWORD)
    kernel32.AssignProcessToJobObject.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    kernel32.CloseHandle.argtypes = (ctypes.c_void_p,)
    return kernel32


def _last_error() -> int:
    """Windows' last error of this thread (kernel32 is loaded with use_last_error)."""
    return int(getattr(ctypes, "get_last_error", lambda: 0)())


class ServerJob:
    """The launcher's job; ``add(pid)`` puts a server it started in it. Every failure is
    logged and leaves the server running outside the job: it is a safety net, never a
    reason not to start."""

    def __init__(self, kernel32: Any | None = None) -> None:
        self._kernel32: Any = kernel32
        self._job: int | None = None
        if kernel32 is None and sys.platform != "win32":
            return  # nothing to do here (see the module's docstring)
        self._kernel32 = kernel32 or _kernel32()
        job = self._kernel32.CreateJobObjectW(None, None)
        if not job:
            log.warning("could not make a job object (error %d): a launcher ended from "
                        "Task Manager leaves its server running", _last_error())
            return
        limits = ExtendedLimits()
        limits.BasicLimitInformation.LimitFlags = JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE
        if not self._kernel32.SetInformationJobObject(
                job, JOB_OBJECT_EXTENDED_LIMIT_INFORMATION_CLASS, ctypes.byref(limits),
                ctypes.sizeof(limits)):
            log.warning("could not set up the job object (error %d)", _last_error())
            self._kernel32.CloseHandle(job)
            return
        self._job = job  # never closed by us: Windows closes it when the launcher ends

    def add(self, pid: int) -> bool:
        """Put process ``pid`` in the job; False when there is no job or Windows refused."""
        if self._job is None:
            return False
        process = self._kernel32.OpenProcess(PROCESS_SET_QUOTA | PROCESS_TERMINATE, 0, pid)
        if not process:
            log.warning("could not open the server (pid %d) to put it in the job", pid)
            return False
        try:
            if not self._kernel32.AssignProcessToJobObject(self._job, process):
                log.warning("could not put the server (pid %d) in the job (error %d)", pid,
                            _last_error())
                return False
        finally:
            self._kernel32.CloseHandle(process)
        return True
