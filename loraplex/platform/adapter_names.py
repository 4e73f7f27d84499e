"""The names one tenant's adapter goes by below the API, in one place. A tenant names its adapter
(`name`, unique per tenant); its files' content digest (`AdapterStore.content_digest`, sha256) tells
versions apart:

    API (the `model` field)     pirate
    adapter store               owner "3", entry "pirate.1f2e3d4c5b6a7988"      (store_owner, store_name)
    engine                      "3:pirate:1f2e3d4c5b6a7988"                       (engine_name)

The engine name is unique across tenants and versions, so two tenants' adapters of one name never
share a registration, and an adapter deleted and uploaded again with new weights never reuses the old one.
"""

from __future__ import annotations

DIGEST_CHARS = 16  # hex characters of the digest in a name: 64 bits, no collision among one tenant's versions


def store_owner(tenant_id: int) -> str:
    return str(tenant_id)


def store_name(name: str, digest: str) -> str:
    return f"{name}.{digest[:DIGEST_CHARS]}"


def engine_name(tenant_id: int, name: str, digest: str) -> str:
    return f"{tenant_id}:{name}:{digest[:DIGEST_CHARS]}"
