"""Response bodies of the billing API. Amounts are integer micro-units, each with its decimal string."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class StatementLinePublic(BaseModel):
    adapter: str | None  # "name@version"; None for the base model
    component: Literal["prompt", "completion", "adapter_surcharge"]
    tokens: int
    unit_price: int  # micro-units per million tokens
    unit_price_decimal: str
    amount: int
    amount_decimal: str


class StatementSummary(BaseModel):
    tenant_id: int
    tenant: str
    period: str
    status: Literal["draft", "final"]
    currency: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_amount: int
    total_amount_decimal: str
    generated_at: str | None
    rounding: str


class StatementPublic(StatementSummary):
    lines: list[StatementLinePublic]


class StatementList(BaseModel):
    object: Literal["list"] = "list"
    data: list[StatementSummary]


class ReportRowPublic(BaseModel):
    """One group of a usage report; only the grouped-by dimensions are present."""

    day: str | None = None
    tenant_id: int | None = None
    tenant: str | None = None
    api_key_id: int | None = None
    key: str | None = None
    adapter: str | None = None
    requests: int
    failed_requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    avg_latency_ms: int | None
    # null when the row spans prices in more than one currency (currency "mixed"): `amounts` splits it
    amount: int | None
    amount_decimal: str | None
    currency: str
    amounts: dict[str, int]  # currency -> amount in micro-units
    amounts_decimal: dict[str, str]


class ReportTotals(BaseModel):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    amounts: dict[str, int]  # currency -> the rows' amounts added up; never summed across currencies
    amounts_decimal: dict[str, str]


class UsageReportPublic(BaseModel):
    object: Literal["usage_report"] = "usage_report"
    start: str
    end: str
    group_by: list[str]
    totals: ReportTotals
    data: list[ReportRowPublic]
    note: str


CSV_OR_JSON = {"content": {"text/csv": {"schema": {"type": "string"}}}}
