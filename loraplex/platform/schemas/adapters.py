from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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
    pin: bool | None = None  # true pins, false unpins, left out (or null) leaves the pin as it is
