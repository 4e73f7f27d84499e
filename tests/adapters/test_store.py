"""AdapterStore: content-addressed, shared between owners, atomic, and safe for several writers."""

from __future__ import annotations

import threading

import pytest

from loraplex.adapters.store import AdapterStore, content_digest

CONFIG = b'{"r": 8}'
# content_digest of CONFIG and b"tensors": gateway databases hold digests of this format (see content_digest)
DIGEST = "6bd68cdb7ee5c2a6701be57939c492d9c6464b42190c33d5fae5a6003d172923"


@pytest.fixture
def tensors(tmp_path):
    path = tmp_path / "adapter_model.safetensors"
    path.write_bytes(b"tensors")
    return path


def files_under(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != ".lock"}


def test_digest_format_is_the_one_databases_hold(tensors):
    assert content_digest(CONFIG, tensors) == DIGEST
    assert content_digest(CONFIG + b" ", tensors) != DIGEST


def test_same_bytes_are_stored_once_and_removed_with_the_last_name(tmp_path, tensors):
    store = AdapterStore(tmp_path / "store")
    assert store.put("1", "a", CONFIG, tensors) == DIGEST
    assert store.put("2", "b", CONFIG, tensors) == DIGEST
    assert store.put("2", "c", CONFIG, tensors) == DIGEST
    assert [p.name for p in (store.root / "objects").iterdir()] == [DIGEST]
    assert store.list("2") == ["b", "c"] and store.num_bytes("1", "a") == len(b"tensors")
    with pytest.raises(FileExistsError):
        store.put("1", "a", CONFIG, tensors)
    store.remove("1", "a")
    assert (store.path("2", "b") / "adapter_model.safetensors").read_bytes() == b"tensors"
    store.remove("2", "b")
    assert store.path("2", "c").is_dir()
    store.remove("2", "c")
    assert files_under(store.root) == set()
    with pytest.raises(KeyError):
        store.path("2", "c")


def test_a_failed_put_leaves_nothing(tmp_path, tensors):
    store = AdapterStore(tmp_path / "store")
    with pytest.raises(FileNotFoundError):
        store.put("1", "a", CONFIG, tmp_path / "missing.safetensors")
    with pytest.raises(ValueError):
        store.put("1", "../a", CONFIG, tensors)
    assert files_under(store.root) == set() and store.list("1") == []


def test_concurrent_puts_of_the_same_bytes(tmp_path, tensors):
    """Writers racing (threads here; other processes take the same lock file) store one object."""
    store = AdapterStore(tmp_path / "store")
    others = [AdapterStore(store.root) for _ in range(8)]  # as another process would open it
    threads = [threading.Thread(target=s.put, args=(str(i), "a", CONFIG, tensors)) for i, s in enumerate(others)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert files_under(store.root) == {f"objects/{DIGEST}/adapter_config.json",
                                       f"objects/{DIGEST}/adapter_model.safetensors",
                                       *(f"owners/{i}/a.json" for i in range(8))}
