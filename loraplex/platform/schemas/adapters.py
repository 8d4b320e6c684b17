from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

_FLAGS = {"true": True, "1": True, "false": False, "0": False}


def parse_pin(value: object) -> bool | None:
    """A pin flag, the same wherever one is taken (the admin API's JSON, the console's form): true, false, 1 or
    0 (as JSON values or text), None for none. Anything else is refused, never read as "leave the pin"."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _FLAGS:
        return _FLAGS[value.strip().lower()]
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
    raise ValueError(f"must be true, false, 1 or 0 (or left out to leave the pin as it is), got {shown}")


Pin = Annotated[bool | None, BeforeValidator(parse_pin)]


class AdapterVersionPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True, populate_by_name=True)

    object: Literal["adapter.version"] = "adapter.version"
    id: int
    adapter: str = Field(validation_alias="adapter_name")  # the adapter's name
    model: str | None  # what to send as `model` for exactly this version (`name@version`), while ready
    version: str | None  # what goes after '@' in a model name, once validated
    content_hash: str | None
    status: Literal["pending", "validating", "ready", "failed"]
    error: str | None
    error_code: str | None
    rank: int | None
    target_modules: str | None
    upload_filename: str
    upload_bytes: int
    created_at: datetime
    ready_at: datetime | None
    pinned: bool = False  # an operator keeps it in the engines' cache (never evicted)


class AdapterPublic(BaseModel):
    object: Literal["adapter"] = "adapter"
    id: str  # the name, as OpenAI names models by id
    name: str
    description: str | None
    status: str  # "ready" while any version is ready (servable), else the newest version's status
    latest_version: str | None  # newest ready version
    created_at: datetime
    versions: list[AdapterVersionPublic]


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterPublic]
    first_id: str | None = None  # the first adapter's id (its name) on this page: `before` for the page before
    last_id: str | None = None  # the last one's: `after` for the next page
    has_more: bool = False


class AdapterVersionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterVersionPublic]


class AdapterDeleted(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    deleted: bool = True


class AdapterVersionDeleted(BaseModel):
    id: int
    object: Literal["adapter.version"] = "adapter.version"
    deleted: bool = True
    adapter: str
    adapter_deleted: bool  # it was the adapter's last version: the adapter is gone too


class PrefetchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    pin: Pin = None  # true (1) pins, false (0) unpins, left out (or null) leaves the pin as it is
