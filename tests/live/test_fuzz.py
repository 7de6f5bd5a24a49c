"""Property-based fuzzing of the whole OpenAPI surface (schemathesis + hypothesis), with
valid and invalid inputs: no generated request may cause a 5xx other than the documented
503s (busy, not ready, paused, out of memory), every error is the documented JSON
shape, and every answer conforms to the document: its status is one the operation
documents, its content type one documented for that status, its headers and body valid
against the schema (the session's server has no rate limit, so no 429 is answered).

schemathesis's own pytest plugin does not work with pytest 9, so the operations are
driven with hypothesis directly.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CONFORMANCE = [status_code_conformance, content_type_conformance,
               response_headers_conformance, response_schema_conformance]


def check(case) -> None:
    response = case.call(timeout=60)
    assert response.status_code < 500 or response.status_code == 503, (
        f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}")
    case.validate_response(response, checks=CONFORMANCE)
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}
        if case.path.startswith("/v2"):  # the Open Inference Protocol's shape
            assert isinstance(body["error"], str) and body["error"]
        else:
            assert {"code", "message"} <= set(body["error"])


def test_no_generated_request_breaks_the_server(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    for operation, mode in [(op, mode) for op in operations for mode in
                            (schemathesis.GenerationMode.POSITIVE,
                             schemathesis.GenerationMode.NEGATIVE)]:
        run = settings(max_examples=30, deadline=None, database=None,
                       suppress_health_check=list(HealthCheck))(
            given(case=operation.as_strategy(generation_mode=mode))(check))
        try:
            run()
        except Unsatisfiable:  # nothing invalid to generate for an operation without inputs
            assert mode is schemathesis.GenerationMode.NEGATIVE
    with server.client() as client:
        assert client.get("/healthz").status_code == 200
