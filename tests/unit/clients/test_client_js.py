"""The JavaScript client (clients/js) under Node's own test runner: its unit tests, on a
fake fetch, no server (against real servers: live/test_client_js_live.py). Skips when
Node 18 or later is missing (.ci/run installs the Debian package nodejs)."""

from __future__ import annotations

from node_tests import needs_node, run_node_tests


@needs_node
def test_js_client_units() -> None:
    """Requests, error mapping of every code, retry rules, deadlines, classifyStream (on a
    fake fetch) and index.d.ts against the module: a few seconds."""
    run_node_tests("client.test.mjs", "declarations.test.mjs")
