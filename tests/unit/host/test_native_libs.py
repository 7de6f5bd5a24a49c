"""`doctor`'s library checks: every bundled CUDA library is loaded for real, and one
that cannot load is named with the loader's own reason."""

from __future__ import annotations

import app.host.native_libs as native_libs
from app.cli.main import main
from app.host.native_libs import check_cuda_libraries, check_driver, library_dirs


def test_torchs_cuda_libraries_are_found_and_load_or_need_only_the_driver():
    checks = check_cuda_libraries(library_dirs())
    names = {check.name for check in checks}
    if not names:  # a CPU-only torch carries none
        return
    assert {"libcudart.so.13", "libcublas.so.13", "libcudnn.so.9"} <= names
    driver = check_driver()
    for check in checks:
        assert check.ok or (not driver.ok and check.needs_driver()), check


def test_a_library_that_cannot_load_is_a_problem_doctor_names(tmp_path, monkeypatch, capsys):
    broken = tmp_path / "libcudnn.so.9"
    broken.write_bytes(b"not a shared library, " * 200)
    monkeypatch.setattr(native_libs, "library_dirs", lambda: [tmp_path])
    monkeypatch.setattr("app.engine.system_checks.library_dirs", lambda: [tmp_path])
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "!!   libcudnn.so.9        does not load:" in out
    assert "invalid ELF header" in out or "not a shared library" in out.lower()
    assert "1 problem(s) found" in out
