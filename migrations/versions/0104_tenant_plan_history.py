"""tenant_plans: which plan a tenant is on, by billing period

Revision ID: 0104
Revises: 0103
Create Date: 2026-12-02 02:00:00

Statements and reports priced every month at the tenant's current plan, so a plan change re-priced months
already billed (and could change their currency). Each tenant starts with its current plan for every period.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0104'
down_revision: str | None = '0103'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ALWAYS = "2000-01"


def upgrade() -> None:
    op.create_table('tenant_plans',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('effective_period', sa.String(length=7), nullable=False),
    sa.Column('plan_id', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['plan_id'], ['plans.id'], name=op.f('fk_tenant_plans_plan_id_plans'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_tenant_plans_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tenant_plans')),
    sa.UniqueConstraint('tenant_id', 'effective_period', name='uq_tenant_plans_tenant_id_period')
    )
    op.execute("INSERT INTO tenant_plans (tenant_id, effective_period, plan_id) "
               "SELECT id, '" + ALWAYS + "', plan_id FROM tenants")


def downgrade() -> None:
    op.drop_table('tenant_plans')
