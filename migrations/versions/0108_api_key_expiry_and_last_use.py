"""api_keys.expires_at and api_keys.last_used_at

Revision ID: 0108
Revises: 0107
Create Date: 2026-12-03 11:00:00

A key may be made to stop working at a set time (NULL: never); when each key was last used is kept (to the
minute) so that operators can tell a key in use from one that can go.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0108'
down_revision: str | None = '0107'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('api_keys') as batch:
        batch.add_column(sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column('last_used_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('api_keys') as batch:
        batch.drop_column('last_used_at')
        batch.drop_column('expires_at')
