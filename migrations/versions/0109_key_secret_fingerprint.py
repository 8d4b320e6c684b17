"""key_secret: a fingerprint of the secret that keys the API-key hashes

Revision ID: 0109
Revises: 0108
Create Date: 2026-12-03 12:00:00

A process started with another LORAPLEX_SECRET_KEY than the one the database's keys were hashed with would
refuse every key, and the keys it made would work nowhere else: the fingerprint lets it say so instead.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0109'
down_revision: str | None = '0108'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'key_secret',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('fingerprint', sa.String(length=64), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_key_secret')),
    )


def downgrade() -> None:
    op.drop_table('key_secret')
