"""The lines the "Use it from your app" page shows, run as a person would copy them (from
the repository's folder, where the photo they send is) against real servers: curl, the
Python client, tritonclient, the JavaScript client (where Node is installed) and the admin
call; on a keyed server, the curl and tritonclient lines that send the key. What the page
holds: inprocess/test_use_page.py."""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys

import httpx
from api_key_file import KEY, key_file
from live_server import ROOT, live_server
from node_tests import NODE, needs_node


def blocks(page: str) -> dict[str, str]:
    return {name: html.unescape(code) for name, code in
            re.findall(r'<pre class="[^"]*" data-example="([^"]+)">(.*?)</pre>', page, re.S)}


def run(command: list[str]) -> str:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def top_label(curl_output: str) -> str:
    return str(json.loads(curl_output)["predictions"][0]["label"])


def test_the_pages_lines_classify_the_photo_and_the_admin_line_empties_the_cache(server):
    shown = blocks(httpx.get(f"{server.url}/ui/use").text)
    assert top_label(run(["bash", "-c", shown["curl"]])) == "espresso"
    assert run([sys.executable, "-c", shown["Python"]]).startswith("espresso ")
    assert "espresso" in run([sys.executable, "-c", shown["tritonclient"]])
    with server.client() as client:
        before = client.get("/v1/memory").json()["cache_empties"]
    assert "freed_bytes" in json.loads(run(["bash", "-c", shown["admin"]]))
    with server.client() as client:
        assert client.get("/v1/memory").json()["cache_empties"] == before + 1


@needs_node
def test_the_pages_javascript_classifies_the_photo(server):
    shown = blocks(httpx.get(f"{server.url}/ui/use").text)
    assert NODE is not None
    assert run([NODE, "--input-type=module", "-e", shown["JavaScript"]]).strip() == "espresso"


def test_on_a_keyed_server_the_pages_lines_send_the_key(tmp_path):
    with live_server(tmp_path, "--no-cache", "--device", "cpu",
                     env={"VRAMGUARD_API_KEY_FILE": str(key_file(tmp_path))}) as server:
        page = httpx.get(f"{server.url}/ui/use", headers={"Authorization": f"Bearer {KEY}"})
        assert page.status_code == 200, page.text
        shown = blocks(page.text)
        assert top_label(run(["bash", "-c", shown["curl"]])) == "espresso"
        assert "espresso" in run([sys.executable, "-c", shown["tritonclient"]])
        without_key = shown["curl"].replace(shown["curl"].splitlines()[1] + "\n", "")
        assert json.loads(run(["bash", "-c", without_key]))["error"]["code"] == "unauthorized"
