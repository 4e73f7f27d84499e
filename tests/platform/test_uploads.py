"""Receiving uploads: unpacking files and archives safely (no HTTP, no model)."""

from __future__ import annotations

import io
import tarfile

import pytest

from loraplex.platform.uploads import UploadError, UploadTooLarge, unpack_archive, unpack_files, unpack_upload
from tests.platform.factories import tar_gz_bytes, zip_bytes

GOOD = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"tensors"}


@pytest.fixture
def dest(tmp_path):
    d = tmp_path / "dest"
    d.mkdir()
    return d


@pytest.mark.parametrize("pack", [zip_bytes, tar_gz_bytes])
@pytest.mark.parametrize("prefix", ["", "./"])
def test_good_archives_unpack(dest, pack, prefix):
    data = pack({prefix + k: v for k, v in GOOD.items()})
    unpack_archive(io.BytesIO(data), "a.zip", dest, 1 << 20)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == GOOD


@pytest.mark.parametrize("pack", [zip_bytes, tar_gz_bytes])
@pytest.mark.parametrize("name, why", [
    ("/etc/adapter_config.json", "absolute"), ("../adapter_config.json", ".."), ("a/../../x", ".."),
    ("C:/adapter_config.json", "absolute"), ("sub/adapter_config.json", "not allowed"),
    ("README.md", "not allowed"), ("adapter_model.bin", "pickle"),
])
def test_bad_member_names_are_refused(dest, pack, name, why):
    data = pack({**GOOD, name: b"x"})
    with pytest.raises(UploadError, match=why):
        unpack_archive(io.BytesIO(data), "a.tar.gz", dest, 1 << 20)


@pytest.mark.parametrize("data", [
    zip_bytes({"adapter_config.json": b"{}"}, symlinks={"adapter_model.safetensors": "/etc/passwd"}),
    tar_gz_bytes({"adapter_config.json": b"{}"}, links={"adapter_model.safetensors": (tarfile.SYMTYPE, "/etc/x")}),
    tar_gz_bytes({"adapter_config.json": b"{}"}, links={"adapter_model.safetensors": (tarfile.LNKTYPE, "/etc/x")}),
], ids=["zip-symlink", "tar-symlink", "tar-hardlink"])
def test_links_are_refused(dest, data):
    with pytest.raises(UploadError, match="link"):
        unpack_archive(io.BytesIO(data), "a.tgz", dest, 1 << 20)


def test_directories_duplicates_and_missing_files_are_refused(tmp_path):
    cases = [
        (tar_gz_bytes({**GOOD, "./adapter_config.json": b"{}"}), "twice"),
        (zip_bytes({"adapter_config.json": b"{}"}), "lacks adapter_model.safetensors"),
        (zip_bytes({**GOOD, "dir/": b""}), "not allowed"),
        (b"plain text, no archive", "neither a zip"),
        (b"PK\x03\x04garbage", "not a valid zip"),
        (b"\x1f\x8bgarbage", "not a valid .tar.gz"),
    ]
    for i, (data, why) in enumerate(cases):
        dest = tmp_path / str(i)
        dest.mkdir()
        with pytest.raises(UploadError, match=why):
            unpack_archive(io.BytesIO(data), "a.zip", dest, 1 << 20)


def test_unpacked_size_counts_against_the_limit(dest):
    bomb = zip_bytes({"adapter_config.json": b"{}", "adapter_model.safetensors": b"\0" * (1 << 20)})
    assert len(bomb) < 10_000
    with pytest.raises(UploadTooLarge):
        unpack_archive(io.BytesIO(bomb), "a.zip", dest, 100_000)


def test_plain_files_must_be_exactly_the_two(dest):
    with pytest.raises(UploadError, match="got adapter_config.json"):
        unpack_files({"adapter_config.json": io.BytesIO(b"{}")}, dest, 1 << 20)
    unpack_files({k: io.BytesIO(v) for k, v in GOOD.items()}, dest, 1 << 20)
    assert sorted(p.name for p in dest.iterdir()) == sorted(GOOD)


def test_one_archive_or_the_two_files(tmp_path):
    for i, files in enumerate([{"a.tar.gz": io.BytesIO(tar_gz_bytes(GOOD))},
                               {k: io.BytesIO(v) for k, v in GOOD.items()}]):
        dest = tmp_path / str(i)
        dest.mkdir()
        unpack_upload(files, dest, 1 << 20)
        assert {p.name: p.read_bytes() for p in dest.iterdir()} == GOOD
