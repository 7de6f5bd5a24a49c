"""Where a local client reaches a server listening on a host: the loopback address of the
family it binds, never the other one (issue 26: a server on ``::1`` was reached at
``127.0.0.1``, where another user's relay listened). vramguard, the Python client and the
JavaScript client (clients/js/test/discovery.test.mjs) are held to one table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vramguard_client._discovery import url_for
from vramguard_client._protocol import expected_proof

from app.api.use_page import address_of
from app.config import Settings
from app.host.address import local_url
from app.host.token_file import identity_proof, proof_address

TABLE = json.loads((Path(__file__).parents[2] / "data" / "reached_hosts.json").read_text())


@pytest.mark.parametrize(("host", "url"), sorted(TABLE.items()))
def test_every_part_reaches_the_same_address(host: str, url: str) -> None:
    assert local_url(host, 8765) == url
    assert url_for(host, 8765) == url
    assert f"http://{address_of(Settings(host=host or '127.0.0.1', port=8765))}" == \
        (url if host else "http://127.0.0.1:8765")


def test_a_server_on_ipv6_loopback_is_never_sent_to_ipv4() -> None:
    assert "127.0.0.1" not in local_url("::1", 8765)
    assert "127.0.0.1" not in url_for("::1", 8765)


PROOFS = json.loads((Path(__file__).parents[2] / "data" / "identity_proofs.json").read_text())


@pytest.mark.parametrize("case", PROOFS, ids=[case["host"] for case in PROOFS])
def test_the_server_and_the_python_client_agree_on_the_proof(case: dict[str, object]) -> None:
    """The vectors the JavaScript client is held to (identity.test.mjs) are the server's
    and the Python client's too."""
    nonce = bytes.fromhex(str(case["nonce"]))
    args = (str(case["token"]), nonce, str(case["host"]), int(str(case["port"])))
    assert identity_proof(*args) == expected_proof(*args) == case["proof"]


def test_a_dual_stack_view_of_ipv4_is_ipv4() -> None:
    assert proof_address("::ffff:127.0.0.1") == proof_address("127.0.0.1") == bytes([127, 0, 0, 1])
    assert proof_address("[::1]") == bytes(15) + b"\x01"
