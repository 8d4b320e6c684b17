"""CSV and JSON renderings of report rows and statements; amounts as exact decimal strings, never floats."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable

from loraplex.platform.billing.money import format_micros
from loraplex.platform.billing.statements import StatementView

AMOUNT_FIELDS = ("amount", "total_amount", "unit_price")


def rows_to_csv(rows: Iterable[dict], columns: Iterable[str] | None = None) -> str:
    """CSV with a header line; with no rows, the header of `columns` alone (a file a spreadsheet or a script
    reads as empty, rather than no file at all)."""
    rows = list(rows)
    buf = io.StringIO()
    if not rows and columns is None:
        return ""
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else list(columns), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _cell(k, v) for k, v in row.items()})
    return buf.getvalue()


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _cell(key: str, value):
    if key in AMOUNT_FIELDS and isinstance(value, int):
        return format_micros(value)
    if key == "amounts" and isinstance(value, dict):  # "EUR 1.250000; USD 0.300000"
        return "; ".join(f"{currency} {format_micros(amount)}" for currency, amount in value.items())
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        # a key name like "=HYPERLINK(...)" must stay text when finance opens the file in a spreadsheet
        return "'" + value
    return "" if value is None else value


def with_decimal_amounts(row: dict) -> dict:
    """JSON keeps the integer micro-units and adds the decimal string next to each amount."""
    out = dict(row)
    for key in AMOUNT_FIELDS:
        if isinstance(row.get(key), int):
            out[f"{key}_decimal"] = format_micros(row[key])
        elif key in row and row[key] is None:  # a row with no one amount (several currencies)
            out[f"{key}_decimal"] = None
    if isinstance(row.get("amounts"), dict):
        out["amounts_decimal"] = {currency: format_micros(v) for currency, v in row["amounts"].items()}
    return out


def statement_dict(view: StatementView) -> dict:
    return {
        "tenant_id": view.tenant_id,
        "tenant": view.tenant,
        "period": view.period,
        "status": view.status,
        "currency": view.currency,
        "requests": view.requests,
        "prompt_tokens": view.prompt_tokens,
        "completion_tokens": view.completion_tokens,
        "total_amount": view.total_amount,
        "total_amount_decimal": format_micros(view.total_amount),
        "generated_at": view.generated_at.isoformat() if view.generated_at else None,
        "rounding": "each line: round half up to the micro-unit of tokens x unit_price / 1e6; total = sum of lines",
        "lines": [
            {
                "adapter": line.adapter or None,
                "component": line.component,
                "tokens": line.tokens,
                "unit_price": line.unit_price,
                "unit_price_decimal": format_micros(line.unit_price),
                "amount": line.amount,
                "amount_decimal": format_micros(line.amount),
            }
            for line in view.lines
        ],
    }


def statement_csv(view: StatementView) -> str:
    rows = [
        {
            "tenant": view.tenant, "period": view.period, "status": view.status, "currency": view.currency,
            "adapter": line.adapter or "base model", "component": line.component, "tokens": line.tokens,
            "unit_price": line.unit_price, "amount": line.amount,
        }
        for line in view.lines
    ]
    rows.append({
        "tenant": view.tenant, "period": view.period, "status": view.status, "currency": view.currency,
        "adapter": "", "component": "total", "tokens": view.prompt_tokens + view.completion_tokens,
        "unit_price": None, "amount": view.total_amount,
    })
    return rows_to_csv(rows)


def to_json(data) -> str:
    return json.dumps(data, indent=2, sort_keys=False)


def statements_summary_csv(views: list[StatementView]) -> str:
    """One row per statement: the totals a finance import needs, lines left to the per-statement export."""
    skip = {"lines", "rounding", "total_amount_decimal"}
    return rows_to_csv({k: v for k, v in statement_dict(view).items() if k not in skip} for view in views)
