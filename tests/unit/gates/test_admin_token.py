"""The admin token: its file, and the Bearer check every admin endpoint relies on."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from app.errors import Unauthorized
from app.gates.admin_token import check_bearer
from app.host.token_file import load_or_create_token
from app.host.user_files import check_user_files
from tray.client import ApiClient

TOKEN = "s3cret-token"


@pytest.mark.parametrize("header", [
    None,                   # no Authorization header
    "",                     # an empty one
    f"Basic {TOKEN}",       # another scheme, even with the right secret
    TOKEN,                  # the secret without a scheme
    "Bearer",               # the scheme without a token
    "Bearer ",              # ... or with an empty one
    "Bearer wrong-token",
    f"Bearer {TOKEN}x",     # the right token is a prefix of what was sent
    f"Bearer {TOKEN[:-1]}",  # what was sent is a prefix of the right token
])
def test_anything_but_the_token_is_401(header: str | None) -> None:
    with pytest.raises(Unauthorized) as info:
        check_bearer(header, TOKEN)
    assert info.value.status == 401
    assert info.value.headers() == {"WWW-Authenticate": "Bearer"}


@pytest.mark.parametrize("header", [f"Bearer {TOKEN}", f"bearer {TOKEN}",
                                    f"BEARER {TOKEN}", f"Bearer {TOKEN} "])
def test_the_right_token_passes(header: str) -> None:
    check_bearer(header, TOKEN)  # no exception


def test_an_empty_configured_token_lets_nobody_in() -> None:
    for header in ("Bearer ", "Bearer", None):
        with pytest.raises(Unauthorized):
            check_bearer(header, "")


def test_token_file_is_created_owner_only_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "config" / "vramguard" / "admin-token"
    token = load_or_create_token(path)
    assert len(token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().strip() == token
    assert load_or_create_token(path) == token  # the second start reads the same one
    check_bearer(f"Bearer {token}", load_or_create_token(path))


def test_each_new_token_file_gets_its_own_token(tmp_path: Path) -> None:
    assert load_or_create_token(tmp_path / "a") != load_or_create_token(tmp_path / "b")


def test_an_empty_token_file_never_lets_anyone_in(tmp_path: Path) -> None:
    """A token file left empty (a crash between create and write, or the other process's
    file read by the FileExistsError path before it was written) must not open the door."""
    path = tmp_path / "admin-token"
    path.write_text("")
    token = load_or_create_token(path)
    assert token and path.read_text().strip() == token  # replaced by a real token
    with pytest.raises(Unauthorized):
        check_bearer("Bearer  ", token)
    with pytest.raises(Unauthorized):
        check_bearer("Bearer  ", "")  # and an empty secret never matches anything


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_a_token_other_users_can_read_is_refused_with_the_fix(tmp_path: Path, mode: int,
                                                               capsys) -> None:
    path = tmp_path / "admin-token"
    load_or_create_token(path)
    path.chmod(mode)
    with pytest.raises(OSError) as info:
        load_or_create_token(path)
    assert f"chmod 600 {path}" in str(info.value)
    files = check_user_files(path, tmp_path / "log", None)
    assert files.token is None and files.fatal is not None
    assert f"chmod 600 {path}" in files.fatal and "other users" in files.fatal
    with ApiClient("http://127.0.0.1:9", path) as client, \
            pytest.raises(RuntimeError, match="chmod 600"):
        client.set_paused(True)  # refused before anything is sent anywhere
    path.chmod(0o600)
    assert load_or_create_token(path)


def test_on_windows_the_token_must_be_in_the_users_own_profile(tmp_path: Path) -> None:
    """Windows has no mode bits to read: a token file is private when it lies in the
    user's own profile folder (whose access list only the user and the system share)."""
    from app.host.token_file import token_file_problem

    profile = tmp_path / "Users" / "ada"
    inside = profile / "AppData" / "Local" / "vramguard" / "admin-token"
    assert token_file_problem(inside, 0o666, windows=True, profile=profile) is None
    for outside in (tmp_path / "Users" / "Public" / "admin-token",
                    profile / ".." / "bob" / "admin-token", tmp_path / "shared" / "token"):
        problem = token_file_problem(outside, 0o600, windows=True, profile=profile)
        assert problem is not None and str(profile) in problem and "Move it" in problem
    assert token_file_problem(inside, 0o600, windows=False, profile=profile) is None
    assert "chmod 600" in (token_file_problem(inside, 0o644, windows=False,
                                              profile=profile) or "")
