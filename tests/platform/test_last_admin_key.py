"""The last active admin key is never revoked by accident, on SQLite and on PostgreSQL, also by two
revocations at once that would each leave the other's key as the last."""

from __future__ import annotations

import threading

import pytest
from platform_helpers import make_settings, migrated_sessions

from loraplex.platform.tenants import LastAdminKey, active_admin_keys, create_admin_key, revoke_admin_key


def _keys(factory, settings, count: int) -> list[int]:
    with factory() as session:
        ids = [create_admin_key(session, settings, name=f"k{i}")[0].id for i in range(count)]
        session.commit()
    return ids


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def test_the_last_active_key_is_refused_unless_allowed(kind, tmp_path):
    settings = make_settings(tmp_path)
    with migrated_sessions(kind, tmp_path, "lpx_last_admin") as factory:
        first, second = _keys(factory, settings, 2)
        with factory() as session:
            assert revoke_admin_key(session, first).revoked_at is not None
            with pytest.raises(LastAdminKey, match="last active admin key"):
                revoke_admin_key(session, second)
            assert active_admin_keys(session) == 1
            assert revoke_admin_key(session, first).revoked_at is not None  # already revoked: as it was
            assert revoke_admin_key(session, second, allow_last=True).revoked_at is not None
            assert active_admin_keys(session) == 0


@pytest.mark.integration
def test_two_revocations_at_once_leave_one_key_on_postgresql(tmp_path):
    settings = make_settings(tmp_path)
    with migrated_sessions("postgresql", tmp_path, "lpx_last_admin_race") as factory:
        first, second = _keys(factory, settings, 2)
        outcome: list[object] = []
        with factory() as holder:
            revoke_admin_key(holder, first)  # its transaction holds the active keys' locks

            def other() -> None:
                with factory() as session:
                    try:
                        revoke_admin_key(session, second)
                        session.commit()
                        outcome.append("revoked")
                    except LastAdminKey as exc:
                        outcome.append(exc)

            thread = threading.Thread(target=other)
            thread.start()
            thread.join(timeout=0.5)
            assert thread.is_alive()  # waiting for the first revocation's locks
            holder.commit()
        thread.join()
        assert len(outcome) == 1 and isinstance(outcome[0], LastAdminKey)
        with factory() as session:
            assert active_admin_keys(session) == 1
