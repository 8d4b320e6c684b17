"""`loraplex admin`: plans, tenants and keys from the command line, straight against the database."""

from __future__ import annotations

import re
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import click

from loraplex.platform.billing.cli import billing
from loraplex.platform.ids import MAX_ROW_ID


class KeyId(click.ParamType):
    """A key's id: the number its listing shows first (click's own words for a bad one, "is not a valid
    integer range", say nothing of what was expected)."""

    name = "key id"

    def __init__(self, listing: str):
        self.listing = listing  # the command that shows the ids

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip()
        if not (text.isascii() and text.isdigit()):
            self.fail(f"expects a key id, a number as `loraplex admin {self.listing}` shows it first; got "
                      f"{value!r}", param, ctx)
        number = int(text)
        if not 1 <= number <= MAX_ROW_ID:
            self.fail(f"no key has id {number}", param, ctx)
        return number


def page_options(fn):
    """--limit/--after/--search on a list command. Without any of them it lists every row, as it always has."""
    fn = click.option("--search", default=None, help="only rows whose name (or key prefix) contains this text, "
                      "any case")(fn)
    fn = click.option("--after", default=None, help="the id the previous page ended on (stderr names it)")(fn)
    return click.option("--limit", default=None, help="at most this many rows (1 to 1000), in id order")(fn)


def _listed(session, stmt, key, columns, limit, after, search) -> list:
    """Every row of `stmt` by `key`, or one page of them when a page option was given; where more rows follow, a
    line on stderr says how to list them."""
    from loraplex.platform.paging import PagingError, fetch_page, matching, page_params

    given = {name: value for name, value in (("limit", limit), ("after", after), ("q", search)) if value is not None}
    if not given:
        return list(session.scalars(stmt.order_by(key)))
    try:
        params = page_params(given)
    except PagingError as exc:
        option = "--search" if exc.param == "q" else f"--{exc.param}"
        raise click.BadParameter(str(exc).replace("q must", "the search must"), param_hint=option) from exc
    if params.search:
        stmt = stmt.where(matching(params.search, *columns))
    rows, has_more = fetch_page(session, stmt, key, params)
    if has_more:
        click.echo(f"more rows follow: add --after {rows[-1].id} for the next page", err=True)
    return rows


@contextmanager
def _session():
    from pydantic import ValidationError
    from sqlalchemy.engine import make_url

    from loraplex.config import Settings
    from loraplex.platform.commands import _setting_error, prepare_database_or_fail, refuse_another_key_secret
    from loraplex.platform.db import make_engine, make_session_factory, session_scope
    from loraplex.platform.schemas.messages import plain_errors
    from loraplex.platform.tenants import TenantError

    try:
        settings = Settings()
    except ValidationError as exc:
        raise click.ClickException("; ".join(_setting_error(e) for e in exc.errors())) from exc
    # Run from another folder than the server, the embedded default would quietly start a second, empty
    # database there: tenants and keys made in it never reach the server. Say so when that happens.
    url = make_url(settings.resolved_database_url)
    sqlite_file = Path(url.database).resolve() if url.get_backend_name() == "sqlite" and url.database else None
    is_new = sqlite_file is not None and not sqlite_file.exists()
    prepare_database_or_fail(settings)
    refuse_another_key_secret(settings)
    if is_new:
        click.echo(f"loraplex admin: there was no database at {sqlite_file}, so a new, empty one was created. "
                   "`loraplex serve` uses the one under its data folder (LORAPLEX_DATA_DIR, by default "
                   "./.loraplex in the folder it runs from); run `loraplex admin` there to manage its tenants, "
                   "or, for a server on PostgreSQL, set LORAPLEX_DATABASE_URL to the one its processes use.",
                   err=True)
    engine = make_engine(settings.resolved_database_url, pooled=False)
    try:
        with session_scope(make_session_factory(engine)) as session:
            yield session, settings
    except TenantError as exc:
        raise click.ClickException(str(exc)) from exc
    except ValidationError as exc:
        raise click.ClickException(plain_errors(exc)) from exc
    finally:
        engine.dispose()


