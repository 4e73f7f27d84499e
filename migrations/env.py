"""Alembic environment: the gateway's models are the target; the URL comes from alembic.ini, or
else from the gateway settings (LORAPLEX_DATABASE_URL, default SQLite under LORAPLEX_HOME)."""

from logging.config import fileConfig

from alembic import context
from sqlalchemy import event

from loraplex.platform.db import make_engine
from loraplex.platform.models import Base

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name)

target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from loraplex.platform.config import Settings

    return Settings().sqlalchemy_url


def run_migrations_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _sqlite_one_transaction(engine) -> None:
    """SQLite: every pending migration in one `BEGIN IMMEDIATE` transaction, its DDL included.

    Python's sqlite3 opens a transaction only before INSERT/UPDATE/DELETE, so a batch's first CREATE TABLE
    committed on its own, and a failed migration left its `_alembic_tmp_*` table behind for every later
    start to trip on. With the driver's own transactions off and an explicit BEGIN IMMEDIATE (SQLAlchemy's
    recipe for pysqlite), a failure rolls back whole, and a second gateway starting on the same file waits
    for the write lock before it reads the schema's version, then finds it current."""

    @event.listens_for(engine, "connect")
    def _no_driver_transactions(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin_immediate(conn) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _foreign_key_problems(connection) -> list:
    return connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()


def run_migrations_online() -> None:
    engine = make_engine(_url())
    sqlite = engine.dialect.name == "sqlite"
    if sqlite:
        _sqlite_one_transaction(engine)
    try:
        with engine.connect() as connection:
            if sqlite:
                # SQLite alters a table by copying it and dropping the old one; with foreign keys enforced,
                # dropping a parent (tenants) deletes its children by their ON DELETE CASCADE. SQLite's
                # procedure for such changes turns them off first, outside a transaction (on the driver's
                # connection: through SQLAlchemy's it would begin one), and checks them before the commit.
                connection.connection.dbapi_connection.execute("PRAGMA foreign_keys=OFF")
            # render_as_batch: SQLite alters tables by copying them; the same scripts run on PostgreSQL.
            context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True,
                              transactional_ddl=True if sqlite else None)
            with context.begin_transaction():
                before = len(_foreign_key_problems(connection)) if sqlite else 0
                context.run_migrations()
                if sqlite and len(after := _foreign_key_problems(connection)) > before:  # rolls back
                    raise RuntimeError(f"a migration left rows whose foreign keys point nowhere: {after[:5]}")
    finally:
        engine.dispose()  # the connection never goes back to the application with foreign keys off


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
