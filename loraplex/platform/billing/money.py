"""Money as integers: amounts in micro-units of the currency, prices in micro-units per million tokens.

Rounding rule (applied once per statement line, never per request or per day):

    amount = floor((tokens * price_per_million + 500_000) / 1_000_000)

that is, round half up to the nearest micro-unit. Because every line is rounded exactly once and the
statement total is the plain sum of its lines, a statement always adds up, and anyone can recompute
it from the token counts and unit prices printed on it.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

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


def parse_money(text: str | int | Decimal) -> int:
    """"0.25" -> 250000 micro-units. Refuses floats' cousins: more than 6 decimals, negatives, junk."""
    if isinstance(text, bool):
        raise ValueError("not an amount")
    if isinstance(text, int):
        value = Decimal(text)
    else:
        try:
            value = Decimal(str(text).strip())
        except InvalidOperation as exc:
            raise ValueError(f"not an amount: {text!r}") from exc
    if not value.is_finite() or value < 0:
        raise ValueError(f"amount must be a finite, non-negative number: {text!r}")
    micros = value * MICROS_PER_UNIT
    if micros != micros.to_integral_value():
        raise ValueError(f"amount has more than 6 decimals: {text!r}")
    result = int(micros)
    if result > MAX_PRICE_MICROS:
        raise ValueError(f"amount is implausibly large: {text!r}")
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
