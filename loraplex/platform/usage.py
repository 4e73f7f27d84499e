"""Usage accounting off the request path: `record()` only enqueues; a writer thread stores batches of
records and their daily roll-ups in one transaction, retrying until the database takes them.

`close()` drains the queue, so a response that was sent is never left unaccounted at shutdown.
"""

from __future__ import annotations

import datetime as dt
import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from loraplex.platform.models import Adapter, UsageDaily, UsageRecord, utcnow

logger = logging.getLogger(__name__)


@dataclass
class Usage:
    request_id: str
    tenant_id: int
    api_key_id: int | None
    adapter: str | None  # the tenant's name for it
    endpoint: str
    status: str  # ok, aborted, error
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    created_at: dt.datetime = field(default_factory=utcnow)


class UsageWriter:
    def __init__(self, sessions: sessionmaker[Session], max_batch: int = 500, retry_s: float = 0.5):
        self.sessions = sessions
        self.max_batch = max_batch
        self.retry_s = retry_s
        self._queue: queue.Queue[Usage | None] = queue.Queue()
        self._num_pending = 0
        self._stored = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="loraplex-usage", daemon=True)
        self._thread.start()

    def record(self, usage: Usage) -> None:
        with self._stored:
            self._num_pending += 1
        self._queue.put(usage)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything recorded so far is stored (tests, shutdown)."""
        with self._stored:
            return self._stored.wait_for(lambda: self._num_pending == 0, timeout)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        stop = False
        while not stop:
            batch = []
            item = self._queue.get()
            while True:
                if item is None:
                    stop = True
                else:
                    batch.append(item)
                if stop or len(batch) >= self.max_batch:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            while batch:
                try:
                    self._write(batch)
                except Exception:  # database busy or down: keep the batch, try again
                    logger.exception("could not store %d usage records; retrying", len(batch))
                    time.sleep(self.retry_s)
                    continue
                with self._stored:
                    self._num_pending -= len(batch)
                    self._stored.notify_all()
                batch = []

    def _write(self, batch: list[Usage]) -> None:
        rollup: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        last_used: dict[tuple[int, str], dt.datetime] = {}
        for u in batch:
            row = rollup[(u.tenant_id, u.adapter or "", u.created_at.date())]
            row[0] += 1
            row[1] += u.status != "ok"
            row[2] += u.num_prompt_tokens
            row[3] += u.num_completion_tokens
            if u.adapter:
                last_used[(u.tenant_id, u.adapter)] = max(u.created_at, last_used.get((u.tenant_id, u.adapter),
                                                                                       u.created_at))
        with self.sessions.begin() as s:
            s.add_all(UsageRecord(**asdict(u)) for u in batch)
            for (tenant_id, adapter, day), (n, failed, prompt, completion) in rollup.items():
                _add_daily(s, tenant_id, adapter, day, n, failed, prompt, completion)
            for (tenant_id, name), when in last_used.items():
                s.execute(update(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name)
                          .values(last_used_at=when))


def _add_daily(s: Session, tenant_id: int, adapter: str, day: dt.date, n: int, failed: int, prompt: int,
               completion: int) -> None:
    """Add to one roll-up row (upsert on SQLite and PostgreSQL, read-modify-write elsewhere)."""
    values = dict(tenant_id=tenant_id, adapter=adapter, day=day, num_requests=n, num_failed=failed,
                  num_prompt_tokens=prompt, num_completion_tokens=completion)
    dialect = s.get_bind().dialect.name
    if dialect in ("sqlite", "postgresql"):
        if dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert
        else:
            from sqlalchemy.dialects.postgresql import insert
        stmt = insert(UsageDaily).values(**values)
        cols = ("num_requests", "num_failed", "num_prompt_tokens", "num_completion_tokens")
        s.execute(stmt.on_conflict_do_update(
            index_elements=["tenant_id", "adapter", "day"],
            set_={c: getattr(UsageDaily, c) + getattr(stmt.excluded, c) for c in cols}))
        return
    row = s.get(UsageDaily, (tenant_id, adapter, day), with_for_update=True)
    if row is None:
        s.add(UsageDaily(**values))
    else:
        row.num_requests += n
        row.num_failed += failed
        row.num_prompt_tokens += prompt
        row.num_completion_tokens += completion


def tokens_since(sessions: sessionmaker[Session], tenant_id: int, start: dt.date) -> int:
    """Prompt + completion tokens of a tenant from `start` (a day) on, from the roll-ups."""
    with sessions() as s:
        total = s.scalar(select(func.coalesce(func.sum(UsageDaily.num_prompt_tokens + UsageDaily.num_completion_tokens), 0))
                         .where(UsageDaily.tenant_id == tenant_id, UsageDaily.day >= start))
    return int(total or 0)
