"""Start-up migrations of the adapter store's files (the schema's are Alembic's, `migrations/`): layouts
older gateways wrote, moved into today's on every start, before anything reads them. Idempotent.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil

from sqlalchemy.orm import Session, sessionmaker

from loraplex.adapters.peft import CONFIG_NAME, SAFETENSORS_NAME
from loraplex.adapters.store import AdapterStore
from loraplex.platform import crud
from loraplex.platform.adapter_names import store_name, store_owner

logger = logging.getLogger(__name__)

LEGACY_DIR_RE = re.compile(r"[0-9a-f]{64}")


def adopt_legacy_files(store: AdapterStore, sessions: sessionmaker[Session]) -> None:
    """Gateways before the AdapterStore kept each upload at `<store root>/<digest>/`, with digests in the
    store's format: put them under their rows' store names and drop the old directories. Idempotent."""
    for old in sorted(store.root.iterdir()):
        if not (LEGACY_DIR_RE.fullmatch(old.name) and old.is_dir()):
            continue
        with sessions() as s:
            rows = crud.adapters_with_digest(s, old.name)
        try:
            config = (old / CONFIG_NAME).read_bytes()
            for row in rows:
                with contextlib.suppress(FileExistsError):
                    store.put(store_owner(row.tenant_id), store_name(row.name, row.digest), config,
                              old / SAFETENSORS_NAME)
        except FileNotFoundError:  # another process starting at the same time moved it
            continue
        shutil.rmtree(old, ignore_errors=True)
        logger.info("moved the adapter files %s into the store (%d adapters)", old.name, len(rows))
