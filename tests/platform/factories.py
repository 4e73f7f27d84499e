"""Small factories for gateway tests: tenants with keys, PEFT adapters on the real model, archives."""

from __future__ import annotations

import io
import tarfile
import uuid
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import httpx

BASE_MODEL = "smollm2-135m-instruct"
UNLIMITED = dict(rpm=None, tpm=None, max_concurrent_requests=None, token_budget=None, max_adapters=None,
                 max_adapter_bytes=None)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass
class TenantClient:
    id: int
    name: str
    key: str
    client: httpx.Client

    def chat(self, model: str = BASE_MODEL, content: str = "Say hi", **body) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                "temperature": 0, **body}
        return self.client.post("/v1/chat/completions", json=body)

    def upload(self, name: str, directory: Path) -> httpx.Response:
        files = [("file", (n, (directory / n).read_bytes())) for n in ADAPTER_FILES]
        return self.client.post("/v1/adapters", data={"name": name}, files=files)


def client(base_url: str, key: str | None = None, timeout: float = 120.0) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=base_url, headers=headers, timeout=timeout)


def make_tenant(admin: httpx.Client, base_url: str, **quota) -> TenantClient:
    """A new tenant (unlimited unless quota fields are given) and a key for it."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    r = admin.post("/admin/tenants", json={"name": name, "quota": {**UNLIMITED, **quota}})
    assert r.status_code == 201, r.text
    tenant_id = r.json()["id"]
    r = admin.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "test"})
    assert r.status_code == 201, r.text
    key = r.json()["key"]
    return TenantClient(tenant_id, name, key, client(base_url, key))


def make_peft_adapters(model_path: Path, out: Path, seeds: list[int], rank: int = 8) -> list[Path]:
    """Real PEFT adapters (random A and B: init_lora_weights=False) on the real default model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    dirs = []
    for seed in seeds:
        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=8 * rank, target_modules=["q_proj", "v_proj", "o_proj"],
                            init_lora_weights=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model = get_peft_model(base, config)
            path = out / f"adapter-{seed}"
            peft_model.save_pretrained(path)
            base = peft_model.unload()
        dirs.append(path)
    return dirs


def zip_bytes(members: dict[str, bytes], symlinks: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        for name, target in (symlinks or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o120777 << 16)  # S_IFLNK
            zf.writestr(info, target)
    return buf.getvalue()


def tar_gz_bytes(members: dict[str, bytes], links: dict[str, tuple[bytes, str]] | None = None) -> bytes:
    """links: name -> (tarfile.SYMTYPE or LNKTYPE, target)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, (kind, target) in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = target
            tf.addfile(info)
    return buf.getvalue()


def adapter_members(directory: Path, prefix: str = "") -> dict[str, bytes]:
    return {prefix + n: (directory / n).read_bytes() for n in ADAPTER_FILES}
