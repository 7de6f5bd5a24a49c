"""The JavaScript client (clients/js) against real servers started here, under Node's own
test runner (its unit tests, on a fake fetch: unit/clients/test_client_js.py)."""

from __future__ import annotations

from live_server import live_server
from node_tests import needs_node, run_node_tests


@needs_node
def test_js_client_live(server, tmp_path) -> None:
    """classify, embed, models, memory and classifyStream against the session's server;
    429 retries against one limited to one classify request every 2 s."""
    with live_server(tmp_path, "--no-cache", "--batch-size", "2",
                     env={"VRAMGUARD_CLASSIFY_BURST": "1",
                          "VRAMGUARD_CLASSIFY_PER_S": "0.5"}) as limited:
        run_node_tests("live.test.mjs", env={"VRAMGUARD_URL": server.url,
                                             "VRAMGUARD_LIMITED_URL": limited.url})
