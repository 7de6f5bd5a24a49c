"""The JavaScript client (clients/js) against real servers started here, under Node's own
test runner (its unit tests, on a fake fetch: unit/clients/test_client_js.py)."""

from __future__ import annotations

from live_server import USER_DIRS, live_server
from node_tests import needs_node, run_node_tests


@needs_node
def test_js_client_live(server, tmp_path) -> None:
    """classify, embed, models, memory and classifyStream against the session's server;
    429 retries against one limited to one classify request every 2 s (started with
    command-line options, `--classify-burst 1 --classify-per-s 0.5`); a Client without url
    finds the session's server, which listens on another port than 8765, as a program of
    its user would (the same user folders and token file)."""
    assert not server.url.endswith(":8765")
    with live_server(tmp_path, "--no-cache", "--batch-size", "2", "--classify-burst", "1",
                     "--classify-per-s", "0.5") as limited:
        user = {var: str(server.home / var.lower()) for var in USER_DIRS}
        run_node_tests("live.test.mjs", env={
            **user, "VRAMGUARD_TOKEN_FILE": str(server.token_file),
            "VRAMGUARD_URL": server.url, "VRAMGUARD_LIMITED_URL": limited.url})
