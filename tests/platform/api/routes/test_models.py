"""GET /v1/models: the base model and the caller's own adapters only."""

from __future__ import annotations

import pytest

from tests.platform.factories import BASE_MODEL

pytestmark = pytest.mark.slow


def test_models_list_and_retrieve(make_tenant, peft_adapters):
    a, b = make_tenant(), make_tenant()
    assert a.upload("a-only", peft_adapters[0]).status_code == 201
    listed = a.client.get("/v1/models").json()
    assert listed["object"] == "list"
    assert [(m["id"], m["owned_by"], m["parent"]) for m in listed["data"]] == [
        (BASE_MODEL, "loraplex", None), ("a-only", a.name, BASE_MODEL)]
    assert [m["id"] for m in b.client.get("/v1/models").json()["data"]] == [BASE_MODEL]
    assert a.client.get("/v1/models/a-only").json()["id"] == "a-only"
    assert a.client.get(f"/v1/models/{BASE_MODEL}").json()["owned_by"] == "loraplex"
    r = b.client.get("/v1/models/a-only")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
