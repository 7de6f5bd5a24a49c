"""The launcher's Job object (issue 27, item 6): Windows only, so kernel32 is a stand-in
that records each call and keeps the handles it gave; the structure's layout is the one
Windows reads (JOBOBJECT_EXTENDED_LIMIT_INFORMATION, 144 bytes on 64-bit)."""

from __future__ import annotations

import ctypes
import logging
import sys

import pytest

from app.host import server_job
from app.host.server_job import ExtendedLimits, ServerJob


class Kernel32:
    def __init__(self, refuse: str = "") -> None:
        self.refuse = refuse
        self.calls: list[tuple[object, ...]] = []
        self.flags: int | None = None

    def _answer(self, name: str, value: int) -> int:
        return 0 if name == self.refuse else value

    def CreateJobObjectW(self, attributes: object, name: object) -> int:
        self.calls.append(("CreateJobObjectW", attributes, name))
        return self._answer("CreateJobObjectW", 0x40)

    def SetInformationJobObject(self, job: int, kind: int, info: object,
                                size: int) -> int:
        limits = info._obj  # type: ignore[attr-defined]  # byref()'s structure
        self.flags = limits.BasicLimitInformation.LimitFlags
        self.calls.append(("SetInformationJobObject", job, kind, size))
        return self._answer("SetInformationJobObject", 1)

    def OpenProcess(self, access: int, inherit: int, pid: int) -> int:
        self.calls.append(("OpenProcess", access, inherit, pid))
        return self._answer("OpenProcess", 0x80)

    def AssignProcessToJobObject(self, job: int, process: int) -> int:
        self.calls.append(("AssignProcessToJobObject", job, process))
        return self._answer("AssignProcessToJobObject", 1)

    def CloseHandle(self, handle: int) -> int:
        self.calls.append(("CloseHandle", handle))
        return 1


@pytest.mark.skipif(ctypes.sizeof(ctypes.c_void_p) != 8, reason="64-bit layout")
def test_the_structure_has_windows_64_bit_layout():
    assert ctypes.sizeof(ExtendedLimits) == 144
    assert server_job.BasicLimits.LimitFlags.offset == 16
    assert ExtendedLimits.IoInfo.offset == 64


def test_a_server_goes_in_a_job_that_ends_it_with_the_launcher():
    kernel32 = Kernel32()
    job = ServerJob(kernel32)
    assert job.add(4242)
    assert kernel32.flags == server_job.JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE
    names = [call[0] for call in kernel32.calls]
    assert names == ["CreateJobObjectW", "SetInformationJobObject", "OpenProcess",
                     "AssignProcessToJobObject", "CloseHandle"]
    assert kernel32.calls[1] == ("SetInformationJobObject", 0x40, 9,
                                 ctypes.sizeof(ExtendedLimits))
    assert kernel32.calls[2][3] == 4242
    assert ("CloseHandle", 0x40) not in kernel32.calls  # the job's handle lives with us


@pytest.mark.parametrize("refused", ["CreateJobObjectW", "SetInformationJobObject",
                                     "OpenProcess", "AssignProcessToJobObject"])
def test_a_refusal_is_logged_and_the_server_runs_outside_a_job(refused, caplog):
    caplog.set_level(logging.WARNING)
    kernel32 = Kernel32(refuse=refused)
    assert not ServerJob(kernel32).add(4242)
    assert "job" in caplog.text
    opened = [call for call in kernel32.calls if call[0] == "OpenProcess"]
    closed = [call for call in kernel32.calls if call[0] == "CloseHandle"]
    assert len(closed) >= len([c for c in opened if refused != "OpenProcess"])


@pytest.mark.skipif(sys.platform == "win32", reason="off Windows nothing is done")
def test_off_windows_there_is_no_job():
    assert not ServerJob().add(4242)
