"""The usage writer: records and daily roll-ups in one transaction, nothing lost at shutdown."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import func, select

from loraplex.platform import db
from loraplex.platform.models import UsageDaily, UsageRecord
from loraplex.platform.usage import Usage, UsageWriter, tokens_since


def test_records_and_rollups_survive_close(tmp_path):
    url = f"sqlite:///{tmp_path / 'u.db'}"
    db.upgrade(url)
    sessions = db.make_session_factory(db.make_engine(url))
    writer = UsageWriter(sessions, max_batch=7)
    day1 = dt.datetime(2026, 11, 1, 12)
    day2 = dt.datetime(2026, 11, 2, 12)
    for i in range(50):
        writer.record(Usage(request_id=f"r{i}", tenant_id=1 + i % 2, api_key_id=None, adapter="a" if i % 5 == 0 else None,
                            endpoint="chat.completions", status="ok" if i % 10 else "aborted", num_prompt_tokens=10,
                            num_completion_tokens=i, created_at=day1 if i < 30 else day2))
    writer.close()  # drains the queue
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(UsageRecord)) == 50
        rows = s.scalars(select(UsageDaily)).all()
        assert sum(r.num_requests for r in rows) == 50
        assert sum(r.num_failed for r in rows) == 5
        assert sum(r.num_completion_tokens for r in rows) == sum(range(50))
        t1 = {(r.adapter, r.day): r.num_requests for r in rows if r.tenant_id == 1}
    assert t1 == {("a", day1.date()): 3, ("", day1.date()): 12, ("a", day2.date()): 2, ("", day2.date()): 8}
    assert tokens_since(sessions, 1, day2.date()) == 10 * 10 + sum(range(30, 50, 2))
