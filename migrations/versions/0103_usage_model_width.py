"""usage_records.model holds name@full-hash

Revision ID: 0103
Revises: 0102
Create Date: 2026-12-01 19:00:00

A request may name an adapter version by its whole content hash: 64 characters of name, "@" and 64 of hash
are 129, one more than the column held (PostgreSQL then refused the usage record).
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0103'
down_revision: str | None = '0102'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('usage_records', schema=None) as batch_op:
        batch_op.alter_column('model', existing_type=sa.String(length=128), type_=sa.String(length=192),
                              existing_nullable=False)


def downgrade() -> None:
    op.execute("UPDATE usage_records SET model = substr(model, 1, 128) WHERE length(model) > 128")
    with op.batch_alter_table('usage_records', schema=None) as batch_op:
        batch_op.alter_column('model', existing_type=sa.String(length=192), type_=sa.String(length=128),
                              existing_nullable=False)