_QUOTA_OPTIONS = [
    click.option("--rpm", "requests_per_minute", type=int, help="requests per minute"),
    click.option("--tpm", "tokens_per_minute", type=int, help="tokens per minute"),
    click.option("--concurrent", "max_concurrent", type=int, help="concurrent requests"),
    click.option("--monthly-tokens", "monthly_token_budget", type=int, help="monthly token budget"),
]


def quota_options(fn):
    for option in reversed(_QUOTA_OPTIONS):
        fn = option(fn)
    return fn


@click.group()
def admin():
    """Manage plans, tenants and API keys (uses LORAPLEX_DATABASE_URL or the embedded SQLite file)."""


@admin.command("create-plan")
@click.argument("name")
@quota_options
def create_plan_cmd(name, **quotas):
    """Create a plan with default quotas for its tenants; every quota is required (--rpm, --tpm,
    --concurrent, --monthly-tokens)."""
    from loraplex.platform.schemas.tenants import PlanCreate
    from loraplex.platform.tenants import create_plan

    missing = [k for k, v in quotas.items() if v is None]
    if missing:
        raise click.ClickException("a plan needs every quota: --rpm, --tpm, --concurrent, --monthly-tokens")
    with _session() as (session, _):
        plan = create_plan(session, PlanCreate(name=name, **quotas))
        click.echo(f"plan {plan.name} (id {plan.id})")


@admin.command("list-plans")
@page_options
def list_plans_cmd(limit, after, search):
    """Every plan with its quotas and how many tenants are on it."""
    from sqlalchemy import func, select

    from loraplex.platform.models import Plan, Tenant

    with _session() as (session, _):
        counts = dict(session.execute(select(Tenant.plan_id, func.count()).group_by(Tenant.plan_id)).all())
        plans = _listed(session, select(Plan), Plan.id, (Plan.name,), limit, after, search)
        if not plans:  # on stderr: stdout stays one line per plan for scripts
            click.echo("no plans yet; `loraplex admin create-plan NAME --rpm ... --tpm ... --concurrent ... "
                       "--monthly-tokens ...` makes one", err=True)
        for plan in plans:
            click.echo(f"{plan.id}\t{plan.name}\trpm={plan.requests_per_minute}\ttpm={plan.tokens_per_minute}"
                       f"\tconcurrent={plan.max_concurrent}\tmonthly_tokens={plan.monthly_token_budget}"
                       f"\ttenants={counts.get(plan.id, 0)}")


@admin.command("update-plan")
@click.argument("name")
@click.option("--name", "new_name", default=None, help="rename the plan (names stay unique)")
@quota_options
def update_plan_cmd(name, new_name, **quotas):
    """Change a plan's quotas (or name). Its tenants without an override of their own get the new values from
    their next request on, in every running server."""
    from loraplex.platform.schemas.tenants import PlanUpdate
    from loraplex.platform.tenants import get_plan, update_plan

    changes = {k: v for k, v in quotas.items() if v is not None}
    if new_name is not None:
        changes["name"] = new_name
    if not changes:
        raise click.ClickException("nothing to change: give --name or a quota option")
    with _session() as (session, _):
        plan = update_plan(session, get_plan(session, name), PlanUpdate(**changes))
        click.echo(f"plan {plan.name} (id {plan.id}): {plan.requests_per_minute} req/min, "
                   f"{plan.tokens_per_minute} tokens/min, {plan.max_concurrent} concurrent, "
                   f"{plan.monthly_token_budget} tokens/month")


@admin.command("delete-plan")
@click.argument("name")
def delete_plan_cmd(name):
    """Delete a plan no tenant is on and no tenant's month is billed at (a plan in a tenant's history prices
    those months, so it is kept; one joined and left within a month prices none)."""
    from loraplex.platform.tenants import delete_plan, get_plan

    with _session() as (session, _):
        plan = get_plan(session, name)
        delete_plan(session, plan)
        click.echo(f"plan {name} deleted")


