"""Content-addressed adapter store on disk.

    root/objects/<digest>/adapter_config.json        digest = sha256 over both files (see `content_digest`)
    root/objects/<digest>/adapter_model.safetensors
    root/owners/<owner>/<name>.json                  {"digest": ..., "num_bytes": ...}

The same bytes put twice (by one owner or several) are stored once; removing a name deletes its object
only when no other name refers to it. Every file is written to a temporary path, fsynced and renamed,
so a crash never leaves a half-written adapter where a reader can see it. Several processes may share
one root (gateway processes do): the decisions (does the name or object exist, is the object still
referred to) are taken under a lock on `root/.lock`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loraplex.adapters.peft import CONFIG_NAME, SAFETENSORS_NAME

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def content_digest(config_bytes: bytes, tensors_path: Path) -> str:
    """sha256, hex, of `name \\0 size \\0 bytes` for each file in name order (config, then tensors).

    The gateway's databases hold digests in this format (it stored uploads under them before this
    store existed), so it must not change without migrating them."""
    h = hashlib.sha256()
    h.update(f"{CONFIG_NAME}\0{len(config_bytes)}\0".encode())
    h.update(config_bytes)
    with open(tensors_path, "rb") as f:
        h.update(f"{SAFETENSORS_NAME}\0{os.fstat(f.fileno()).st_size}\0".encode())
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AdapterStore:
    """Adapters on disk by owner and name, deduplicated by content. Thread- and process-safe."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        (self.root / "objects").mkdir(parents=True, exist_ok=True)
        (self.root / "owners").mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    @staticmethod
    def check_name(name: str, what: str = "name") -> None:
        """ValueError unless `name` is 1-128 of [A-Za-z0-9._-], starting with a letter or digit."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"invalid adapter {what} {name!r}: use 1-128 letters, digits, '.', '_' or '-'")

    def put(self, owner: str, name: str, config_bytes: bytes, tensors_path: str | os.PathLike,
            digest: str | None = None) -> str:
        """Store an adapter (already validated) under owner/name; returns its digest.

        digest: `content_digest` of exactly these bytes when the caller has computed it already (the
        gateway names entries by it), so a large upload is hashed once, not twice.
        Raises FileExistsError if owner/name exists, ValueError for a bad owner or name.
        """
        tensors_path = Path(tensors_path)
        manifest = self._manifest_path(owner, name)
        if manifest.exists():  # checked again under the lock; this spares hashing and copying
            raise FileExistsError(f"adapter {name!r} already exists")
        digest = digest or content_digest(config_bytes, tensors_path)
        obj = self.root / "objects" / digest
        tmp = None if obj.exists() else self._write_object(config_bytes, tensors_path)  # outside the lock
        try:
            with self._locked():
                if manifest.exists():
                    raise FileExistsError(f"adapter {name!r} already exists")
                if not obj.exists():
                    if tmp is None:  # removed since we looked
                        tmp = self._write_object(config_bytes, tensors_path)
                    os.replace(tmp, obj)
                    tmp = None
                    _fsync_dir(obj.parent)
                manifest.parent.mkdir(parents=True, exist_ok=True)
                record = {"digest": digest, "num_bytes": (obj / SAFETENSORS_NAME).stat().st_size}
                _write_atomic(manifest, json.dumps(record).encode())
        finally:
            if tmp is not None:  # another put stored the same bytes first, or this one failed
                shutil.rmtree(tmp, ignore_errors=True)
        return digest

    def path(self, owner: str, name: str) -> Path:
        """Directory holding owner/name's two files (a PEFT directory). KeyError if unknown."""
        return self.root / "objects" / self._record(owner, name)["digest"]

    def num_bytes(self, owner: str, name: str) -> int:
        """Size of owner/name's tensors file in bytes. KeyError if unknown."""
        return self._record(owner, name)["num_bytes"]

    def list(self, owner: str) -> list[str]:
        """Names stored for `owner`, sorted."""
        self.check_name(owner, "owner")
        d = self.root / "owners" / owner
        return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []

    def remove(self, owner: str, name: str) -> None:
        """Forget owner/name; delete its object unless another name shares the bytes. KeyError if unknown."""
        with self._locked():
            digest = self._record(owner, name)["digest"]
            self._manifest_path(owner, name).unlink()
            still_used = any(json.loads(p.read_text())["digest"] == digest
                             for p in (self.root / "owners").glob("*/*.json"))
            if not still_used:
                shutil.rmtree(self.root / "objects" / digest, ignore_errors=True)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock, open(self.root / ".lock", "ab") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when f closes
            yield

    def _write_object(self, config_bytes: bytes, tensors_path: Path) -> Path:
        """A complete, fsynced object directory at a temporary path under objects/."""
        tmp = Path(tempfile.mkdtemp(dir=self.root / "objects", prefix=".tmp-"))
        try:
            _write_atomic(tmp / CONFIG_NAME, config_bytes)
            shutil.copyfile(tensors_path, tmp / SAFETENSORS_NAME)
            with open(tmp / SAFETENSORS_NAME, "rb") as f:
                os.fsync(f.fileno())
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp

    def _manifest_path(self, owner: str, name: str) -> Path:
        self.check_name(owner, "owner")
        self.check_name(name)
        return self.root / "owners" / owner / f"{name}.json"

    def _record(self, owner: str, name: str) -> dict:
        try:
            return json.loads(self._manifest_path(owner, name).read_text())
        except FileNotFoundError:
            raise KeyError(f"adapter {name!r} not found") from None
