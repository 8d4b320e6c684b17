from __future__ import annotations

import unicodedata
from datetime import UTC, date, datetime, time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from loraplex.platform.models import ALL_SCOPES
from loraplex.platform.schemas.text import DbText

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


def _character(c: str) -> str:
    return f"U+{ord(c):04X}" + (f" {unicodedata.name(c)}" if unicodedata.name(c, "") else "")


def refuse_control_characters(value: str) -> str:
    """A free-text name (a key's) is printed by the CLI, in the console and in CSV exports: no newline, tab or
    terminal escape may ride in it, nor an invisible format character (category Cf: the bidirectional
    overrides and isolates U+202A-U+202E and U+2066-U+2069, which make "lpx-gnp.exe" read as "lpx-exe.png",
    the zero-width space and joiners, the byte order mark), nor a line or paragraph separator, which make
    two names that look the same differ."""
    for c in value:
        category = unicodedata.category(c)
        if category in ("Cc", "Zl", "Zp"):
            raise ValueError(f"must not contain control characters or line breaks (found {_character(c)})")
        if category == "Cf":
            raise ValueError(f"must not contain invisible characters such as bidirectional overrides or "
                             f"zero-width characters (found {_character(c)})")
    return value


def parse_expiry(text: str) -> datetime:
    """An API key's expiry as written in ISO 8601: a date (the key stops at 00:00 UTC that day) or a date and
    time (UTC unless it names an offset)."""
    text = text.strip()
    try:
        if len(text) == 10:
            return datetime.combine(date.fromisoformat(text), time.min, UTC)
        value = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"must be an ISO 8601 date or time, such as 2027-01-31 or 2027-01-31T12:00:00Z; got "
                         f"{text!r}") from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def future_expiry(value: datetime) -> datetime:
    value = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    try:
        in_utc = value.astimezone(UTC)
    except OverflowError:  # 9999-12-31T23:00-05:00 is in year 10000 in UTC; 0001-01-01T00:00+05:00 before year 1
        raise ValueError(f"{value.isoformat()} is outside the years 1 to 9999 in UTC") from None
    if in_utc <= datetime.now(UTC):
        raise ValueError(f"{in_utc:%Y-%m-%d %H:%M:%S} UTC has passed: a key's expiry must be in the future")
    return in_utc


# Quotas are stored in INTEGER (32-bit on PostgreSQL) and BIGINT columns: larger numbers are refused here
# rather than failing in the database.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# the largest value of each quota: the one limit the API, the CLI and the console's forms all check against
QUOTA_MAX = {
    "requests_per_minute": INT32_MAX,
    "tokens_per_minute": INT32_MAX,
    "max_concurrent": INT32_MAX,
    "monthly_token_budget": INT64_MAX,
}


class QuotaFields(BaseModel):
    requests_per_minute: int | None = Field(default=None, ge=1, le=QUOTA_MAX["requests_per_minute"])
    tokens_per_minute: int | None = Field(default=None, ge=1, le=QUOTA_MAX["tokens_per_minute"])
    max_concurrent: int | None = Field(default=None, ge=1, le=QUOTA_MAX["max_concurrent"])
    monthly_token_budget: int | None = Field(default=None, ge=1, le=QUOTA_MAX["monthly_token_budget"])


class PlanBase(BaseModel):
    name: str = Field(pattern=NAME_PATTERN)
    requests_per_minute: int = Field(ge=1, le=QUOTA_MAX["requests_per_minute"])
    tokens_per_minute: int = Field(ge=1, le=QUOTA_MAX["tokens_per_minute"])
    max_concurrent: int = Field(ge=1, le=QUOTA_MAX["max_concurrent"])
    monthly_token_budget: int = Field(ge=1, le=QUOTA_MAX["monthly_token_budget"])


class PlanCreate(PlanBase):
    # a misspelt field is refused, not silently dropped; "600" or true for a number is refused, not converted
    model_config = ConfigDict(extra="forbid", strict=True)