@admin.command("create-tenant")
@click.argument("name")
@click.option("--plan", default=None, help="name of an existing plan")
@quota_options
def create_tenant_cmd(name, plan, **quotas):
    """Create a tenant; quotas not given come from its plan or the service defaults."""
    from loraplex.platform.schemas.tenants import TenantCreate
    from loraplex.platform.tenants import create_tenant, tenant_public

    with _session() as (session, settings):
        tenant = create_tenant(session, TenantCreate(name=name, plan=plan, **quotas))
        q = tenant_public(tenant, settings).quotas
        click.echo(f"tenant {tenant.name} (id {tenant.id}): {q.requests_per_minute} req/min, "
                   f"{q.tokens_per_minute} tokens/min, {q.max_concurrent} concurrent, "
                   f"{q.monthly_token_budget} tokens/month")


# the CLI's short name of each quota (its option without the dashes) and the field it sets
_QUOTA_NAMES = {"rpm": "requests_per_minute", "tpm": "tokens_per_minute", "concurrent": "max_concurrent",
                "monthly-tokens": "monthly_token_budget"}


@admin.command("list-tenants")
@page_options
def list_tenants_cmd(limit, after, search):
    """Every tenant with its status, plan and effective quotas; each quota says where it comes from:
    (own) the tenant's override, (plan) its plan, (default) the service default."""
    from sqlalchemy import select

    from loraplex.platform.models import Tenant
    from loraplex.platform.tenants import quota_sources, tenant_public

    with _session() as (session, settings):
        tenants = _listed(session, select(Tenant), Tenant.id, (Tenant.name,), limit, after, search)
        if not tenants:  # on stderr: stdout stays one line per tenant for scripts
            click.echo("no tenants yet; `loraplex admin create-tenant NAME` makes one", err=True)
        for tenant in tenants:
            q = tenant_public(tenant, settings).quotas
            source = quota_sources(tenant)
            shown = "\t".join(f"{short.replace('-', '_')}={getattr(q, field)}({source[field]})"
                              for short, field in _QUOTA_NAMES.items())
            click.echo(f"{tenant.id}\t{tenant.name}\t{tenant.status}\tplan={tenant.plan.name if tenant.plan else '-'}"
                       f"\t{shown}")


@admin.command("set-quota")
@click.argument("tenant")
@click.option("--plan", default=None, help='name of an existing plan; --plan "" removes the plan')
@quota_options
@click.option("--clear", "cleared", multiple=True, type=click.Choice([*_QUOTA_NAMES, "all"]),
              help="drop the tenant's own value of a quota, so the plan's (or the default) applies; repeat for "
                   "several, or `all`")
def set_quota_cmd(tenant, plan, cleared, **quotas):
    """Change a tenant's plan or quota overrides (TENANT: name or id)."""
    from loraplex.platform.schemas.tenants import TenantUpdate
    from loraplex.platform.tenants import get_tenant, update_tenant

    changes = {k: v for k, v in quotas.items() if v is not None}
    clear = set(_QUOTA_NAMES.values()) if "all" in cleared else {_QUOTA_NAMES[c] for c in cleared}
    both = [short for short, field in _QUOTA_NAMES.items() if field in clear and field in changes]
    if both:
        raise click.ClickException(f"--{both[0]} and --clear {both[0]} (or all) contradict each other: give one")
    changes |= dict.fromkeys(clear)  # None: the override is cleared
    if plan is not None:
        changes["plan"] = plan
    if not changes:
        raise click.ClickException("nothing to change: give --plan, a quota option or --clear")
    with _session() as (session, _):
        t = update_tenant(session, get_tenant(session, tenant), TenantUpdate(**changes))
        click.echo(f"tenant {t.name} updated")


