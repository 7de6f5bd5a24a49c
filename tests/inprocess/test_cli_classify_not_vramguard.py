"""`vramguard classify --url` at a program that is not vramguard: it says what answered
(status, a web page and its title, the server's name) instead of printing that page. A
tiny HTTP server of the standard library on 127.0.0.1 plays the other program."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from images import DATA
from squatter import Squatter

from app.cli.main import main
from app.host.token_file import load_or_create_token

PAGE = (b"<!doctype html><html><head><title>Router login</title></head>"
        b"<body><form>password</form></body></html>")


@contextmanager
def other_program(status: int) -> Iterator[str]:
    class Page(BaseHTTPRequestHandler):
        server_version = "TinyRouter/1.0"

        def do_POST(self) -> None:  # answers before reading the body, as many do
            self.send_response(status)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(PAGE)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(PAGE)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("status", [200, 404])
def test_another_program_on_the_port_is_named_not_printed(
        status: int, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with other_program(status) as url:
        code = main(["classify", str(DATA / "coffee.jpg"), "--url", url])
    out, err = capsys.readouterr()
    assert code != 0 and not out
    assert f"the program answering at {url} is not vramguard" in err
    assert f"HTTP {status}" in err and '"Router login"' in err and "TinyRouter/1.0" in err
    assert "<html" not in err and "password" not in err


def test_images_go_to_no_program_that_cannot_prove_it_is_vramguard(
        capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26: vramguard is not running and another program holds its port. Without
    --url, `vramguard classify` has what answers prove it is this user's vramguard (as
    the tray does) before the first image, so the program gets the challenge and no
    image; with --url the user named it, and the images go there."""
    token_file = tmp_path / "admin-token"
    load_or_create_token(token_file)
    monkeypatch.setenv("VRAMGUARD_TOKEN_FILE", str(token_file))
    with Squatter() as squatter:
        monkeypatch.setenv("VRAMGUARD_PORT", str(squatter.port))
        code = main(["classify", str(DATA / "coffee.jpg")])
        out, err = capsys.readouterr()
        assert code != 0 and not out, err
        assert f"The program answering at {squatter.url} cannot prove" in err, err
        assert f"add --url {squatter.url}" in err, err
        assert set(squatter.paths()) == {"/healthz", "/v1/identity"}, squatter.paths()
        main(["classify", str(DATA / "coffee.jpg"), "--url", squatter.url])
        assert any(path.startswith("/v1/classify") for path in squatter.paths())
