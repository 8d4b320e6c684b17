"""The billing tasks as Celery runs them: the same rows on every run, statements once a month closes."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, timedelta

from sqlalchemy import select

from loraplex.platform.billing.models import Statement, UsageRollup
from loraplex.platform.billing.statements import is_closed
from loraplex.platform.db import session_scope
from loraplex.platform.models import UsageRecord
from loraplex.platform.tasks import celery_app
from loraplex.platform.tasks.context import TaskContext, get_context, set_context


def _rows(sessions, day: date):
    with sessions() as s:
        return sorted((r.tenant_id, r.api_key_id, r.adapter_name, r.adapter_version, r.requests, r.prompt_tokens,
                       r.completion_tokens) for r in s.scalars(select(UsageRollup).where(UsageRollup.day == day)))


def test_rollup_task_reruns_give_identical_rows(app, client, make_tenant):
    services = app.state.services
    a, b = make_tenant("acme"), make_tenant("globex")
    day = datetime.now(UTC).date() - timedelta(days=2)
    noon = datetime.combine(day, datetime.min.time(), tzinfo=UTC) + timedelta(hours=12)
    last_month_day = datetime.now(UTC).replace(day=1) - timedelta(days=5)
    with session_scope(services.sessions) as s:
        for tenant, adapter, prompt in ((a, "sql", 10), (a, None, 20), (a, "sql", 5), (b, None, 7)):
            s.add(UsageRecord(request_id=uuid.uuid4().hex, tenant_id=tenant.tenant_id, api_key_id=tenant.key_id,
                              model="m", adapter_name=adapter, adapter_version="f" * 64 if adapter else None,
                              endpoint="chat.completions", prompt_tokens=prompt, completion_tokens=1, ttft_ms=1,
                              latency_ms=3, status="ok", created_at=noon))
        s.add(UsageRecord(request_id=uuid.uuid4().hex, tenant_id=b.tenant_id, api_key_id=b.key_id, model="m",
                          endpoint="chat.completions", prompt_tokens=3, completion_tokens=1, latency_ms=3,
                          status="ok", created_at=last_month_day))
    previous = get_context()
    set_context(TaskContext(services.settings, services.sessions))
    try:
        first = celery_app.rollup_usage.apply(args=[day.isoformat()])
        rows = _rows(services.sessions, day)
        again = celery_app.rollup_usage.apply(args=[day.isoformat()])
        assert first.successful() and again.successful()
        assert _rows(services.sessions, day) == rows
        assert [(r[2], r[4], r[5]) for r in rows if r[0] == a.tenant_id] == [("", 1, 20), ("sql", 2, 15)]
        assert sum(r[4] for r in rows) == 4
        finalized = celery_app.finalize_statements.apply()
        assert finalized.successful()
        with services.sessions() as s:
            finals = {(st.tenant_id, st.period, st.prompt_tokens) for st in s.scalars(select(Statement))}
        last_month = last_month_day.strftime("%Y-%m")
        # globex used the service last month; acme only if `day` (two days ago) still fell in that month
        expected = {b.tenant_id: 3}
        if day.strftime("%Y-%m") == last_month:  # the first two days of a month
            expected = {a.tenant_id: 35, b.tenant_id: 3 + 7}
        assert finals == ({(t, last_month, n) for t, n in expected.items()} if is_closed(last_month) else set())
    finally:
        set_context(previous)
