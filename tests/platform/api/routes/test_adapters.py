"""/v1/adapters over HTTP: uploads in every accepted form, refusals that store nothing, 413, quotas,
listing and deletion, bytes shared between tenants, adapters stored by older versions."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from loraplex.adapters.store import content_digest
from loraplex.platform import crud, db
from loraplex.platform.config import QuotaDefaults
from loraplex.platform.models import Adapter
from tests.platform import factories
from tests.platform.factories import ADAPTER_FILES, BASE_MODEL, adapter_members, tar_gz_bytes, zip_bytes

pytestmark = pytest.mark.slow


def stored(gateway) -> set[str]:
    """Digests of the objects in the adapter store."""
    return {p.name for p in (gateway.store.root / "objects").iterdir()}


def everything(gateway) -> set[str]:
    """Every file and directory under the adapter store's root (uploads are unpacked there too)."""
    root = gateway.store.root
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def fresh_copy(directory: Path, out: Path) -> Path:
    """The adapter with bytes no other test uploads (a newline after its config's JSON)."""
    out.mkdir()
    for n in ADAPTER_FILES:
        shutil.copyfile(directory / n, out / n)
    with open(out / "adapter_config.json", "ab") as f:
        f.write(b"\n")
    return out


def num_rows(gateway, tenant_id) -> int:
    with gateway.sessions() as s:
        return s.scalar(select(func.count()).where(Adapter.tenant_id == tenant_id))


def test_upload_files_zip_and_tar(make_tenant, peft_adapters, gateway):
    t = make_tenant()
    r = t.upload("plain", peft_adapters[0])
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["id"] == "plain" and body["parent"] == BASE_MODEL and body["rank"] == 8
    assert body["target_modules"] == ["o_proj", "q_proj", "v_proj"]
    for name, data in (("zipped.zip", zip_bytes(adapter_members(peft_adapters[0]))),
                       ("tarred.tar.gz", tar_gz_bytes(adapter_members(peft_adapters[0], "./")))):
        r = t.client.post("/v1/adapters", data={"name": name.split(".")[0]}, files={"file": (name, data)})
        assert r.status_code == 201, r.text
        assert r.json()["digest"] == body["digest"]  # the same bytes
    assert body["digest"] in stored(gateway)
    names = [a["id"] for a in t.client.get("/v1/adapters").json()["data"]]
    assert names == ["plain", "zipped", "tarred"]
    assert t.client.get("/v1/adapters/zipped").json()["num_bytes"] == body["num_bytes"]
    r = t.upload("plain", peft_adapters[1])
    assert r.status_code == 409 and r.json()["error"]["param"] == "name"