@admin.command("suspend")
@click.argument("tenant")
def suspend_cmd(tenant):
    """Refuse every key of TENANT (403) until it is resumed."""
    _set_status(tenant, "suspended")


@admin.command("resume")
@click.argument("tenant")
def resume_cmd(tenant):
    """Let a suspended TENANT in again."""
    _set_status(tenant, "active")


def _set_status(tenant: str, status: str) -> None:
    from loraplex.platform.schemas.tenants import TenantUpdate
    from loraplex.platform.tenants import get_tenant, update_tenant

    with _session() as (session, _):
        t = update_tenant(session, get_tenant(session, tenant), TenantUpdate(status=status))
        click.echo(f"tenant {t.name} is {t.status}")


_DURATION = re.compile(r"^(\d{1,6})\s*([hdw])$")
_HOURS = {"h": 1, "d": 24, "w": 7 * 24}


def _expiry(_ctx, _param, value: str | None) -> datetime | None:
    """--expires-in: a time from now (30d, 12h, 2w) or an ISO 8601 date or time."""
    from loraplex.platform.schemas.tenants import parse_expiry

    if value is None:
        return None
    found = _DURATION.match(value.strip().lower())
    if found:
        try:
            return datetime.now(UTC) + timedelta(hours=int(found[1]) * _HOURS[found[2]])
        except OverflowError:  # 999999w: past the calendar's year 9999
            raise click.BadParameter(f"{value!r} from now is past the year 9999: give a shorter time or a date "
                                     "(2999-01-31)") from None
    try:
        return parse_expiry(value)
    except ValueError:
        raise click.BadParameter(f"expects a time from now (30d, 12h, 2w) or an ISO 8601 date or time "
                                 f"(2027-01-31, 2027-01-31T12:00:00Z); got {value!r}") from None


@admin.command("create-key")
@click.argument("tenant")
@click.option("--name", default="default", show_default=True)
@click.option("--scope", "scopes", multiple=True, type=click.Choice(["inference", "adapters", "usage"]),
              help="repeat for several; default: all")
@click.option("--expires-in", "--expires", "expires_at", callback=_expiry, metavar="30d|12h|2w|DATE",
              help="the key stops working then: a time from now, or an ISO 8601 date (00:00 UTC that day) or "
                   "time; default: never")
def create_key_cmd(tenant, name, scopes, expires_at):
    """Create an API key for TENANT (name or id). The key is printed once."""
    from loraplex.platform.schemas.tenants import KeyCreate
    from loraplex.platform.tenants import create_api_key, get_tenant

    with _session() as (session, settings):
        fields = {"name": name, "expires_at": expires_at} | ({"scopes": list(scopes)} if scopes else {})
        data = KeyCreate(**fields)
        owner = get_tenant(session, tenant)
        created = create_api_key(session, settings, owner, data)
        until = f"; expires {created.expires_at:%Y-%m-%d %H:%M} UTC" if created.expires_at else ""
        click.echo(f"key {created.id} for tenant {owner.name} (scopes: {' '.join(created.scopes)}{until}); "
                   "shown only now:", err=True)
        click.echo(created.key)


@admin.command("list-keys")
@click.argument("tenant")
@page_options
def list_keys_cmd(tenant, limit, after, search):
    """TENANT's keys: id, display prefix, name, scopes, state, last use (to the minute; never the secret)."""
    from sqlalchemy import select

    from loraplex.platform.models import ApiKey
    from loraplex.platform.tenants import get_tenant, key_state

    with _session() as (session, _):
        t = get_tenant(session, tenant)
        keys = _listed(session, select(ApiKey).where(ApiKey.tenant_id == t.id), ApiKey.id,
                       (ApiKey.name, ApiKey.prefix), limit, after, search)
        if not keys:  # on stderr: stdout stays one line per key for scripts
            click.echo(f"tenant {t.name} has no keys yet; `loraplex admin create-key {t.name}` makes one", err=True)
        for key in keys:
            used = f"last used {key.last_used_at:%Y-%m-%d %H:%M}" if key.last_used_at else "never used"
            click.echo(f"{key.id}\t{key.prefix}...\t{key.name}\t{key.scopes}\t{key_state(key)}\t{used}")


