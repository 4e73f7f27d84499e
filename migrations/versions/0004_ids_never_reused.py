"""tenant and API key ids never reused (SQLite AUTOINCREMENT)

Without AUTOINCREMENT, SQLite gives a new row the largest id in the table plus one, so the id of the
tenant deleted last went to the next tenant created, which inherited what is keyed by it and outlives
the row: usage records and daily totals (its token budget), rate-limit windows, prefix cache entries.
PostgreSQL's sequences never reuse an id, so this changes SQLite only: both tables are rebuilt with
AUTOINCREMENT (env.py turns foreign keys off while a parent is rebuilt), and the sequence starts past
every id the usage tables still name, so a tenant or key deleted before this migration whose usage stays
is not reissued either (an id that nothing names any more may be, once: nothing is left to inherit).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-07 18:00:00.000000

"""

from collections.abc import Sequence

from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# table -> the largest id used so far, in it or in the usage tables that name its ids
USED_IDS = {
    "tenants": "SELECT max(coalesce((SELECT max(id) FROM tenants), 0),"
               " coalesce((SELECT max(tenant_id) FROM usage_records), 0),"
               " coalesce((SELECT max(tenant_id) FROM usage_daily), 0))",
    "api_keys": "SELECT max(coalesce((SELECT max(id) FROM api_keys), 0),"
                " coalesce((SELECT max(api_key_id) FROM usage_records), 0))",
}


def _sqlite_online() -> bool:
    """True on a live SQLite connection; raises for SQLite SQL scripts (offline mode), since the rebuild
    reflects the tables and reads their largest ids."""
    if op.get_context().dialect.name != "sqlite":
        return False
    if op.get_context().as_sql:
        raise RuntimeError("migration 0004 rebuilds tables on SQLite and needs a live database: run it online "
                           "(`loraplex serve` does, on every start), not as an SQL script")
    return True


def upgrade() -> None:
    if not _sqlite_online():
        return
    bind = op.get_bind()
    for table, used in USED_IDS.items():
        with op.batch_alter_table(table, recreate="always", table_kwargs={"sqlite_autoincrement": True}):
            pass
        last = bind.exec_driver_sql(used).scalar() or 0
        bind.exec_driver_sql("DELETE FROM sqlite_sequence WHERE name = ?", (table,))
        bind.exec_driver_sql("INSERT INTO sqlite_sequence (name, seq) VALUES (?, ?)", (table, last))


def downgrade() -> None:
    if not _sqlite_online():
        return
    for table in USED_IDS:
        with op.batch_alter_table(table, recreate="always"):
            pass
