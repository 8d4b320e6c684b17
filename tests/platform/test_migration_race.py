"""API replicas (or an admin command beside them) starting together on a new PostgreSQL database: the
migrations run once, the others wait for them and find nothing to do, and no process fails."""

from __future__ import annotations

import subprocess
import sys

from platform_helpers import postgres_schema
from sqlalchemy import inspect, text

from loraplex.platform.db import make_engine

# each process sleeps until a common start time past its imports, so that their migrations collide
UPGRADE = """
import sys, time
from loraplex.platform.migrate import upgrade_to_head
start = float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))
upgrade_to_head(sys.argv[1])
"""


def test_concurrent_upgrades_of_a_new_database_all_succeed():
    import time

    with postgres_schema("lpx_migrate") as url:
        start = time.time() + 8  # past every process's imports
        procs = [subprocess.Popen([sys.executable, "-c", UPGRADE, url, str(start)], stderr=subprocess.PIPE,
                                  text=True) for _ in range(3)]
        results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
        assert all(code == 0 for code, _ in results), [err[-2000:] for _, err in results]
        engine = make_engine(url, pooled=False)
        try:
            with engine.connect() as conn:
                versions = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
            assert len(versions) == 1
            assert {"tenants", "api_keys", "usage_records"} <= set(inspect(engine).get_table_names())
        finally:
            engine.dispose()
