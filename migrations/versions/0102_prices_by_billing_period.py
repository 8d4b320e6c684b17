"""prices by billing period

Revision ID: 0102
Revises: 0101
Create Date: 2026-11-29 22:12:49.993655

Price lists and tenant overrides gain the billing period they apply from; existing rows apply to every
period ("2000-01"), which is what they meant before.
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0102'
down_revision: str | None = '0101'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ALWAYS = "2000-01"


def upgrade() -> None:
    op.create_table('tenant_prices',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('effective_period', sa.String(length=7), nullable=False),
    sa.Column('prompt_price', sa.BigInteger(), nullable=True),
    sa.Column('completion_price', sa.BigInteger(), nullable=True),
    sa.Column('adapter_surcharge_price', sa.BigInteger(), nullable=True),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_tenant_prices_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tenant_prices')),
    sa.UniqueConstraint('tenant_id', 'effective_period', name='uq_tenant_prices_tenant_id_period')
    )
    op.execute(
        "INSERT INTO tenant_prices (tenant_id, effective_period, prompt_price, completion_price, "
        "adapter_surcharge_price, updated_at) SELECT tenant_id, '" + ALWAYS + "', prompt_price, completion_price, "
        "adapter_surcharge_price, updated_at FROM tenant_price_overrides"
    )
    op.drop_table('tenant_price_overrides')
    with op.batch_alter_table('plan_prices', schema=None) as batch_op:
        batch_op.add_column(sa.Column('effective_period', sa.String(length=7), nullable=False,
                                      server_default=ALWAYS))
        batch_op.drop_constraint(batch_op.f('uq_plan_prices_plan_id'), type_='unique')
        batch_op.create_unique_constraint('uq_plan_prices_plan_id_period', ['plan_id', 'effective_period'])
    with op.batch_alter_table('plan_prices', schema=None) as batch_op:
        batch_op.alter_column('effective_period', server_default=None)


def downgrade() -> None:
    # keeps, for each plan and tenant, the prices of the latest period
    op.execute(
        "DELETE FROM plan_prices WHERE id NOT IN (SELECT MAX(id) FROM plan_prices p WHERE p.effective_period = "
        "(SELECT MAX(q.effective_period) FROM plan_prices q WHERE q.plan_id IS NOT DISTINCT FROM p.plan_id) "
        "GROUP BY p.plan_id)"
    )
    with op.batch_alter_table('plan_prices', schema=None) as batch_op:
        batch_op.drop_constraint('uq_plan_prices_plan_id_period', type_='unique')
        batch_op.create_unique_constraint(batch_op.f('uq_plan_prices_plan_id'), ['plan_id'])
        batch_op.drop_column('effective_period')

    op.create_table('tenant_price_overrides',
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('prompt_price', sa.BigInteger(), nullable=True),
    sa.Column('completion_price', sa.BigInteger(), nullable=True),
    sa.Column('adapter_surcharge_price', sa.BigInteger(), nullable=True),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_tenant_price_overrides_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('tenant_id', name=op.f('pk_tenant_price_overrides'))
    )
    op.execute(
        "INSERT INTO tenant_price_overrides (tenant_id, prompt_price, completion_price, adapter_surcharge_price, "
        "updated_at) SELECT t.tenant_id, t.prompt_price, t.completion_price, t.adapter_surcharge_price, t.updated_at "
        "FROM tenant_prices t WHERE t.effective_period = (SELECT MAX(u.effective_period) FROM tenant_prices u "
        "WHERE u.tenant_id = t.tenant_id)"
    )
    op.drop_table('tenant_prices')