def test_corrupt_uploads_store_nothing(make_tenant, peft_adapters, gateway):
    t = make_tenant()
    before = stored(gateway)
    config = (peft_adapters[0] / "adapter_config.json").read_bytes()
    tensors = (peft_adapters[0] / "adapter_model.safetensors").read_bytes()
    cases = {
        "truncated tensors": [("file", ("adapter_config.json", config)),
                              ("file", ("adapter_model.safetensors", tensors[: len(tensors) // 2]))],
        "bad json": [("file", ("adapter_config.json", b"{nope")),
                     ("file", ("adapter_model.safetensors", tensors))],
        "rank too large": [("file", ("adapter_config.json", config.replace(b'"r": 8', b'"r": 128'))),
                           ("file", ("adapter_model.safetensors", tensors))],
        "one file": [("file", ("adapter_config.json", config))],
        "archive with ..": [("file", ("a.zip", zip_bytes({**adapter_members(peft_adapters[0]), "../x": b"x"})))],
        "archive with a link": [("file", ("a.zip", zip_bytes({"adapter_config.json": config},
                                                             symlinks={"adapter_model.safetensors": "/etc/passwd"})))],
    }
    for what, files in cases.items():
        r = t.client.post("/v1/adapters", data={"name": "bad"}, files=files)
        assert r.status_code == 400, (what, r.text)
        assert r.json()["error"]["param"] == "file", what
    assert stored(gateway) == before and num_rows(gateway, t.id) == 0
    r = t.client.post("/v1/adapters", data={"name": "../evil"}, files=[
        ("file", (n, (peft_adapters[0] / n).read_bytes())) for n in ADAPTER_FILES])
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"
    r = t.client.post("/v1/adapters", data={"name": BASE_MODEL}, files=[
        ("file", (n, (peft_adapters[0] / n).read_bytes())) for n in ADAPTER_FILES])
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"
    assert stored(gateway) == before and num_rows(gateway, t.id) == 0


def test_oversized_upload_is_413(make_tenant, gateway, server):
    t = make_tenant()
    before = stored(gateway)
    limit = gateway.settings.max_upload_bytes
    big = b"\0" * (limit + 1)
    r = t.client.post("/v1/adapters", data={"name": "big"},
                      files=[("file", ("adapter_config.json", b"{}")), ("file", ("adapter_model.safetensors", big))])
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit holds on the bytes actually received
        yield b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"adapter_model.safetensors\"\r\n\r\n"
        for _ in range(limit // (1 << 20) + 2):
            yield b"\0" * (1 << 20)

    r = httpx.post(server.url + "/v1/adapters", content=chunks(), timeout=60,
                   headers={"Authorization": f"Bearer {t.key}", "content-type": "multipart/form-data; boundary=b"})
    assert r.status_code == 413
    assert stored(gateway) == before


def test_adapter_quotas(make_tenant, peft_adapters):
    t = make_tenant(max_adapters=1)
    assert t.upload("one", peft_adapters[0]).status_code == 201
    r = t.upload("two", peft_adapters[1])
    assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
    size = sum((peft_adapters[0] / n).stat().st_size for n in ADAPTER_FILES)
    t2 = make_tenant(max_adapter_bytes=size + size // 2)
    assert t2.upload("one", peft_adapters[0]).status_code == 201
    r = t2.upload("two", peft_adapters[1])
    assert r.status_code == 429 and "storage" in r.json()["error"]["message"]


def test_same_bytes_are_stored_once_and_deleted_last(make_tenant, peft_adapters, gateway):
    a, b = make_tenant(), make_tenant()
    digest = a.upload("x", peft_adapters[1]).json()["digest"]
    assert b.upload("y", peft_adapters[1]).json()["digest"] == digest
    assert a.client.delete("/v1/adapters/x").status_code == 200
    assert digest in stored(gateway)  # b still uses it
    assert b.chat("y", max_tokens=2).status_code == 200
    assert b.client.delete("/v1/adapters/y").json() == {"id": "y", "object": "adapter", "deleted": True}
    assert digest not in stored(gateway)
    assert b.chat("y").status_code == 404
    assert b.client.delete("/v1/adapters/y").status_code == 404
    assert b.client.get("/v1/adapters/y").status_code == 404


def test_delete_waits_for_running_requests(make_tenant, peft_adapters, gateway):
    t = make_tenant()
    assert t.upload("busy", peft_adapters[0]).status_code == 201
    body = {"model": "busy", "messages": [{"role": "user", "content": "Write a story."}], "max_tokens": 120,
            "temperature": 0, "stream": True}
    with t.client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        deleted = {}
        thread = threading.Thread(target=lambda: deleted.update(r=t.client.delete("/v1/adapters/busy")))
        thread.start()
        thread.join(timeout=0.5)
        assert thread.is_alive()  # the delete waits for the running request
        assert t.chat("busy").status_code == 404  # but new requests no longer see the adapter
        text = [line for line in lines if line]
    thread.join(timeout=30)
    assert deleted["r"].status_code == 200
    assert text[-1] == "data: [DONE]" and not any('"error"' in line for line in text)


def test_same_bytes_from_two_tenants_are_one_object(make_tenant, peft_adapters, gateway, tmp_path):
    a, b = make_tenant(), make_tenant()
    adapter = fresh_copy(peft_adapters[0], tmp_path / "fresh")
    before = stored(gateway)
    bodies = [t.upload(name, adapter).json() for t, name in ((a, "mine"), (b, "mine"), (b, "again"))]
    digest = bodies[0]["digest"]
    assert [body["digest"] for body in bodies] == [digest] * 3
    assert stored(gateway) == before | {digest}  # one object for the three names
    assert a.client.delete("/v1/adapters/mine").status_code == 200
    assert a.chat("mine").status_code == 404
    for name in ("mine", "again"):  # b's adapters load (for the first time) from the files a shared
        r = b.chat(name, max_tokens=2)
        assert r.status_code == 200 and r.json()["model"] == name, r.text
    assert b.client.delete("/v1/adapters/mine").status_code == 200
    assert stored(gateway) == before | {digest}
    assert b.chat("again", max_tokens=2).status_code == 200
    assert b.client.delete("/v1/adapters/again").status_code == 200
    assert stored(gateway) == before


def test_failed_uploads_leave_no_files(make_tenant, peft_adapters, gateway, tmp_path):
    adapter = fresh_copy(peft_adapters[0], tmp_path / "fresh")
    members = adapter_members(adapter)
    size = sum(len(v) for v in members.values())
    t = make_tenant(max_adapter_bytes=size - 1)
    limit = gateway.settings.max_upload_bytes
    before = everything(gateway)
    cases = {
        "invalid adapter": (400, [("file", ("adapter_config.json", members["adapter_config.json"])),
                                  ("file", ("adapter_model.safetensors", members["adapter_model.safetensors"][:-8]))]),
        "refused archive member": (400, [("file", ("a.zip", zip_bytes({**members, "../x": b"x"})))]),
        "unpacks past the limit": (413, [("file", ("a.zip", zip_bytes({
            "adapter_config.json": members["adapter_config.json"], "adapter_model.safetensors": b"\0" * (limit + 1)})))]),
        "over the storage quota": (429, [("file", (n, data)) for n, data in members.items()]),
    }
    for what, (status, files) in cases.items():
        r = t.client.post("/v1/adapters", data={"name": "x"}, files=files)
        assert r.status_code == status, (what, r.text)
        assert everything(gateway) == before, what
    assert num_rows(gateway, t.id) == 0


def test_adapters_stored_by_an_older_gateway_keep_working(make_settings, start_app, peft_adapters):
    """Before the AdapterStore, the gateway kept files at <adapters>/<digest>/ with the row's digest."""
    settings = make_settings()
    db.upgrade(settings.sqlalchemy_url)
    engine = db.make_engine(settings.sqlalchemy_url)
    config = (peft_adapters[0] / "adapter_config.json").read_bytes()
    digest = content_digest(config, peft_adapters[0] / "adapter_model.safetensors")
    with db.make_session_factory(engine).begin() as s:
        tenant = crud.create_tenant(s, "old", QuotaDefaults(), factories.UNLIMITED)
        _, key = crud.issue_key(s, tenant)
        s.add(Adapter(tenant_id=tenant.id, name="kept", digest=digest, num_bytes=123, rank=8,
                      target_modules=["o_proj", "q_proj", "v_proj"]))
    engine.dispose()
    old = settings.adapters_dir / digest
    old.mkdir(parents=True)
    for n in ADAPTER_FILES:
        shutil.copyfile(peft_adapters[0] / n, old / n)
    server = start_app(settings)
    assert not old.exists()
    with factories.client(server.url, key) as c:
        t = factories.TenantClient(tenant.id, "old", key, c)
        assert t.client.get("/v1/adapters/kept").json()["digest"] == digest
        r = t.chat("kept", max_tokens=2)
        assert r.status_code == 200, r.text
        assert t.client.delete("/v1/adapters/kept").status_code == 200
    assert list((settings.adapters_dir / "objects").iterdir()) == []
