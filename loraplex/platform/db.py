"""Database engine, sessions and migrations. Alembic (`migrations/` at the repository root) is the only
way the schema is created or changed: `upgrade()` runs on every start and is a no-op when current."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

REPO_ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS_DIR = REPO_ROOT / "migrations"


POOL_TIMEOUT_S = 10.0  # past this a request gets 503 database_unavailable (errors.py), never a 500


def default_pool_size() -> int:
    """Connections that can be in use at once: one per thread that opens a session, i.e. FastAPI's worker
    threads for sync dependencies and routes (anyio's default limiter, 40), asyncio's default executor
    (`asyncio.to_thread`: min(32, cpus + 4)) and the usage writer. Every use is brief (deps.py), so this
    bounds the pool by the gateway's threads, not by the number of requests in flight."""
    return 40 + min(32, (os.cpu_count() or 1) + 4) + 1


def make_engine(url: str, pool_size: int | None = None) -> Engine:
    """An engine for `url` with a pool of `pool_size` connections (default `default_pool_size`); SQLite gets
    WAL (readers do not block the writer, several gateway processes can share the file), a busy timeout
    and enforced foreign keys."""
    size = pool_size or default_pool_size()
    pool = dict(pool_size=min(10, size), max_overflow=max(0, size - 10), pool_timeout=POOL_TIMEOUT_S)
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True, **pool)
    if url == "sqlite:///:memory:":
        pool = {}
    elif url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **pool)

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_conn, _record) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    return engine


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str):
    from alembic.config import Config

    cfg = Config(str(REPO_ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["configure_logger"] = False
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the schema at `url` to `revision` (idempotent)."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)
