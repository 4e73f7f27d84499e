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
