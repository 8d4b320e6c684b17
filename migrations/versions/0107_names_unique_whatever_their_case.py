"""tenant and plan names are unique whatever their case

Revision ID: 0107
Revises: 0106
Create Date: 2026-12-03 09:00:00

`acme` and `ACME` could both be created, and then read as the same tenant by whoever types the name. A unique
index on lower(name) refuses the second in the database as the service layer does. Names are ASCII letters,
digits, '.', '_' and '-', so lower() means the same on SQLite and PostgreSQL. A database that already holds
two names differing only in case is not changed: the upgrade stops, naming them, until one is renamed.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0107'
down_revision: str | None = '0106'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = {'tenants': 'uq_tenants_name_lower', 'plans': 'uq_plans_name_lower'}


class NamesDifferOnlyInCase(RuntimeError):
    pass


def _clashes(table: str) -> list[list[str]]:
    rows = op.get_bind().execute(sa.text(
        f"SELECT id, name FROM {table} WHERE lower(name) IN "
        f"(SELECT lower(name) FROM {table} GROUP BY lower(name) HAVING count(*) > 1) ORDER BY lower(name), id"))
    groups: dict[str, list[str]] = {}
    for row_id, name in rows:
        groups.setdefault(name.lower(), []).append(f"{name!r} (id {row_id})")
    return list(groups.values())


def upgrade() -> None:
    problems = []
    for table in TABLES:
        for group in _clashes(table):
            problems.append(f"{table}: {', '.join(group)}")
    if problems:
        raise NamesDifferOnlyInCase(
            "tenant and plan names are to be unique whatever their case, and these differ only in case: "
            + "; ".join(problems) + ". Nothing was changed. Rename all but one of each (in SQL: UPDATE tenants "
            "SET name = 'new-name' WHERE id = ...; a plan can be renamed with `loraplex admin update-plan NAME "
            "--name NEW`), then start the server (or run the migration) again.")
    for table, index in TABLES.items():
        op.create_index(index, table, [sa.text('lower(name)')], unique=True)


def downgrade() -> None:
    for table, index in TABLES.items():
        op.drop_index(index, table_name=table)
