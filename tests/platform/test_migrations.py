"""Alembic is the only way the schema changes: migrations build exactly the models' schema."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from loraplex.platform import db
from loraplex.platform.models import Base


def test_upgrade_matches_models_and_downgrade_removes_all(tmp_path):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    db.upgrade(url)
    db.upgrade(url)  # idempotent: every start runs it
    engine = db.make_engine(url)
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    assert set(inspect(engine).get_table_names()) == set(Base.metadata.tables) | {"alembic_version"}
    db.downgrade(url, "base")
    engine.dispose()
    engine = db.make_engine(url)
    assert set(inspect(engine).get_table_names()) == {"alembic_version"}


def _ids(conn, table: str) -> list[int]:
    return [row[0] for row in conn.exec_driver_sql(f"SELECT id FROM {table} ORDER BY id")]


def test_ids_of_deleted_tenants_and_keys_are_never_reused(tmp_path):
    """0004 on a database written at 0003: every row and its children survive the tables' rebuild (foreign
    keys cascade; env.py turns them off while it runs), new ids start past every id the tables and the
    usage rows still name (a tenant deleted before it, whose usage stays), and from then on no id is
    reused, the last one deleted included. (An id deleted before 0004 that nothing names any more may be
    issued once: nothing is left that a new row could inherit from it.)"""
    url = f"sqlite:///{tmp_path / 'm.db'}"
    db.upgrade(url, "0003")
    engine = db.make_engine(url)
    now = "2026-12-07 00:00:00"
    with engine.begin() as conn:
        for i, name in ((1, "a"), (2, "b"), (3, "gone"), (4, "last")):
            conn.exec_driver_sql("INSERT INTO tenants (id, name, created_at) VALUES (?, ?, ?)", (i, name, now))
            conn.exec_driver_sql("INSERT INTO quotas (tenant_id, budget_period) VALUES (?, 'month')", (i,))
            conn.exec_driver_sql("INSERT INTO api_keys (id, tenant_id, role, name, key_hash, prefix, created_at) "
                                 "VALUES (?, ?, 'tenant', '', ?, 'lpx-', ?)", (10 + i, i, f"{i:064x}", now))
        conn.exec_driver_sql("INSERT INTO usage_daily (tenant_id, adapter, day, num_requests, num_failed, "
                             "num_prompt_tokens, num_completion_tokens) VALUES (3, '', '2026-12-06', 1, 0, 5, 5)")
        conn.exec_driver_sql("DELETE FROM tenants WHERE id IN (3, 4)")  # cascades to their quota and key
        assert _ids(conn, "api_keys") == [11, 12]
    engine.dispose()

    db.upgrade(url)
    engine = db.make_engine(url)
    with engine.begin() as conn:
        assert _ids(conn, "tenants") == [1, 2]
        assert _ids(conn, "api_keys") == [11, 12]
        assert [r[0] for r in conn.exec_driver_sql("SELECT tenant_id FROM quotas ORDER BY 1")] == [1, 2]
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1  # enforced again
        conn.exec_driver_sql("INSERT INTO tenants (name, created_at) VALUES ('new', ?)", (now,))
        conn.exec_driver_sql("INSERT INTO api_keys (tenant_id, role, name, key_hash, prefix, created_at) "
                             "VALUES (1, 'tenant', '', ?, 'lpx-', ?)", ("f" * 64, now))
        assert _ids(conn, "tenants") == [1, 2, 4]  # not 3: its usage rows stay
        assert _ids(conn, "api_keys") == [11, 12, 13]
        conn.exec_driver_sql("DELETE FROM tenants WHERE name = 'new'")
        conn.exec_driver_sql("DELETE FROM api_keys WHERE id = 13")
        conn.exec_driver_sql("INSERT INTO tenants (name, created_at) VALUES ('newer', ?)", (now,))
        conn.exec_driver_sql("INSERT INTO api_keys (tenant_id, role, name, key_hash, prefix, created_at) "
                             "VALUES (1, 'tenant', '', ?, 'lpx-', ?)", ("e" * 64, now))
        assert _ids(conn, "tenants") == [1, 2, 5]  # not 4, deleted last
        assert _ids(conn, "api_keys") == [11, 12, 14]  # not 13, deleted last
    engine.dispose()