@admin.command("revoke-key")
@click.argument("key_id", type=KeyId("list-keys TENANT"))
def revoke_key_cmd(key_id):
    """Revoke an API key by id; it stops working at once."""
    from loraplex.platform.models import ApiKey
    from loraplex.platform.tenants import TenantError, revoke_api_key

    with _session() as (session, _):
        key = session.get(ApiKey, key_id)
        if key is None:
            raise TenantError(f"no API key with id {key_id}")
        revoke_api_key(session, key)
        click.echo(f"key {key_id} ({key.prefix}...) revoked")


def _key_name(_ctx, _param, value: str) -> str:
    from loraplex.platform.schemas.tenants import refuse_control_characters

    # what the column holds (64 characters; PostgreSQL refuses more)
    if not value or len(value) > 64:
        raise click.BadParameter(f"a key name is 1-64 characters, got {len(value)}")
    try:
        return refuse_control_characters(value)
    except ValueError as exc:
        raise click.BadParameter(f"a key name {exc}") from None


@admin.command("create-admin-key")
@click.option("--name", default="admin", show_default=True, callback=_key_name, help="1-64 characters")
def create_admin_key_cmd(name):
    """Create another admin key (for /admin/api and the console). Printed once."""
    from loraplex.platform.tenants import create_admin_key

    with _session() as (session, settings):
        _, secret = create_admin_key(session, settings, name=name)
        click.echo(secret)


@admin.command("list-admin-keys")
@page_options
def list_admin_keys_cmd(limit, after, search):
    """Admin keys: id, display prefix, name, created, state (never the secret)."""
    from sqlalchemy import select

    from loraplex.platform.models import AdminKey

    with _session() as (session, _):
        keys = _listed(session, select(AdminKey), AdminKey.id, (AdminKey.name, AdminKey.prefix), limit, after, search)
        if not keys:  # a database `loraplex serve` has not started on yet (it makes the first one)
            click.echo("no admin keys yet; `loraplex serve` makes one on its first start, "
                       "`loraplex admin create-admin-key` makes one now", err=True)
        for key in keys:
            state = f"revoked {key.revoked_at:%Y-%m-%d %H:%M}" if key.revoked_at else "active"
            click.echo(f"{key.id}\t{key.prefix}...\t{key.name}\t{key.created_at:%Y-%m-%d %H:%M}\t{state}")


@admin.command("revoke-admin-key")
@click.argument("key_id", type=KeyId("list-admin-keys"))
@click.option("--force", is_flag=True,
              help="Revoke it even if it is the last active admin key (the admin API and the console then take "
                   "none until `loraplex admin create-admin-key` makes one).")
def revoke_admin_key_cmd(key_id, force):
    """Revoke an admin key by id: /admin/api refuses it at once and its console sessions end. The last active
    admin key is revoked only with --force, as the admin API and the console refuse to."""
    from loraplex.platform.tenants import LastAdminKey, active_admin_keys, revoke_admin_key

    with _session() as (session, _):
        try:
            key = revoke_admin_key(session, key_id, allow_last=force)
        except LastAdminKey as exc:
            raise click.ClickException(f"{exc}; or revoke it anyway with --force") from exc
        click.echo(f"admin key {key_id} ({key.prefix}...) revoked")
        if not active_admin_keys(session):
            click.echo("no active admin key is left: `loraplex admin create-admin-key` makes one", err=True)


admin.add_command(billing)


# Command groups other areas add under `loraplex admin` (module, attribute), included when present.
OPTIONAL_GROUPS = (("loraplex.platform.billing.cli", "billing"),)


def _attach_optional_groups() -> None:
    import importlib

    for module_name, attr in OPTIONAL_GROUPS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        admin.add_command(getattr(module, attr))


_attach_optional_groups()
