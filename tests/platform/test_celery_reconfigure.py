"""A process that configures the Celery app again (an embedded app after another) keeps working."""

from loraplex.config import Settings
from loraplex.platform.tasks.celery_app import configure


def test_producers_work_after_the_app_is_configured_again(tmp_path):
    first = configure(Settings(data_dir=tmp_path, task_queue="first"))
    with first.producer_or_acquire() as producer:
        assert producer is not None
    second = configure(Settings(data_dir=tmp_path, task_queue="second"))
    assert second.conf.task_default_queue == "second"
    # Before the fix the pool for the same broker URL stayed closed in kombu's registry:
    # "RuntimeError: Acquire on closed pool" on every later task sent from an eager task.
    with second.producer_or_acquire() as producer:
        assert producer is not None
