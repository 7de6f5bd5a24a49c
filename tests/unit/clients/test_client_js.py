"""The JavaScript client (clients/js) under Node's own test runner: its unit tests, on a
fake fetch or a small HTTP stand-in, no vramguard (against real servers:
live/test_client_js_live.py). Skips when
Node 18 or later is missing (.ci/run installs the Debian package nodejs)."""

from __future__ import annotations

from node_tests import needs_node, run_node_tests


@needs_node
def test_js_client_units() -> None:
    """Requests, error mapping of every code, retry rules, deadlines, classifyStream (on a
    fake fetch; the `loading` answer from a real HTTP stand-in) and index.d.ts against the
    module: a few seconds."""
    run_node_tests("client.test.mjs", "declarations.test.mjs")


@needs_node
def test_js_client_finds_a_moved_server() -> None:
    """findServer() and a Client without url (Node): instance files of running and crashed
    servers, the config file and the environment, links refused, and a server on another
    port than 8765 (a real HTTP stand-in) found and followed when it moves again."""
    run_node_tests("discovery.test.mjs")


@needs_node
def test_js_client_checks_the_server_it_found() -> None:
    """A Client without url has the server it found prove itself (vramguard's proof, the
    vectors of tests/data/identity_proofs.json) before its first image: a squatter, a
    relay from the other loopback family and an unreadable token file get no image; a
    named url is taken as given."""
    run_node_tests("identity.test.mjs")
