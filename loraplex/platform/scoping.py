"""Tenant scoping in one place: every query on a tenant-owned table goes through a TenantScope."""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from loraplex.platform.db import Base

T = TypeVar("T", bound=Base)


class TenantScope:
    """A session view that can only see one tenant's rows."""

    def __init__(self, session: Session, tenant_id: int):
        self.session = session
        self.tenant_id = tenant_id

    def select(self, model: type[T], *criteria: Any) -> Select[tuple[T]]:
        tenant_col = getattr(model, "tenant_id", None)
        if tenant_col is None:
            raise TypeError(f"{model.__name__} is not tenant-owned (no tenant_id column)")
        return select(model).where(tenant_col == self.tenant_id, *criteria)

    def all(self, model: type[T], *criteria: Any, order_by: Any = None) -> list[T]:
        stmt = self.select(model, *criteria)
        if order_by is not None:
            stmt = stmt.order_by(order_by)
        return list(self.session.scalars(stmt))

    def one_or_none(self, model: type[T], *criteria: Any) -> T | None:
        return self.session.scalars(self.select(model, *criteria)).one_or_none()

    def add(self, obj: T) -> T:
        # New rows are stamped with the scope's tenant; a mismatch is a programming error.
        current = getattr(obj, "tenant_id", None)
        if current is not None and current != self.tenant_id:
            raise ValueError("row belongs to another tenant")
        obj.tenant_id = self.tenant_id
        self.session.add(obj)
        return obj
