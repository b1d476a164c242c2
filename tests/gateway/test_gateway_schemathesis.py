"""schemathesis over the gateway's /openapi.json: generated requests for every operation, sent
to a gateway in front of a real stories260K engine, never get a 5xx or crash it.

TOKENMILL_GATEWAY_FUZZ_EXAMPLES sets the examples per operation (25 by default).
"""

from __future__ import annotations

import os
from collections import Counter

import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error

from tests.helpers.background_loop import BackgroundLoop
from tests.helpers.gateway_stack import (
    serve_engine,
    serve_gateway_for,
    stop_all,
    stories_with_chat_template,
    wait_healthy,
    write_routes,
)

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("TOKENMILL_GATEWAY_FUZZ_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    model = stories_with_chat_template(root)
    background = BackgroundLoop()
    engine = background.run(serve_engine(model=model))
    routes = write_routes(root / "routes.json", {
        "targets": [{"name": "e1", "address": engine[-1].address}],
        "models": {"stories": {"route": {"strategy": "latency", "targets": ["e1"]}, "tokenizer": str(model)}}})
    # Few choices per request and a short timeout: generated requests stay cheap on a small CPU.
    gateway = background.run(serve_gateway_for(routes, max_choices=4, request_timeout_s=20))
    background.run(wait_healthy(gateway, ["e1"]))
    yield f"http://127.0.0.1:{gateway.http_port}"
    background.run(stop_all([gateway, *reversed(engine)]))
    background.close()


def test_generated_requests_get_no_server_error(gateway_url):
    schema = schemathesis.openapi.from_url(f"{gateway_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = sorted(op.label for op in operations)
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"} <= set(labels), labels
    statuses: dict[str, Counter] = {}
    for operation in operations:
        seen = statuses.setdefault(operation.label, Counter())

        @hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                             suppress_health_check=list(hypothesis.HealthCheck))
        @hypothesis.given(case=operation.as_strategy())
        def check(case):
            response = case.call_and_validate(base_url=gateway_url, checks=[not_a_server_error], timeout=60)
            seen[response.status_code] += 1

        check()
    # Not only refusals: generated requests reached the engine and were served.
    for label in ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"):
        assert statuses[label][200] > 0, statuses
    # and the gateway still serves
    import httpx2
    assert httpx2.get(f"{gateway_url}/v1/models").status_code == 200
