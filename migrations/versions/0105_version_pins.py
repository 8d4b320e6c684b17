"""adapter_versions.pinned: a pin belongs to the version an operator pinned

Revision ID: 0105
Revises: 0104
Create Date: 2026-12-02 05:40:00

Pins lived only in the engine, per content hash: two tenants who uploaded the same weights shared one pin
(unpinning either's version unpinned both's, and a deleted adapter's pin outlived it on the other tenant's
version). The engine keeps a content pinned while any ready version of it is pinned here.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0105'
down_revision: str | None = '0104'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('adapter_versions') as batch:
        batch.add_column(sa.Column('pinned', sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table('adapter_versions') as batch:
        batch.drop_column('pinned')
