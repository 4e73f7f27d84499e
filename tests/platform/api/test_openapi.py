"""The OpenAPI page documents the real shapes: every JSON endpoint declares a pydantic response model,
and the documented schema of the chat and completions answers matches what the server sends."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter

from loraplex.platform.config import Settings
from loraplex.platform.main import create_app
from loraplex.platform.openai_responses import ChatCompletion, TextCompletion
from tests.platform.factories import BASE_MODEL

NOT_JSON = {("get", "/metrics")}  # Prometheus text


def test_every_json_endpoint_has_a_named_response_model():
    spec = create_app(Settings()).openapi()
    missing = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            if (method, path) in NOT_JSON:
                continue
            ok = [r for code, r in op["responses"].items() if code.startswith("2")]
            schemas = [r.get("content", {}).get("application/json", {}).get("schema", {}) for r in ok]
            if not ok or not all("$ref" in s for s in schemas):
                missing.append(f"{method.upper()} {path}")
    assert not missing, f"no response model: {missing}"
    assert len(spec["paths"]) >= 15


@pytest.mark.slow
@pytest.mark.parametrize("path, body, model", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, ChatCompletion),
    ("/v1/completions", {"prompt": "One, two,"}, TextCompletion),
])
def test_answers_validate_against_the_documented_model_exactly(make_tenant, path, body, model):
    t = make_tenant()
    r = t.client.post(path, json={"model": BASE_MODEL, "max_tokens": 3, "n": 2, **body})
    assert r.status_code == 200, r.text
    parsed = TypeAdapter(model).validate_python(r.json(), strict=False)
    assert parsed.model_dump() == r.json()  # no field the model leaves out, none it adds
    assert [c.index for c in parsed.choices] == [0, 1] and 2 <= parsed.usage.completion_tokens <= 6
