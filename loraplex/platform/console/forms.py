"""Reading HTML form fields into typed values with messages a person can act on."""

from __future__ import annotations

from starlette.datastructures import FormData

from loraplex.platform.billing.money import parse_money
from loraplex.platform.models import MAX_ROW_ID
from loraplex.platform.schemas.tenants import INT64_MAX


class FormError(ValueError):
    pass


def text(form: FormData, name: str, *, required: bool = False) -> str | None:
    value = form.get(name)
    value = value.strip() if isinstance(value, str) else ""
    if "\x00" in value:  # never storable (PostgreSQL) nor part of any name or amount
        raise FormError(f"{name.replace('_', ' ')} must not contain NUL characters")
    if required and not value:
        raise FormError(f"{name.replace('_', ' ')} is required")
    return value or None


def positive_int(form: FormData, name: str, *, required: bool = False, maximum: int = INT64_MAX) -> int | None:
    """A whole number from 1 to `maximum` (by default what a BIGINT column holds; a quota passes its own
    QUOTA_MAX, so the console accepts exactly what the API and the CLI accept)."""
    value = text(form, name, required=required)
    if value is None:
        return None
    label = name.replace("_", " ")
    digits = value.replace(",", "").replace("_", "")  # "1,000" as people write it
    negative = digits.startswith("-")
    digits = digits.removeprefix("-")
    # ASCII digits only: int() would also read "١٢" (Arabic-Indic) as 12
    if not (digits.isascii() and digits.isdigit()):
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise FormError(f"{label} must be a whole number, got {shown!r}")
    if len(digits.lstrip("0")) > len(str(maximum)):  # never int() thousands of digits
        raise FormError(f"{label} is too large ({len(digits)} digits; at most {maximum})")
    number = -int(digits) if negative else int(digits)
    if number < 1:
        raise FormError(f"{label} must be at least 1")
    if number > maximum:
        raise FormError(f"{label} is too large (at most {maximum})")
    return number


def row_id(form: FormData, name: str) -> int | None:
    """The id of a row (a plan's, say): a whole number the database's ids can hold, or None when empty."""
    value = text(form, name)
    if value is not None and value.isascii() and value.isdigit() and len(value) > len(str(MAX_ROW_ID)):
        raise FormError(f"{name.replace('_', ' ')} {value[:12]}... is not an id that can exist")
    number = positive_int(form, name)
    if number is not None and number > MAX_ROW_ID:
        raise FormError(f"{name.replace('_', ' ')} {number} is not an id that can exist")
    return number


def money(form: FormData, name: str) -> int | None:
    value = text(form, name)
    if value is None:
        return None
    try:
        return parse_money(value)
    except ValueError as exc:
        raise FormError(f"{name.replace('_', ' ')}: {exc}") from exc
