"""billing and console tables

Revision ID: 0101
Revises: 0001
Create Date: 2026-11-29 21:50:34.374735

"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0101'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('usage_rollup_runs',
    sa.Column('day', sa.Date(), nullable=False),
    sa.Column('records', sa.Integer(), nullable=False),
    sa.Column('rolled_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('day', name=op.f('pk_usage_rollup_runs'))
    )
    op.create_table('console_sessions',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('sid_hash', sa.String(length=64), nullable=False),
    sa.Column('csrf_token', sa.String(length=64), nullable=False),
    sa.Column('admin_key_id', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['admin_key_id'], ['admin_keys.id'], name=op.f('fk_console_sessions_admin_key_id_admin_keys'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_console_sessions')),
    sa.UniqueConstraint('sid_hash', name=op.f('uq_console_sessions_sid_hash'))
    )
    with op.batch_alter_table('console_sessions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_console_sessions_admin_key_id'), ['admin_key_id'], unique=False)

    op.create_table('plan_prices',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('plan_id', sa.Integer(), nullable=True),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('prompt_price', sa.BigInteger(), nullable=False),
    sa.Column('completion_price', sa.BigInteger(), nullable=False),
    sa.Column('adapter_surcharge_price', sa.BigInteger(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['plan_id'], ['plans.id'], name=op.f('fk_plan_prices_plan_id_plans'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_plan_prices')),
    sa.UniqueConstraint('plan_id', name=op.f('uq_plan_prices_plan_id'))
    )
    op.create_table('statements',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('period', sa.String(length=7), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('requests', sa.Integer(), nullable=False),
    sa.Column('prompt_tokens', sa.BigInteger(), nullable=False),
    sa.Column('completion_tokens', sa.BigInteger(), nullable=False),
    sa.Column('total_amount', sa.BigInteger(), nullable=False),
    sa.Column('generated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_statements_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_statements')),
    sa.UniqueConstraint('tenant_id', 'period', name='uq_statements_tenant_id_period')
    )
    with op.batch_alter_table('statements', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_statements_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('tenant_price_overrides',
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('prompt_price', sa.BigInteger(), nullable=True),
    sa.Column('completion_price', sa.BigInteger(), nullable=True),
    sa.Column('adapter_surcharge_price', sa.BigInteger(), nullable=True),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_tenant_price_overrides_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('tenant_id', name=op.f('pk_tenant_price_overrides'))
    )
    op.create_table('usage_rollups',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('day', sa.Date(), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('api_key_id', sa.Integer(), nullable=False),
    sa.Column('adapter_name', sa.String(length=64), nullable=False),
    sa.Column('adapter_version', sa.String(length=64), nullable=False),
    sa.Column('requests', sa.Integer(), nullable=False),
    sa.Column('failed_requests', sa.Integer(), nullable=False),
    sa.Column('prompt_tokens', sa.BigInteger(), nullable=False),
    sa.Column('completion_tokens', sa.BigInteger(), nullable=False),
    sa.Column('latency_ms_total', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_usage_rollups_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_usage_rollups')),
    sa.UniqueConstraint('day', 'tenant_id', 'api_key_id', 'adapter_name', 'adapter_version', name='uq_usage_rollups_day_group')
    )
    with op.batch_alter_table('usage_rollups', schema=None) as batch_op:
        batch_op.create_index('ix_usage_rollups_tenant_id_day', ['tenant_id', 'day'], unique=False)

    op.create_table('statement_lines',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('statement_id', sa.Integer(), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('adapter', sa.String(length=128), nullable=False),
    sa.Column('component', sa.String(length=32), nullable=False),
    sa.Column('tokens', sa.BigInteger(), nullable=False),
    sa.Column('unit_price', sa.BigInteger(), nullable=False),
    sa.Column('amount', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['statement_id'], ['statements.id'], name=op.f('fk_statement_lines_statement_id_statements'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_statement_lines'))
    )
    with op.batch_alter_table('statement_lines', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_statement_lines_statement_id'), ['statement_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('statement_lines', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_statement_lines_statement_id'))

    op.drop_table('statement_lines')
    with op.batch_alter_table('usage_rollups', schema=None) as batch_op:
        batch_op.drop_index('ix_usage_rollups_tenant_id_day')

    op.drop_table('usage_rollups')
    op.drop_table('tenant_price_overrides')
    with op.batch_alter_table('statements', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_statements_tenant_id'))

    op.drop_table('statements')
    op.drop_table('plan_prices')
    with op.batch_alter_table('console_sessions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_console_sessions_admin_key_id'))

    op.drop_table('console_sessions')
    op.drop_table('usage_rollup_runs')
