"""Money as integers: amounts in micro-units of the currency, prices in micro-units per million tokens.

Rounding rule (applied once per statement line, never per request or per day):

    amount = floor((tokens * price_per_million + 500_000) / 1_000_000)

that is, round half up to the nearest micro-unit. Because every line is rounded exactly once and the
statement total is the plain sum of its lines, a statement always adds up, and anyone can recompute
it from the token counts and unit prices printed on it.
"""

from __future__ import annotations

import re
from decimal import Decimal

MICROS_PER_UNIT = 1_000_000
TOKENS_PER_PRICE_UNIT = 1_000_000
MAX_PRICE_MICROS = 10**15  # a billion currency units per million tokens: a typo, not a price


def line_amount(tokens: int, price_micros_per_million: int) -> int:
    """Amount in micro-units for `tokens` at `price_micros_per_million`, rounded half up once."""
    if tokens < 0 or price_micros_per_million < 0:
        raise ValueError("tokens and prices are never negative")
    return (tokens * price_micros_per_million + TOKENS_PER_PRICE_UNIT // 2) // TOKENS_PER_PRICE_UNIT


def exact_amount_numerator(tokens: int, price_micros_per_million: int) -> int:
    """The unrounded amount scaled by 1e6 (micro-micro-units): daily charts sum these and round at display."""
    return tokens * price_micros_per_million


# A price as people write it: digits with at most one decimal point. Python's Decimal also reads exponents
# ("1e999999", whose scaling overflows), "NaN", "Infinity", signs, "_" separators and other scripts' digits;
# none of those is how an amount is written, so none reaches Decimal.
_PLAIN_DECIMAL = re.compile(r"(?=\.?[0-9])([0-9]*)(?:\.([0-9]*))?")
MAX_AMOUNT_CHARS = 40  # far more than a price of 10 integer digits and 6 decimals, with trailing zeros


def parse_money(text: str | int | Decimal) -> int:
    """"0.25" -> 250000 micro-units. Only plain decimal numbers: no sign, exponent, NaN or infinity, at most
    6 decimals, at most MAX_PRICE_MICROS."""
    if isinstance(text, bool):
        raise ValueError("not an amount")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"amount must not be negative, got {text}")
        if text > MAX_PRICE_MICROS // MICROS_PER_UNIT:
            raise ValueError(f"amount is implausibly large: {text} (at most {MAX_PRICE_MICROS // MICROS_PER_UNIT})")
        return text * MICROS_PER_UNIT
    if isinstance(text, Decimal):
        if not text.is_finite() or text.is_signed() or text.adjusted() > 20:
            raise ValueError(f"amount must be a finite, non-negative number of plausible size: {text!r}")
        text = format(text, "f")
    value = str(text).strip()
    shown = value if len(value) <= MAX_AMOUNT_CHARS else value[:MAX_AMOUNT_CHARS] + "..."
    if len(value) > MAX_AMOUNT_CHARS:
        raise ValueError(f"amount is too long ({len(value)} characters): {shown!r}")
    match = _PLAIN_DECIMAL.fullmatch(value) if value.isascii() else None
    if match is None:
        if value[:1] in "-+" and _PLAIN_DECIMAL.fullmatch(value[1:]):
            raise ValueError(f"amount must be a number without a sign (prices are never negative), got {shown!r}")
        raise ValueError(f"amount must be a plain decimal number such as 0.25 (digits and at most one decimal "
                         f"point; no sign, exponent or separators), got {shown!r}")
    units, frac = match.group(1) or "0", (match.group(2) or "").rstrip("0")
    if len(frac) > 6:
        raise ValueError(f"amount has more than 6 decimals: {shown!r}")
    units = units.lstrip("0") or "0"
    if len(units) > len(str(MAX_PRICE_MICROS // MICROS_PER_UNIT)):
        raise ValueError(f"amount is implausibly large: {shown!r}")
    result = int(units) * MICROS_PER_UNIT + int(frac.ljust(6, "0"))
    if result > MAX_PRICE_MICROS:
        raise ValueError(f"amount is implausibly large: {shown!r}")
    return result


def format_micros(amount: int, *, places: int = 6) -> str:
    """250000 -> "0.250000"; places < 6 rounds half up for display only."""
    if places < 0 or places > 6:
        raise ValueError("places must be between 0 and 6")
    sign = "-" if amount < 0 else ""
    amount = abs(amount)
    scale = 10 ** (6 - places)
    scaled = (amount + scale // 2) // scale
    if places == 0:
        return f"{sign}{scaled}"
    units, frac = divmod(scaled, 10**places)
    return f"{sign}{units}.{frac:0{places}d}"
