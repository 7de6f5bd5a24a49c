"""``GET /ui/use``: "Use it from your app", the API section's request in curl, Python,
JavaScript and tritonclient, for this server: its address, its model, and whether it asks
for an API key; and how to send the admin token.

The example lines are made here and only here: README.md shows them for the default
server (127.0.0.1:8765, efficientnet_lite0, no key), and a test holds the README to the
lines ``examples`` makes for it. What the page shows is filled in on the server from the
settings (HTML-escaped), so the page needs no script to be right; its script only copies
a block to the clipboard. Same Content-Security-Policy as the dashboard.
"""

from __future__ import annotations

import html
import json
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from app.api.ui import POLICY
from app.config import Settings
from app.host.address import netloc, reached_host
from app.http.state import state_of

router = APIRouter()
PAGE = Path(__file__).parent.parent / "ui" / "use.html"
DEFAULT_ADDRESS = "127.0.0.1:8765"
PHOTO = "tests/data/coffee.jpg"
PLACE = re.compile(r"\{\{(\w+)\}\}")  # {{name}} in use.html
NO_KEY_IN_CLIENTS = ("vramguard's Python and JavaScript clients cannot send an API key yet: "
                     "on this server use curl or tritonclient (below), or any HTTP library "
                     "that sends the header Authorization: Bearer KEY.")


@dataclass(frozen=True)
class Example:
    """One block of the page: its heading, its language (for the page's class) and its
    lines; ``note`` in place of the lines where there is no example to give."""

    title: str
    language: str
    code: str
    note: str = ""


def address_of(settings: Settings) -> str:
    """host:port that clients on this computer use (``app/host/address.py``)."""
    return netloc(reached_host(settings.host), settings.port)


def shell_path(path: Path, home: Path) -> str:
    """A path for a shell command line: ``~/...`` under the home folder (as the README
    writes it), quoted when it needs to be."""
    try:
        inside = path.relative_to(home)
    except ValueError:
        return shlex.quote(str(path))
    quoted = shlex.quote(inside.as_posix())
    return f"~/{inside.as_posix()}" if quoted == inside.as_posix() else shlex.quote(str(path))


def curl_example(address: str, model: str, key_file: str | None) -> str:
    key = f'     -H "Authorization: Bearer $(cat {key_file})" \\\n' if key_file else ""
    return (f"curl --data-binary @{PHOTO} -H 'Content-Type: image/jpeg' \\\n{key}"
            f"     '{address}/v1/classify?top_k=3&model={model}'")


def python_example(address: str, model: str) -> str:
    where = "" if address == DEFAULT_ADDRESS else json.dumps(f"http://{address}")
    return ("from vramguard_client import Client\n\n"
            f"with Client({where}) as vg:\n"
            f'    result = vg.classify("{PHOTO}", top_k=3, model={json.dumps(model)})\n'
            "    print(result.top.label, result.top.score)")


def javascript_example(address: str, model: str) -> str:
    made = ("new Client();  // the running vramguard, on whichever port it listens"
            if address == DEFAULT_ADDRESS else
            f"new Client({{ url: {json.dumps(f'http://{address}')} }});")
    return ('import { readFile } from "node:fs/promises";\n'
            'import { Client } from "./clients/js/index.js";\n\n'
            f"const vg = {made}\n"
            f'const result = await vg.classify(await readFile("{PHOTO}"), '
            f"{{ topK: 3, model: {json.dumps(model)} }});\n"
            "console.log(result.predictions[0].label);")


def triton_example(address: str, model: str, key_file: str | None) -> str:
    headers = ""
    if key_file:
        headers = (', headers={"Authorization": "Bearer " + '
                   f"open({json.dumps(key_file)}).read().strip()}}")
    return ("import numpy as np\n"
            "import tritonclient.http as triton\n\n"
            f"client = triton.InferenceServerClient({json.dumps(address)})\n"
            'image = triton.InferInput("IMAGE", [1], "BYTES")\n'
            f'image.set_data_from_numpy(np.array([open("{PHOTO}", "rb").read()], '
            "dtype=np.object_))\n"
            'top3 = triton.InferRequestedOutput("PROBABILITIES", class_count=3)\n'
            f"answer = client.infer({json.dumps(model)}, [image], outputs=[top3]{headers})\n"
            "print(answer.as_numpy(\"PROBABILITIES\"))  # [[b'0.954:967:espresso' ...]]")


def admin_example(address: str, token_file: str) -> str:
    return (f'curl -X POST -H "Authorization: Bearer $(cat {token_file})" \\\n'
            f"     {address}/v1/memory/empty-cache")


def examples(address: str, model: str, key_file: Path | None = None,
             home: Path | None = None) -> list[Example]:
    """The page's blocks, in the README's order; ``key_file``: the API key file, on a
    server that asks for a key (``home``: the home folder, for ``~`` in shell lines)."""
    shell_key = shell_path(key_file, home or Path.home()) if key_file else None
    if key_file:
        python = Example("Python", "python", "", NO_KEY_IN_CLIENTS)
        javascript = Example("JavaScript", "js", "", NO_KEY_IN_CLIENTS)
    else:
        python = Example("Python", "python", python_example(address, model))
        javascript = Example("JavaScript", "js", javascript_example(address, model))
    triton = triton_example(address, model, str(key_file) if key_file else None)
    return [Example("curl", "bash", curl_example(address, model, shell_key)), python,
            javascript, Example("tritonclient", "python", triton)]


@cache
def page() -> str:
    return PAGE.read_text(encoding="utf-8")


def _block(example: Example) -> str:
    title = html.escape(example.title)
    if example.note:
        return f"<h2>{title}</h2>\n<p>{html.escape(example.note)}</p>"
    return (f'<h2>{title}</h2>\n<div class="code"><button type="button">Copy</button>'
            f'<pre class="{example.language}" data-example="{html.escape(example.title)}">'
            f"{html.escape(example.code)}</pre></div>")


def render(settings: Settings, token_file: Path, home: Path) -> str:
    """The page for this server: what a person needs to call it from a program."""
    address = address_of(settings)
    if settings.api_key_file:
        key = ("It asks for an API key: every request must send the header "
               "<code>Authorization: Bearer KEY</code>, KEY being what the file "
               f"<code>{html.escape(str(settings.api_key_file))}</code> holds on the "
               "computer vramguard runs on.")
    else:
        key = ("It asks for no API key: any program on this computer may send it "
               "images.")
    admin = admin_example(address, shell_path(token_file, home))
    values = {
        "address": html.escape(address),
        "model": html.escape(settings.model),
        "key": key,
        "examples": "\n".join(_block(example) for example in
                              examples(address, settings.model, settings.api_key_file,
                                       home)),
        "admin": html.escape(admin),
    }
    return PLACE.sub(lambda match: values[match.group(1)], page())


@router.get("/ui/use", response_class=HTMLResponse,
            summary="How to call vramguard from an app, with this server's address")
async def use_page(request: Request) -> HTMLResponse:
    state = state_of(request)
    return HTMLResponse(render(state.settings, state.admin_token.path, Path.home()),
                        headers={"Cache-Control": "no-store",
                                 "Content-Security-Policy": POLICY,
                                 "X-Frame-Options": "DENY"})
