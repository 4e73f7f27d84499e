"""API keys, and settings that refuse placeholder secrets or contradictory defaults."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from loraplex.platform import security
from loraplex.platform.config import Settings


def test_keys():
    key = security.new_key()
    assert key.startswith("lpx-") and len(key) == 47 and security.is_well_formed_key(key)
    assert security.new_key() != key
    digest = security.hash_key(key)
    assert len(digest) == 64 and key not in digest
    assert security.matches(key, digest) and not security.matches(key + "x", digest)
    assert security.key_prefix(key) == key[:12]


@pytest.mark.parametrize("bad", ["changethis", "lpx-short", "secret", "x" * 60])
def test_placeholder_admin_keys_are_refused_outside_development(bad, tmp_path):
    with pytest.raises(ValidationError, match="LORAPLEX_ADMIN_KEY"):
        Settings(home=tmp_path, admin_key=bad)
    assert Settings(home=tmp_path, admin_key=bad, environment="development").admin_key.get_secret_value() == bad


def test_settings_from_environment(monkeypatch, tmp_path):
    key = security.new_key()
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path))
    monkeypatch.setenv("LORAPLEX_PORT", "9001")
    monkeypatch.setenv("LORAPLEX_ADMIN_KEY", key)
    monkeypatch.setenv("LORAPLEX_REDIS_URL", "redis://localhost:1/0")
    monkeypatch.setenv("LORAPLEX_QUOTA_FAIL_MODE", "closed")
    s = Settings()
    assert (s.port, s.redis_url, s.quota_fail_mode) == (9001, "redis://localhost:1/0", "closed")
    assert s.sqlalchemy_url == f"sqlite:///{tmp_path / 'loraplex.db'}" and s.adapters_dir == tmp_path / "adapters"
    assert s.admin_key.get_secret_value() == key and key not in repr(s)
    assert (s.host, s.model_id) == ("127.0.0.1", "smollm2-135m-instruct")


def test_a_default_priority_more_urgent_than_the_default_floor_is_refused(monkeypatch):
    from loraplex.platform.config import QuotaDefaults

    monkeypatch.setenv("LORAPLEX_DEFAULT_MIN_PRIORITY", "2")
    with pytest.raises(ValidationError, match=r"LORAPLEX_DEFAULT_PRIORITY \(0\) is more urgent"):
        QuotaDefaults()
    monkeypatch.setenv("LORAPLEX_DEFAULT_PRIORITY", "2")
    assert (QuotaDefaults().priority, QuotaDefaults().min_priority) == (2, 2)
