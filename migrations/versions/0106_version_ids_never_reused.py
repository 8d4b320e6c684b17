"""adapter_versions ids are never reused on SQLite (AUTOINCREMENT)

Revision ID: 0106
Revises: 0105
Create Date: 2026-12-02 08:00:00

SQLite gives a new row the largest id in the table plus one, so a version id freed by deleting the newest
version went to the next upload, another tenant's as likely as not: an operator's pin call or console link
for the deleted version then named someone else's. PostgreSQL's sequences never reuse ids already.
"""
from collections.abc import Sequence

from alembic import op

revision: str = '0106'
down_revision: str | None = '0105'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _recreate(autoincrement: bool) -> None:
    # nothing refers to adapter_versions by foreign key, so copying it into a new table is safe
    if op.get_bind().dialect.name != 'sqlite':
        return
    with op.batch_alter_table('adapter_versions', recreate='always',
                              table_kwargs={'sqlite_autoincrement': autoincrement}):
        pass


def upgrade() -> None:
    _recreate(True)


def downgrade() -> None:
    _recreate(False)
