"""`loraplex admin billing`: prices, reports, statements and rollups for finance, from the command line."""

from __future__ import annotations

import click


def _session():
    # the admin group owns the database session recipe (settings, migrations, readable errors)
    from loraplex.platform.admin_cli import _session as admin_session

    return admin_session()


def _money(value: str | None, what: str) -> int | None:
    from loraplex.platform.billing.money import parse_money

    if value is None:
        return None
    try:
        return parse_money(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=f"--{what}") from exc


def _check_period(period: str | None) -> str | None:
    from loraplex.platform.billing.periods import parse_period

    if period is not None:
        try:
            parse_period(period)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from exc
    return period


class Day(click.ParamType):
    """A UTC day written YYYY-MM-DD, as the API and the console take it (click.DateTime would also read
    2026-1-1 and hand back a datetime)."""

    name = "YYYY-MM-DD"

    def convert(self, value, param, ctx):
        from datetime import date

        from loraplex.platform.billing.periods import parse_day

        if isinstance(value, date):
            return value
        try:
            return parse_day(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


@click.group()
def billing():
    """Prices, usage reports and monthly statements (amounts are decimal currency units)."""


@billing.command("set-price")
@click.option("--plan", default=None, help="plan name (default: the price list of tenants without a plan)")
@click.option("--prompt", required=True, help="per million prompt tokens, e.g. 0.15")
@click.option("--completion", required=True, help="per million completion tokens")
@click.option("--surcharge", default="0", show_default=True, help="per million tokens of adapter requests")
@click.option("--currency", default="USD", show_default=True)
@click.option("--from", "period", default=None, help="first period it applies to, YYYY-MM (default: this month)")
def set_price_cmd(plan, prompt, completion, surcharge, currency, period):
    """Set a plan's price list."""
    from sqlalchemy import select

    from loraplex.platform.billing.prices import set_plan_price
    from loraplex.platform.billing.pricing import Price, known_currency
    from loraplex.platform.models import Plan

    try:
        price = Price(_money(prompt, "prompt"), _money(completion, "completion"), _money(surcharge, "surcharge"),
                      known_currency(currency.upper()))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    with _session() as (session, _):
        plan_id = None
        if plan is not None:
            row = session.scalar(select(Plan).where(Plan.name == plan))
            if row is None:
                raise click.ClickException(f"no plan named {plan!r}")
            plan_id = row.id
        try:
            set_plan_price(session, plan_id, price, _check_period(period))
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
    click.echo(f"prices of {plan or '(no plan)'} set from {period or 'this month'}")


@billing.command("set-tenant-price")
@click.argument("tenant")
@click.option("--prompt", default=None)
@click.option("--completion", default=None)
@click.option("--surcharge", default=None)
@click.option("--from", "period", default=None, help="first period it applies to, YYYY-MM (default: this month)")
def set_tenant_price_cmd(tenant, prompt, completion, surcharge, period):
    """Override a tenant's prices (omitted components keep the plan's; none at all ends the override)."""
    from loraplex.platform.billing.prices import set_tenant_override
    from loraplex.platform.billing.pricing import PriceOverride
    from loraplex.platform.tenants import get_tenant

    override = PriceOverride(_money(prompt, "prompt"), _money(completion, "completion"), _money(surcharge, "surcharge"))
    with _session() as (session, _):
        try:
            set_tenant_override(session, get_tenant(session, tenant).id, override, _check_period(period))
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
    click.echo(f"prices of tenant {tenant} set from {period or 'this month'}")


@billing.command("report")
@click.option("--start", type=Day(), default=None, help="first UTC day, YYYY-MM-DD (default: 1st)")
@click.option("--end", type=Day(), default=None, help="last UTC day, YYYY-MM-DD (default: today)")
@click.option("--tenant", "tenants", multiple=True, help="repeat for several; default: all")
@click.option("--group-by", default="tenant", show_default=True, help="comma-separated: day,tenant,key,adapter")
@click.option("--adapter", default=None, help='only this adapter: NAME, NAME@VERSION, or "" for the base model')
@click.option("--format", "fmt", type=click.Choice(["csv", "json"]), default="csv", show_default=True)
def report_cmd(start, end, tenants, group_by, adapter, fmt):
    """Usage and estimated amounts across tenants."""
    from loraplex.platform.billing.adapter_filter import UnknownAdapter, check_known, parse_adapter_filter
    from loraplex.platform.billing.export import rows_to_csv, to_json, with_decimal_amounts
    from loraplex.platform.billing.periods import resolve_range
    from loraplex.platform.billing.reports import parse_group_by, usage_report
    from loraplex.platform.tenants import get_tenant

    try:
        dims = parse_group_by(group_by)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--group-by") from exc
    try:
        lo, hi = resolve_range(start, end)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--start/--end") from exc
    try:
        wanted = None if adapter is None else parse_adapter_filter(adapter)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--adapter") from exc
    with _session() as (session, _):
        ids = [get_tenant(session, t).id for t in tenants] or None
        if wanted is not None:
            try:
                check_known(session, wanted, ids)
            except UnknownAdapter as exc:
                raise click.ClickException(str(exc)) from exc
            except ValueError as exc:  # a version prefix that fits several
                raise click.BadParameter(str(exc), param_hint="--adapter") from exc
        rows = [r.as_dict(dims) for r in usage_report(session, lo, hi, group_by=dims, tenant_ids=ids, adapter=wanted)]
    from loraplex.platform.billing.reports import ReportRow

    # CSV ends its last row with its own line break; JSON gets one, so a shell prompt does not follow on its line
    click.echo(rows_to_csv(rows, ReportRow.columns(dims)) if fmt == "csv"
               else to_json([with_decimal_amounts(r) for r in rows]) + "\n", nl=False)


@billing.command("statement")
@click.argument("tenant")
@click.argument("period")
@click.option("--format", "fmt", type=click.Choice(["csv", "json"]), default="csv", show_default=True)
def statement_cmd(tenant, period, fmt):
    """One tenant's statement for PERIOD (YYYY-MM): final if finalized, else a draft."""
    from loraplex.platform.billing.export import statement_csv, statement_dict, to_json
    from loraplex.platform.billing.statements import NoStatement, statement_of
    from loraplex.platform.tenants import get_tenant

    _check_period(period)
    with _session() as (session, _):
        try:
            view = statement_of(session, get_tenant(session, tenant), period)
        except NoStatement as exc:
            raise click.ClickException(str(exc)) from exc
    click.echo(statement_csv(view) if fmt == "csv" else to_json(statement_dict(view)) + "\n", nl=False)


@billing.command("finalize")
@click.argument("period")
def finalize_cmd(period):
    """Finalize every tenant's statement for a closed PERIOD (YYYY-MM); re-running changes nothing."""
    from loraplex.platform.billing.statements import finalize_period

    _check_period(period)
    with _session() as (session, _):
        try:
            count = finalize_period(session, period)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
    click.echo(f"{count} statements for {period} are final")


@billing.command("rollup")
@click.argument("day", type=Day())
@click.option("--end", type=Day(), default=None, help="last day of a range, YYYY-MM-DD")
def rollup_cmd(day, end):
    """Rebuild the daily usage rollups of DAY (or DAY..END); idempotent."""
    from loraplex.platform.billing.periods import days_in, resolve_rollup_range
    from loraplex.platform.billing.rollups import rollup_day

    try:
        lo, hi = resolve_rollup_range(day, end)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    with _session() as (session, _):
        for d in days_in(lo, hi):
            rows = rollup_day(session, d)
            click.echo(f"{d}: {rows} rows")


