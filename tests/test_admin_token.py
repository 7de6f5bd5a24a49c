"""The admin token: its file, and the Bearer check every admin endpoint relies on."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from app.errors import Unauthorized
from app.gates.admin_token import check_bearer, load_or_create_token

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
