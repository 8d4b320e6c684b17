"""The periodic tasks' schedule follows the settings: LORAPLEX_WARM_ADAPTERS_INTERVAL=0 turns the warming
run off under Celery beat as it does in the embedded default, rather than scheduling it without pause."""

from __future__ import annotations

from platform_helpers import make_settings

from loraplex.platform.tasks.celery_app import configure


def test_warm_interval_sets_the_warming_schedule(tmp_path):
    app = configure(make_settings(tmp_path, warm_adapters_interval=120.0))
    assert app.conf.beat_schedule["warm-busiest-adapters"]["schedule"] == 120.0


def test_warm_interval_zero_leaves_warming_out_of_the_schedule(tmp_path):
    app = configure(make_settings(tmp_path, warm_adapters_interval=0))
    assert "warm-busiest-adapters" not in app.conf.beat_schedule
    assert app.conf.beat_schedule["rollup-usage"]["task"] == "loraplex.rollup_usage"
