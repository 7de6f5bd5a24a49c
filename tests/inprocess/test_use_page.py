"""The "Use it from your app" page (``GET /ui/use``) in process: this server's address, its
model and key rule in the examples, the dashboard's page policy, and the README's API
section holding exactly the lines the page makes for the default server. That the lines
work against a real server: live/test_use_page_live.py."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from api_key_file import KEY, key_file
from asgi import built_app, client
from live_server import ROOT

from app.api.ui import POLICY
from app.api.use_page import (
    DEFAULT_ADDRESS,
    NO_KEY_IN_CLIENTS,
    address_of,
    admin_example,
    examples,
    shell_path,
)
from app.config import load_settings

pytestmark = pytest.mark.anyio
README = ROOT / "README.md"


def blocks(page: str) -> dict[str, str]:
    """The page's code blocks by name, as a person copies them."""
    return {name: html.unescape(code) for name, code in
            re.findall(r'<pre class="[^"]*" data-example="([^"]+)">(.*?)</pre>', page, re.S)}


def readme_blocks() -> list[str]:
    """The fenced blocks of the README's "same request" section."""
    text = README.read_text(encoding="utf-8")
    start = text.index("### The same request from curl, Python, JavaScript and Triton")
    section = text[start:text.index("The whole contract", start)]
    return [code.rstrip("\n") for code in re.findall(r"```\w+\n(.*?)```", section, re.S)]


def test_the_readme_shows_the_lines_the_page_makes_for_the_default_server():
    made = [example.code for example in examples(DEFAULT_ADDRESS, "efficientnet_lite0")]
    assert readme_blocks() == made
    assert admin_example(DEFAULT_ADDRESS, "~/.config/vramguard/admin-token") in (
        README.read_text(encoding="utf-8"))


async def test_the_page_shows_this_servers_address_model_and_that_no_key_is_needed(
        tmp_path):
    with built_app(tmp_path, port=8780, model="efficientnet_lite1") as app:
        async with client(app, base_url="http://127.0.0.1:8780") as http:
            answer = await http.get("/ui/use")
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-security-policy"] == POLICY
    assert answer.headers["x-frame-options"] == "DENY"
    assert answer.headers["cache-control"] == "no-store"
    page = answer.text
    assert "{{" not in page
    assert '<code id="address">http://127.0.0.1:8780</code>' in page
    assert '<code id="model">efficientnet_lite1</code>' in page
    assert "asks for no API key" in page
    shown = blocks(page)
    assert list(shown) == ["curl", "Python", "JavaScript", "tritonclient", "admin"]
    assert shown["curl"].endswith(
        "'127.0.0.1:8780/v1/classify?top_k=3&model=efficientnet_lite1'")
    assert 'with Client("http://127.0.0.1:8780") as vg:' in shown["Python"]
    assert 'model="efficientnet_lite1"' in shown["Python"]
    assert 'new Client({ url: "http://127.0.0.1:8780" });' in shown["JavaScript"]
    assert 'InferenceServerClient("127.0.0.1:8780")' in shown["tritonclient"]
    assert 'client.infer("efficientnet_lite1", [image]' in shown["tritonclient"]
    token = app.state.vg.admin_token.path
    assert shown["admin"] == admin_example("127.0.0.1:8780", shell_path(token, Path.home()))
    assert "Authorization" not in shown["curl"]


async def test_on_a_keyed_server_the_page_needs_the_key_and_its_lines_send_it(tmp_path):
    path = key_file(tmp_path)
    with built_app(tmp_path, api_key_file=path) as app:
        async with client(app) as http:
            refused = await http.get("/ui/use")
            answer = await http.get("/ui/use", headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 401  # like every page of a keyed server
    assert answer.status_code == 200, answer.text
    page = answer.text
    assert "It asks for an API key" in page and html.escape(str(path)) in page
    shown = blocks(page)
    assert list(shown) == ["curl", "tritonclient", "admin"]  # the clients send no key yet
    assert page.count(html.escape(NO_KEY_IN_CLIENTS)) == 2
    assert f'-H "Authorization: Bearer $(cat {shell_path(path, Path.home())})"' in (
        shown["curl"])
    assert f'headers={{"Authorization": "Bearer " + open("{path}").read().strip()}}' in (
        shown["tritonclient"])


def test_the_address_is_one_clients_on_this_computer_can_use():
    assert address_of(load_settings(port=8765)) == "127.0.0.1:8765"
    assert address_of(load_settings(host="0.0.0.0", port=9000, allow_remote=True)) == (
        "127.0.0.1:9000")
    assert address_of(load_settings(host="::1", port=9000)) == "[::1]:9000"


def test_paths_are_written_for_a_shell():
    home = Path("/home/ann")
    assert shell_path(home / ".config/vramguard/admin-token", home) == (
        "~/.config/vramguard/admin-token")
    assert shell_path(home / "my keys/api-key", home) == "'/home/ann/my keys/api-key'"
    assert shell_path(Path("/srv/vramguard/api-key"), home) == "/srv/vramguard/api-key"
