"""The `adapter` filter of usage reports, written as the `model` field is: `name`, `name@version` (at least six
hex digits of the content hash), or empty for the base model alone.

A filter that names nothing the tenants in question ever had (no adapter of that name now, and no usage of
one by that name) is refused rather than answered with an empty report, which would read as "no usage".
Adapters are deleted with their rows, so their past usage still names them: a filter on it stays valid."""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.platform.billing.models import BASE_ADAPTER, UsageRollup
from loraplex.platform.models import Adapter, AdapterVersion, UsageRecord
from loraplex.platform.schemas.text import refuse_unstorable

MIN_VERSION_CHARS = 6  # as the `model` field takes a version
MAX_NAME_CHARS = 64  # what an adapter name (and the usage columns that copy it) can hold
_HEX = re.compile(r"[0-9a-f]+")


class UnknownAdapter(LookupError):
    """The filter is well formed but names no adapter (or version) of the tenants in question."""


@dataclass(frozen=True)
class AdapterFilter:
    name: str  # BASE_ADAPTER ("") for the base model
    version: str | None = None  # a lower-case prefix of the content hash

    def matches(self, name: str, version: str) -> bool:
        """`name` and `version` as usage totals carry them (BASE_ADAPTER for the base model)."""
        if name != self.name:
            return False
        return self.version is None or version.startswith(self.version)

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}" if self.version else self.name


def _shown(text: str) -> str:
    return repr(text if len(text) <= 80 else text[:80] + "...")


def parse_adapter_filter(text: str) -> AdapterFilter:
    """ValueError, in words, for a filter no adapter could be named by."""
    refuse_unstorable(text)
    if text.strip() != text:
        raise ValueError(f"must be an adapter's name, name@version, or empty for the base model; got {_shown(text)}")
    if text == BASE_ADAPTER:
        return AdapterFilter(BASE_ADAPTER)
    name, at, version = text.partition("@")
    if not name:
        raise ValueError(f"names no adapter before '@' (use name@version, or empty for the base model); "
                         f"got {_shown(text)}")
    if at:
        version = version.lower()
        if len(version) < MIN_VERSION_CHARS or not _HEX.fullmatch(version):
            raise ValueError(f"a version after '@' is at least {MIN_VERSION_CHARS} hex digits of the adapter's "
                             f"version, as /v1/models lists it; got {_shown(text)}")
        return AdapterFilter(name, version)
    return AdapterFilter(name)


def _exists(session: Session, stmt) -> bool:
    return session.scalars(stmt.limit(1)).first() is not None


def check_known(session: Session, wanted: AdapterFilter, tenant_ids: list[int] | None, *,
                own: bool = False) -> None:
    """UnknownAdapter when no adapter or usage of `tenant_ids` (every tenant: None) has that name (and version).
    The base model is always known. `own`: the tenant asks about its own usage (the message says "you");
    an operator is told about the tenant or tenants."""
    if wanted.name == BASE_ADAPTER:
        return
    one = tenant_ids is not None and len(tenant_ids) == 1
    who = "you have" if own else "the tenant has" if one else "the tenants have"
    if len(wanted.name) > MAX_NAME_CHARS:
        raise UnknownAdapter(f"There is no adapter {_shown(wanted.name)} ({who} none of that name).")

    def scoped(stmt, column):
        return stmt if tenant_ids is None else stmt.where(column.in_(tenant_ids))

    if wanted.version is None:
        checks = [
            scoped(select(Adapter.id).where(Adapter.name == wanted.name), Adapter.tenant_id),
            scoped(select(UsageRecord.id).where(UsageRecord.adapter_name == wanted.name), UsageRecord.tenant_id),
            scoped(select(UsageRollup.id).where(UsageRollup.adapter_name == wanted.name), UsageRollup.tenant_id),
        ]
        if not any(_exists(session, stmt) for stmt in checks):
            raise UnknownAdapter(f"There is no adapter {_shown(wanted.name)}: {who} no adapter, and no usage of "
                                 "one, by that name.")
        return
    prefix = wanted.version
    checks = [
        scoped(select(AdapterVersion.content_hash).join(Adapter, Adapter.id == AdapterVersion.adapter_id)
               .where(Adapter.name == wanted.name, AdapterVersion.content_hash.startswith(prefix, autoescape=True)),
               AdapterVersion.tenant_id),
        scoped(select(UsageRecord.adapter_version).where(
            UsageRecord.adapter_name == wanted.name, UsageRecord.adapter_version.startswith(prefix, autoescape=True)),
            UsageRecord.tenant_id),
        scoped(select(UsageRollup.adapter_version).where(
            UsageRollup.adapter_name == wanted.name, UsageRollup.adapter_version.startswith(prefix, autoescape=True)),
            UsageRollup.tenant_id),
    ]
    hashes: set[str] = set()
    for stmt in checks:
        hashes.update(h for h in session.scalars(stmt.distinct().limit(2)) if h)
    if not hashes:
        raise UnknownAdapter(f"There is no adapter version {_shown(wanted.label)}: {who} no version of adapter "
                             f"{_shown(wanted.name)} starting {prefix!r}, and no usage of one.")
    if len(hashes) > 1:
        raise ValueError(f"the version {prefix!r} of adapter {_shown(wanted.name)} is ambiguous; give more "
                         "characters")
