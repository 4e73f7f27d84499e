"""Alembic is the only way the schema changes: migrations build exactly the models' schema."""

from __future__ import annotations

import pytest
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


def test_a_failed_migration_rolls_back_whole_and_the_next_start_completes_it(tmp_path):
    """SQLite runs every pending migration in one transaction, DDL included: when 0004's second rebuild
    fails (here a table in its way), the first one is rolled back too, no `_alembic_tmp_*` table is left,
    the version stays 0003, and once the obstacle is gone the next start migrates."""
    url = f"sqlite:///{tmp_path / 'm.db'}"
    db.upgrade(url, "0003")
    engine = db.make_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO tenants (id, name, created_at) VALUES (1, 'a', '2026-12-07 00:00:00')")
        conn.exec_driver_sql("CREATE TABLE _alembic_tmp_api_keys (x INTEGER)")  # in the second rebuild's way
    with pytest.raises(Exception, match="_alembic_tmp_api_keys"):
        db.upgrade(url)
    with engine.begin() as conn:
        assert conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar() == "0003"
        tables = {r[0] for r in conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert "_alembic_tmp_tenants" not in tables
        assert "AUTOINCREMENT" not in conn.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE name = 'tenants'").scalar()  # the first rebuild undone
        assert _ids(conn, "tenants") == [1]
        conn.exec_driver_sql("DROP TABLE _alembic_tmp_api_keys")
    db.upgrade(url)
    with engine.begin() as conn:
        assert conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar() == "0004"
        assert _ids(conn, "tenants") == [1]
    engine.dispose()


def test_rows_orphaned_before_do_not_stop_a_start(tmp_path):
    """The foreign-key check after the migrations counts only what they broke: a row orphaned outside the
    gateway (the sqlite3 shell enforces no foreign keys) neither stops 0004 nor a later start."""
    url = f"sqlite:///{tmp_path / 'm.db'}"
    db.upgrade(url, "0003")
    engine = db.make_engine(url)
    with engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        raw.execute("PRAGMA foreign_keys=OFF")
        raw.execute("INSERT INTO quotas (tenant_id, budget_period) VALUES (42, 'month')")  # no tenant 42
        raw.commit()
    db.upgrade(url)
    db.upgrade(url)
    with engine.begin() as conn:
        assert conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar() == "0004"
        assert len(conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()) == 1
    engine.dispose()
