"""Receiving an adapter upload: the files of a multipart form, or one .zip / .tar.gz, written into a
directory with a size limit, refusing anything but the two adapter files (no paths outside the
directory, no links, no pickles). What is unpacked is validated and stored by `tenant_adapters`.
"""

from __future__ import annotations

import re
import stat
import tarfile
import zipfile
from pathlib import Path
from typing import BinaryIO

from loraplex.adapters.peft import CONFIG_NAME, PICKLE_NAME, SAFETENSORS_NAME

ADAPTER_FILES = (CONFIG_NAME, SAFETENSORS_NAME)
ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz")
CHUNK = 1 << 20


class UploadError(ValueError):
    """A refused upload; the message says why. `param` names the form field."""

    def __init__(self, message: str, param: str = "file"):
        super().__init__(message)
        self.param = param


class UploadTooLarge(UploadError):
    pass


def copy_limited(src: BinaryIO, dest: Path, budget: int) -> int:
    """Copy src to a new file dest, refusing past `budget` bytes; returns the bytes written."""
    written = 0
    with open(dest, "xb") as out:
        for chunk in iter(lambda: src.read(CHUNK), b""):
            written += len(chunk)
            if written > budget:
                raise UploadTooLarge(f"the adapter files exceed the upload limit of {budget} bytes")
            out.write(chunk)
    return written


def is_archive(filename: str) -> bool:
    return filename.lower().endswith(ARCHIVE_SUFFIXES)


def unpack_upload(files: dict[str, BinaryIO], dest: Path, max_bytes: int) -> None:
    """Write an upload (its files by file name) into dest: one archive, or the two adapter files."""
    if len(files) == 1 and is_archive(next(iter(files))):
        filename, f = next(iter(files.items()))
        unpack_archive(f, filename, dest, max_bytes)
    else:
        unpack_files(files, dest, max_bytes)


def unpack_files(files: dict[str, BinaryIO], dest: Path, max_bytes: int) -> None:
    """Write uploaded files (by file name) into dest: exactly adapter_config.json and
    adapter_model.safetensors."""
    names = set(files)
    if names != set(ADAPTER_FILES):
        raise UploadError(_expected(names))
    budget = max_bytes
    for name, f in files.items():
        budget -= copy_limited(f, dest / name, budget)


def unpack_archive(f: BinaryIO, filename: str, dest: Path, max_bytes: int) -> None:
    """Extract a .zip or .tar.gz holding the two adapter files at its root into dest. Members with
    absolute paths, `..`, links, directories or any other name are refused before anything is written
    for them; the unpacked size counts against max_bytes."""
    head = f.read(4)
    f.seek(0)
    if head.startswith(b"PK"):
        _unpack_zip(f, dest, max_bytes)
    elif head.startswith(b"\x1f\x8b"):
        _unpack_tar(f, dest, max_bytes)
    else:
        raise UploadError(f"{filename!r} is neither a zip nor a gzipped tar archive")
    missing = [n for n in ADAPTER_FILES if not (dest / n).is_file()]
    if missing:
        raise UploadError(f"the archive lacks {', '.join(missing)} at its root")


def _member_name(name: str) -> str | None:
    """The adapter file a member names, None for the archive's root directory; UploadError otherwise."""
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        raise UploadError(f"archive member {name!r} has an absolute path")
    if ".." in re.split(r"[/\\]", name):
        raise UploadError(f"archive member {name!r} points outside the archive (..)")
    base = name.removeprefix("./")
    if base in ("", ".", "./"):
        return None
    if base == PICKLE_NAME:
        raise UploadError(f"archive member {name!r} is a pickle, which loraplex never loads; "
                          f"save with safe_serialization=True to get {SAFETENSORS_NAME}")
    if base not in ADAPTER_FILES:
        raise UploadError(f"archive member {name!r} is not allowed: the archive must hold exactly "
                          f"{' and '.join(ADAPTER_FILES)} at its root")
    return base


def _unpack_zip(f: BinaryIO, dest: Path, max_bytes: int) -> None:
    try:
        zf = zipfile.ZipFile(f)
    except zipfile.BadZipFile as e:
        raise UploadError(f"not a valid zip archive: {e}") from None
    budget = max_bytes
    with zf:
        for info in zf.infolist():
            base = _member_name(info.filename)
            if stat.S_ISLNK(info.external_attr >> 16):
                raise UploadError(f"archive member {info.filename!r} is a link")
            if base is None or info.is_dir():
                if base is None:
                    continue
                raise UploadError(f"archive member {info.filename!r} is a directory")
            if (dest / base).exists():
                raise UploadError(f"archive member {info.filename!r} appears twice")
            try:
                with zf.open(info) as src:
                    budget -= copy_limited(src, dest / base, budget)
            except (zipfile.BadZipFile, OSError, EOFError) as e:
                raise UploadError(f"archive member {info.filename!r} cannot be read: {e}") from None


def _unpack_tar(f: BinaryIO, dest: Path, max_bytes: int) -> None:
    budget = max_bytes
    try:
        with tarfile.open(fileobj=f, mode="r:gz") as tf:
            for member in tf:
                base = _member_name(member.name)
                if member.issym() or member.islnk():
                    raise UploadError(f"archive member {member.name!r} is a link")
                if base is None and member.isdir():
                    continue
                if not member.isfile():
                    raise UploadError(f"archive member {member.name!r} is not a regular file")
                if (dest / base).exists():
                    raise UploadError(f"archive member {member.name!r} appears twice")
                src = tf.extractfile(member)
                budget -= copy_limited(src, dest / base, budget)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise UploadError(f"not a valid .tar.gz archive: {e}") from None


def _expected(names: set[str]) -> str:
    got = ", ".join(sorted(names)) or "no files"
    return (f"upload {' and '.join(ADAPTER_FILES)} as two files, or one .zip/.tar.gz holding them at its "
            f"root (got {got})")
