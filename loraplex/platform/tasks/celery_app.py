"""The Celery app. Redis is the broker in production; the embedded default runs the same tasks in-process.

prefetch/remove go to the engine's own queue: only the process holding the engine can touch its memory.
"""

from __future__ import annotations

from celery import Celery
from sqlalchemy.exc import InterfaceError, OperationalError

from loraplex.config import Settings
from loraplex.platform.tasks import jobs
from loraplex.platform.tasks.context import get_context

app = Celery("loraplex", set_as_current=False)

_COMMON = dict(acks_late=True, reject_on_worker_lost=True)


def configure(settings: Settings) -> Celery:
    previous = (app.conf.broker_url, app.conf.task_default_queue, dict(app.conf.task_routes or {}),
                dict(app.conf.broker_transport_options or {}))
    app.conf.update(
        broker_url=settings.redis_url or "memory://",
        result_backend=None,
        task_ignore_result=True,
        task_always_eager=settings.tasks_eager,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=settings.task_queue,
        task_routes={
            "loraplex.prefetch_adapter": {"queue": settings.engine_queue},
            "loraplex.remove_adapter": {"queue": settings.engine_queue},
        },
        # every key the broker makes (queues, bindings, unacked messages) under the deployment's namespace,
        # like the quota and usage keys: two deployments sharing a Redis database never share queues
        # and the broker's connections bounded as the service's own Redis clients are (redis_clients): a
        # publish on a connection a Redis restart left half-open fails and reconnects rather than hanging
        broker_transport_options={"visibility_timeout": 3600, "global_keyprefix": f"{settings.redis_prefix}:",
                                  "socket_connect_timeout": settings.redis_connect_timeout,
                                  "socket_timeout": settings.redis_socket_timeout, "socket_keepalive": True},
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        beat_schedule=_warm_schedule(settings) | {
            "rollup-usage": {"task": "loraplex.rollup_usage", "schedule": 3600.0},
            "finalize-statements": {"task": "loraplex.finalize_statements", "schedule": 6 * 3600.0},
            "resume-stuck-validations": {"task": "loraplex.resume_stuck_validations", "schedule": 60.0},
            "sweep-adapter-store": {"task": "loraplex.sweep_adapter_store", "schedule": 300.0},
        },
    )
    if previous != (app.conf.broker_url, app.conf.task_default_queue, dict(app.conf.task_routes or {}),
                    dict(app.conf.broker_transport_options or {})):
        _forget_connections()
    return app


def _warm_schedule(settings: Settings) -> dict:
    """The "keep the busiest adapters warm" run, every warm_adapters_interval seconds; 0 turns it off, as in
    the embedded default (a schedule of 0 would have beat send it without pause)."""
    if settings.warm_adapters_interval <= 0:
        return {}
    return {"warm-busiest-adapters": {"task": "loraplex.warm_popular_adapters",
                                      "schedule": settings.warm_adapters_interval}}


def _forget_connections() -> None:
    """Celery builds its queues, routes and connection pool once, from the configuration of the moment; a
    process configured again (tests, an embedded app after another) must not keep sending to the old ones."""
    # app.pool is kombu's process-wide pool for the broker URL, and kombu's registries keep a closed pool
    # under that key: closing it alone leaves every later producer acquiring from a closed pool. Reset the
    # registries so the next use builds fresh pools.
    from kombu import pools

    pools.reset()
    app._pool = None
    app.__dict__.pop("amqp", None)


# A database or broker outage is retried with backoff (about 20 minutes in all); what still fails is picked
# up by the sweep below.
_TRANSIENT = (OperationalError, InterfaceError, ConnectionError, TimeoutError)


@app.task(name="loraplex.validate_adapter", bind=True, autoretry_for=_TRANSIENT, max_retries=8, retry_backoff=5,
          retry_backoff_max=300, retry_jitter=True, **_COMMON)
def validate_adapter(self, version_id: int) -> str:
    status = jobs.validate_adapter(get_context(), version_id)
    if status == "ready":
        # eager (embedded): runs right here, on the in-process engine; else queued for the engine process
        prefetch_adapter.apply_async(args=[version_id])
    return status


@app.task(name="loraplex.prefetch_adapter", **_COMMON)
def prefetch_adapter(version_id: int, pin: bool | None = None) -> bool:
    return jobs.prefetch_adapter(get_context(), version_id, pin)


@app.task(name="loraplex.remove_adapter", **_COMMON)
def remove_adapter(content_hash: str) -> bool:
    return jobs.remove_adapter(get_context(), content_hash)


@app.task(name="loraplex.warm_popular_adapters", **_COMMON)
def warm_popular_adapters() -> int:
    """The busiest versions of the last hour warmed. Pinned ones are left out: every process that holds an
    engine keeps its pins equal to the database's itself (`jobs.sync_pins`), where a task on the shared
    engine queue would reach one engine only."""
    ctx = get_context()
    pinned = set(jobs.pinned_versions(ctx))
    version_ids = [vid for vid in jobs.busiest_versions(ctx) if vid not in pinned]
    for vid in version_ids:
        prefetch_adapter.apply_async(args=[vid])
    return len(version_ids)


@app.task(name="loraplex.rollup_usage", **_COMMON)
def rollup_usage(day: str | None = None) -> int:
    return jobs.rollup_usage(get_context(), day)


@app.task(name="loraplex.resume_stuck_validations", **_COMMON)
def resume_stuck_validations() -> int:
    """Validation sent again for uploads left pending (a lost task, a worker that died on an outage)."""
    from loraplex.platform.recovery import stuck_validations

    ids = stuck_validations(get_context().sessions)
    for version_id in ids:
        validate_adapter.apply_async(args=[version_id])
    return len(ids)


@app.task(name="loraplex.sweep_adapter_store", **_COMMON)
def sweep_adapter_store() -> int:
    """Weights of deleted versions out of the store once their grace period has passed (store_sweep)."""
    from loraplex.platform.store_sweep import sweep

    ctx = get_context()
    store_dir = ctx.settings.resolved_adapter_store_dir.resolve()
    return len(sweep(ctx.sessions, store_dir, grace_seconds=ctx.settings.adapter_store_grace_seconds))


@app.task(name="loraplex.finalize_statements", **_COMMON)
def finalize_statements() -> int:
    from loraplex.platform.billing.tasks import finalize_last_month

    return finalize_last_month(get_context().sessions)
