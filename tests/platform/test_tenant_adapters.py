"""A tenant's adapters in the AdapterStore and the database, without HTTP or a model: files of older
gateways moved in, a re-upload while the old version unloads, a lost race for a name."""

from __future__ import annotations

import uuid

import pytest

from loraplex.adapters.store import AdapterStore
from loraplex.platform import crud, db, store_migrations
from loraplex.platform.config import QuotaDefaults
from loraplex.platform.errors import APIError
from loraplex.platform.models import Adapter
from loraplex.platform.tenant_adapters import TenantAdapters

GOOD = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"tensors"}
OTHER = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"other tensors"}
GOOD_DIGEST = "6bd68cdb7ee5c2a6701be57939c492d9c6464b42190c33d5fae5a6003d172923"  # what older gateways stored


@pytest.fixture
def gw(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    sessions, store = db.make_session_factory(engine), AdapterStore(tmp_path / "adapters")
    # No engine or lifecycle: these tests stop before validation with the model and before unloading.
    yield TenantAdapters(sessions, store, engine=None, lifecycle=None, max_upload_bytes=1 << 20)
    engine.dispose()


def make_tenant(gw) -> int:
    with gw.sessions.begin() as s:
        return crud.create_tenant(s, f"t{len(crud.list_tenants(s)[0])}", QuotaDefaults()).id


def write_files(directory, files: dict[str, bytes]):
    directory.mkdir(parents=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory


def upload(gw, tmp_path, tenant_id: int, name: str, files: dict[str, bytes]) -> Adapter:
    """What add_adapter does once the upload is unpacked and valid."""
    up = write_files(tmp_path / "uploads" / uuid.uuid4().hex, files)
    return gw._store_and_record(tenant_id, name, up, 8, ["q_proj"], None, None)


def delete_row(gw, tenant_id: int, name: str) -> Adapter:
    """The first half of delete_adapter: the name is free at once, the files wait for the unload."""
    with gw.sessions.begin() as s:
        row = crud.get_adapter(s, tenant_id, name)
        s.delete(row)
    return row


def files_under(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != ".lock"}


def test_files_of_older_gateways_are_moved_into_the_store(gw, tmp_path):
    a, b = make_tenant(gw), make_tenant(gw)
    root = gw.store.root
    write_files(root / GOOD_DIGEST, GOOD)  # the old layout: <adapters>/<digest>/
    write_files(root / ("0" * 64), GOOD)  # no row refers to it
    with gw.sessions.begin() as s:
        for tenant_id, name in ((a, "x"), (b, "y")):
            s.add(Adapter(tenant_id=tenant_id, name=name, digest=GOOD_DIGEST, num_bytes=15, rank=8,
                          target_modules=["q_proj"]))
    store_migrations.adopt_legacy_files(gw.store, gw.sessions)
    store_migrations.adopt_legacy_files(gw.store, gw.sessions)  # every start runs it
    assert files_under(root) == {f"objects/{GOOD_DIGEST}/{n}" for n in GOOD} | {
        f"owners/{a}/x.{GOOD_DIGEST[:16]}.json", f"owners/{b}/y.{GOOD_DIGEST[:16]}.json"}
    with gw.sessions() as s:
        rows = crud.adapters_with_digest(s, GOOD_DIGEST)
    for row in rows:
        d = gw.path(row)
        assert {n: (d / n).read_bytes() for n in GOOD} == GOOD


def test_same_bytes_from_two_tenants_are_stored_once(gw, tmp_path):
    a, b = make_tenant(gw), make_tenant(gw)
    rows = [upload(gw, tmp_path, a, "x", GOOD), upload(gw, tmp_path, b, "x", GOOD),
            upload(gw, tmp_path, b, "z", GOOD)]
    assert {r.digest for r in rows} == {GOOD_DIGEST}  # the digest databases already hold for these bytes
    assert [p.name for p in (gw.store.root / "objects").iterdir()] == [GOOD_DIGEST]
    for row in rows[:2]:
        delete_row(gw, row.tenant_id, row.name)
        gw._forget(row.tenant_id, row.name, row.digest)
    assert (gw.path(rows[2]) / "adapter_model.safetensors").read_bytes() == b"tensors"


@pytest.mark.parametrize("again", [GOOD, OTHER], ids=["same-bytes", "other-bytes"])
def test_reupload_while_the_old_version_unloads(gw, tmp_path, again):
    t = make_tenant(gw)
    old = upload(gw, tmp_path, t, "x", GOOD)
    delete_row(gw, t, "x")
    new = upload(gw, tmp_path, t, "x", again)  # before the old version's files are dropped
    gw._forget(t, "x", old.digest)  # its running requests have ended
    d = gw.path(new)
    assert {n: (d / n).read_bytes() for n in again} == again
    assert [p.name for p in (gw.store.root / "objects").iterdir()] == [new.digest]


def test_losing_the_race_for_a_name_leaves_no_files(gw, tmp_path, monkeypatch):
    t = make_tenant(gw)
    upload(gw, tmp_path, t, "x", GOOD)
    before = files_under(gw.store.root)
    monkeypatch.setattr(gw, "_check_room", lambda *args: None)  # both passed it at once
    for files in (OTHER, GOOD):
        with pytest.raises(APIError) as e:
            upload(gw, tmp_path, t, "x", files)
        assert e.value.status_code == 409
        assert files_under(gw.store.root) == before
