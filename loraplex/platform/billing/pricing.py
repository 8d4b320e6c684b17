"""Effective prices: the plan's price list, with any per-tenant override field by field."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CURRENCY = "USD"


@dataclass(frozen=True)
class Price:
    """Micro-units of `currency` per million tokens."""

    prompt: int
    completion: int
    adapter_surcharge: int  # added per million tokens (prompt + completion) of requests that use an adapter
    currency: str = DEFAULT_CURRENCY

    def __post_init__(self) -> None:
        for name in ("prompt", "completion", "adapter_surcharge"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"price {name} must be a non-negative integer of micro-units, got {value!r}")
        if len(self.currency) != 3 or not (self.currency.isascii() and self.currency.isalpha() and self.currency.isupper()):
            raise ValueError(f"currency must be a 3-letter ISO code, got {self.currency!r}")


def known_currency(code: str) -> str:
    """`code` if it is an ISO 4217 currency code (as prices are entered: stored prices are read as they are)."""
    import pycountry

    if not (isinstance(code, str) and len(code) == 3 and pycountry.currencies.get(alpha_3=code)):
        raise ValueError(f"currency must be a 3-letter ISO code (ISO 4217, such as USD or EUR), got {code[:20]!r}")
    return code


@dataclass(frozen=True)
class PriceOverride:
    """Per-tenant exceptions; None keeps the plan's value."""

    prompt: int | None = None
    completion: int | None = None
    adapter_surcharge: int | None = None


FREE = Price(prompt=0, completion=0, adapter_surcharge=0)


def effective_price(plan_price: Price | None, override: PriceOverride | None) -> Price:
    """A tenant on a plan without a price list pays nothing unless an override says otherwise."""
    base = plan_price or FREE
    if override is None:
        return base
    return Price(
        prompt=base.prompt if override.prompt is None else override.prompt,
        completion=base.completion if override.completion is None else override.completion,
        adapter_surcharge=(
            base.adapter_surcharge if override.adapter_surcharge is None else override.adapter_surcharge
        ),
        currency=base.currency,
    )
