"""Alembic environment: the gateway's models are the target; the URL comes from alembic.ini, or
else from the gateway settings (LORAPLEX_DATABASE_URL, default SQLite under LORAPLEX_HOME)."""

from logging.config import fileConfig

from alembic import context

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


def run_migrations_online() -> None:
    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            sqlite = connection.dialect.name == "sqlite"
            if sqlite:
                # SQLite alters a table by copying it and dropping the old one; with foreign keys enforced,
                # dropping a parent (tenants) deletes its children by their ON DELETE CASCADE. SQLite's
                # procedure for such changes turns them off first (outside a transaction, where the pragma
                # takes effect: nothing has run on this connection yet) and checks them after.
                connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
                connection.commit()  # ends the transaction SQLAlchemy began for it, so that Alembic's own commits
            # render_as_batch: SQLite alters tables by copying them; the same scripts run on PostgreSQL.
            context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
            with context.begin_transaction():
                context.run_migrations()
            if sqlite:
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                connection.exec_driver_sql("PRAGMA foreign_keys=ON")
                if broken:
                    raise RuntimeError(f"the migrations left rows whose foreign keys point nowhere: {broken[:5]}")
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