class PlanUpdate(BaseModel):
    """Any of a plan's quotas, or its name; a field left out keeps its value. A plan's quotas are never empty
    (its tenants fall back on them), so null is refused."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str | None = Field(default=None, pattern=NAME_PATTERN)
    requests_per_minute: int | None = Field(default=None, ge=1, le=QUOTA_MAX["requests_per_minute"])
    tokens_per_minute: int | None = Field(default=None, ge=1, le=QUOTA_MAX["tokens_per_minute"])
    max_concurrent: int | None = Field(default=None, ge=1, le=QUOTA_MAX["max_concurrent"])
    monthly_token_budget: int | None = Field(default=None, ge=1, le=QUOTA_MAX["monthly_token_budget"])


class PlanPublic(PlanBase):
    model_config = ConfigDict(from_attributes=True)
    id: int
    created_at: datetime


class TenantBase(QuotaFields):
    name: str = Field(pattern=NAME_PATTERN, description="unique; letters, digits, '.', '_', '-'; not digits only")

    @field_validator("name")
    @classmethod
    def _not_an_id(cls, value: str) -> str:
        # the CLI takes a tenant's name or its id: a name of digits only would read as another tenant's id
        if value.isdigit():
            raise ValueError("a tenant name must not be digits only (it would read as a tenant id)")
        return value


class TenantCreate(TenantBase):
    plan: DbText | None = Field(default=None, description="name of an existing plan")
    model_config = ConfigDict(extra="forbid", strict=True)


class TenantUpdate(QuotaFields):
    plan: DbText | None = None
    status: Literal["active", "suspended"] | None = None
    # explicit nulls clear an override back to the plan's value
    model_config = ConfigDict(extra="forbid", strict=True)


class EffectiveQuotas(BaseModel):
    requests_per_minute: int
    tokens_per_minute: int
    max_concurrent: int
    monthly_token_budget: int


class TenantPublic(TenantBase):
    id: int
    status: str
    plan: str | None
    created_at: datetime
    quotas: EffectiveQuotas


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: DbText = Field(default="default", min_length=1, max_length=64)
    scopes: list[str] = Field(default_factory=lambda: list(ALL_SCOPES))
    # text in JSON, hence not strict; numbers (Unix times?) are refused rather than guessed at
    expires_at: datetime | None = Field(default=None, strict=False, description=(
        "when the key stops working: an ISO 8601 date (00:00 UTC that day) or time (UTC unless it says "
        "otherwise); null or left out: never"))

    @field_validator("name")
    @classmethod
    def _printable_name(cls, name: str) -> str:
        return refuse_control_characters(name)

    @field_validator("expires_at", mode="before")
    @classmethod
    def _expiry_text(cls, value):
        if value is None or isinstance(value, datetime):
            return value
        if not isinstance(value, str):
            raise ValueError("must be an ISO 8601 date or time, such as 2027-01-31 or 2027-01-31T12:00:00Z")
        return parse_expiry(value)

    @field_validator("expires_at")
    @classmethod
    def _in_the_future(cls, value: datetime | None) -> datetime | None:
        return None if value is None else future_expiry(value)

    @field_validator("scopes")
    @classmethod
    def _known_scopes(cls, scopes: list[str]) -> list[str]:
        unknown = sorted(set(scopes) - set(ALL_SCOPES))
        if unknown:
            raise ValueError(f"unknown scope(s) {unknown}; known: {list(ALL_SCOPES)}")
        if not scopes:
            raise ValueError("a key needs at least one scope")
        return sorted(set(scopes))


class KeyPublic(BaseModel):
    id: int
    tenant_id: int
    name: str
    prefix: str
    scopes: list[str]
    created_at: datetime
    revoked_at: datetime | None
    expires_at: datetime | None = None
    last_used_at: datetime | None = Field(default=None, description="to the minute: written once a minute")


class KeyCreated(KeyPublic):
    key: str = Field(description="the secret; shown only in this response")


class AdminKeyPublic(BaseModel):
    id: int
    name: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
