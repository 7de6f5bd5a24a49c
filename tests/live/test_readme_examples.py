"""The README's API examples, as written: each code block of its API section (curl,
the Python client, the JavaScript client, tritonclient, the admin call) is taken from
README.md and run against a real server, from the repository's folder, by a user whose
folders hold nothing but what that server wrote.

The one change: the server listens on another port than 8765 (as the README's
Troubleshooting says to do when 8765 is taken), so the examples that name the address
get that port; the Python and JavaScript clients name none and must find it themselves.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from live_server import ROOT
from node_tests import NODE, needs_node

from bench.process import free_port, running

DEFAULT_ADDRESS = "127.0.0.1:8765"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Example:
    language: str
    code: str

    @property
    def kind(self) -> str:
        """Which example this is, from what it does."""
        if self.language == "bash":
            return "curl admin" if "Authorization: Bearer" in self.code else "curl"
        if self.language == "js":
            return "javascript"
        if self.language == "python":
            return "tritonclient" if "tritonclient" in self.code else "python client"
        return self.language


def api_section(readme: str) -> str:
    start = readme.index("\n## API\n")
    return readme[start:readme.index("\n## ", start + 1)]


def examples(readme: str) -> dict[str, Example]:
    """The runnable code blocks of the README's API section, by kind (the answer shown
    as JSON is not one)."""
    found = [Example(language, code) for language, code in FENCE.findall(api_section(readme))
             if language != "json"]
    by_kind = {example.kind: example for example in found}
    assert len(by_kind) == len(found), [example.kind for example in found]
    return by_kind


EXAMPLES = examples((ROOT / "README.md").read_text(encoding="utf-8"))


@dataclass(frozen=True)
class User:
    """The server a user started (`vramguard serve --port N`) and that user's world."""

    port: int
    env: dict[str, str]


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> Iterator[User]:
    """A home of its own and no XDG_* or VRAMGUARD_* variables: the server keeps its
    admin token and instance file where they are for a person on Linux (~/.config)."""
    home = tmp_path_factory.mktemp("readme-user")
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("VRAMGUARD_", "XDG_"))}
    env["HOME"] = str(home)
    port = free_port()
    assert port != 8765
    command = [sys.executable, "-m", "app", "serve", "--port", str(port)]
    with running(command, f"http://127.0.0.1:{port}/readyz", home / "server.log", env=env):
        yield User(port, env)


def run_example(user: User, example: Example) -> str:
    """Run the example from the repository's folder as that user; its standard output."""
    code = example.code
    if example.kind in ("curl", "curl admin", "tritonclient"):  # they name the address
        assert DEFAULT_ADDRESS in code, f"the {example.kind} example names no {DEFAULT_ADDRESS}"
        code = code.replace(DEFAULT_ADDRESS, f"127.0.0.1:{user.port}")
    if example.language == "bash":
        command = ["bash", "-e", "-c", code]
    elif example.language == "python":
        command = [sys.executable, "-c", code]
    else:
        assert NODE is not None
        command = [NODE, "--input-type=module", "-e", code]
    result = subprocess.run(command, cwd=ROOT, env=user.env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, f"{example.kind} example failed:\n{code}\n" \
        f"{result.stdout}\n{result.stderr}"
    return result.stdout


def test_the_api_section_has_each_example():
    assert set(EXAMPLES) == {"curl", "python client", "javascript", "tritonclient",
                             "curl admin"}


needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


@needs_curl
def test_curl_example(user):
    answer = json.loads(run_example(user, EXAMPLES["curl"]))
    assert [p["label"] for p in answer["predictions"]][:1] == ["espresso"]
    assert len(answer["predictions"]) == 3 and answer["model"] == "efficientnet_lite0"


def test_python_client_example(user):
    label, score = run_example(user, EXAMPLES["python client"]).split()
    assert label == "espresso" and 0.5 < float(score) <= 1


@needs_node
def test_javascript_example(user):
    assert run_example(user, EXAMPLES["javascript"]).strip() == "espresso"


def test_tritonclient_example(user):
    out = run_example(user, EXAMPLES["tritonclient"])
    assert re.match(r"\[\[b'0\.\d+:967:espresso' ", out), out


@needs_curl
def test_admin_curl_example(user):
    answer = json.loads(run_example(user, EXAMPLES["curl admin"]))
    assert "error" not in answer and answer, answer


def test_the_python_client_is_installed_one_way():
    """With vramguard (`pip install -e .`), or alone from the repository's folder: the
    README and the client's own README say the same, and name no other way."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    client = (ROOT / "clients" / "python" / "README.md").read_text(encoding="utf-8")
    for text in (api_section(readme), client):
        assert "pip install ./clients/python" in text
    installs = re.findall(r"pip install [^\n`]*clients/python[^\n`]*|pip install "
                          r"[^\n`]*vramguard-client[^\n`]*", readme + client)
    assert {line.split()[2].strip("'") for line in installs} <= {
        "./clients/python", "./clients/python[pil]"}, installs
