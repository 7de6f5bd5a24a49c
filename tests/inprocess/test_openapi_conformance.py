"""The OpenAPI document says what the server really answers (issue 26, item 9): each
mismatch found, held by the document and by the answer itself. The live fuzz test
(tests/live/test_fuzz.py) checks every generated answer against the document."""

from __future__ import annotations

from typing import Any

import pytest
from asgi import built_app, client, error_message

pytestmark = pytest.mark.anyio
ERROR = "#/components/schemas/ErrorResponse"


def responses(document: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    return document["paths"][path][method]["responses"]  # type: ignore[no-any-return]


def schema_ref(response: dict[str, Any], media: str = "application/json") -> str | None:
    return response.get("content", {}).get(media, {}).get("schema", {}).get("$ref")


async def test_the_streams_refusals_are_documented_as_the_json_they_are(tmp_path) -> None:
    with built_app(tmp_path, ready=True) as app:
        document = app.openapi()
        async with client(app) as http:
            refused = await http.post("/v1/classify/stream", content=b"x",
                                      headers={"Content-Type": "text/plain"})
    assert refused.headers["content-type"].startswith("application/json")
    documented = responses(document, "post", "/v1/classify/stream")
    assert refused.status_code in (400, 415)
    for status, response in documented.items():
        if status != "200":
            assert list(response["content"]) == ["application/json"], status
            assert schema_ref(response) == ERROR


async def test_the_dashboard_handshakes_document_their_400_401_and_403(tmp_path) -> None:
    with built_app(tmp_path, ready=True) as app:
        document = app.openapi()
        async with client(app) as http:
            malformed = await http.post("/v1/ui/session", json={"nothing": 1})
            expired = await http.post("/v1/ui/session", json={"code": "x" * 32})
            stranger = await http.post("/v1/admin/ui-link")
    error_message(malformed, 400, "bad_request")
    error_message(expired, 401, "unauthorized")
    error_message(stranger, 401, "unauthorized")
    session = responses(document, "post", "/v1/ui/session")
    assert {"400", "401"} <= set(session) and "422" not in session
    assert {"401", "403"} <= set(responses(document, "post", "/v1/admin/ui-link"))


async def test_no_route_documents_fastapis_guessed_422(tmp_path) -> None:
    """A request that fails validation gets 400 in vramguard's error shape: FastAPI's
    HTTPValidationError 422 is never answered, so it is documented nowhere."""
    with built_app(tmp_path, ready=True) as app:
        document = app.openapi()
        async with client(app) as http:
            bad = await http.post("/v1/identity", json={"nonce": "not hex"})
    error_message(bad, 400, "bad_request")
    assert "HTTPValidationError" not in str(document)
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            if operation.get("parameters") or operation.get("requestBody"):
                assert "400" in operation["responses"], (method, path)
    assert schema_ref(responses(document, "get", "/v2/models/{name}")["400"]) == \
        "#/components/schemas/OipError"


async def test_v2_infer_takes_exactly_one_input(tmp_path) -> None:
    with built_app(tmp_path, ready=True) as app:
        document = app.openapi()
        async with client(app) as http:
            empty = await http.post("/v2/models/efficientnet_lite0/infer", json={"inputs": []})
    assert empty.status_code == 400 and isinstance(empty.json()["error"], str)
    body = document["paths"]["/v2/models/{name}/infer"]["post"]["requestBody"]
    inputs = body["content"]["application/json"]["schema"]["properties"]["inputs"]
    assert (inputs["minItems"], inputs["maxItems"]) == (1, 1)


async def test_the_keep_alive_header_is_documented_where_it_is_sent(tmp_path) -> None:
    with built_app(tmp_path, ready=True) as app:
        document = app.openapi()
    for path in ("/v1/classify", "/v1/embed", "/v1/classify/stream"):
        assert "X-Vramguard-Keep-Alive" in responses(document, "post", path)["200"]["headers"]
