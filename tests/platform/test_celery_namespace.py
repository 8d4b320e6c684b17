"""LORAPLEX_REDIS_PREFIX namespaces the task queues too: two deployments sharing a Redis database never
consume each other's tasks (a worker validating another deployment's adapter against its own database)."""

from __future__ import annotations

import os
import uuid

import pytest
from platform_helpers import make_settings

REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def test_every_broker_key_carries_the_deployments_prefix(tmp_path):
    import redis

    from loraplex.platform.tasks.celery_app import configure

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except Exception:
        pytest.skip("no Redis on this machine")
    prefixes = [f"lpxns{uuid.uuid4().hex[:8]}" for _ in range(2)]
    try:
        for prefix in prefixes:
            app = configure(make_settings(tmp_path, redis_url=REDIS_URL, redis_prefix=prefix,
                                          celery_task_always_eager=False))
            app.send_task("loraplex.rollup_usage")
            app.send_task("loraplex.prefetch_adapter", args=["0" * 64])
        for prefix in prefixes:
            keys = {k.decode() for k in client.scan_iter(f"{prefix}:*")}
            assert {f"{prefix}:loraplex", f"{prefix}:engine", f"{prefix}:_kombu.binding.loraplex"} <= keys
            assert client.llen(f"{prefix}:loraplex") == 1 and client.llen(f"{prefix}:engine") == 1
    finally:
        for prefix in prefixes:
            for key in client.scan_iter(f"{prefix}:*"):
                client.delete(key)
        configure(make_settings(tmp_path))  # back to the in-memory broker for the tests after this one
        client.close()
