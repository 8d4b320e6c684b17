"""From token totals to statement lines: the only place where money is rounded."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from loraplex.platform.billing.money import line_amount
from loraplex.platform.billing.pricing import Price

BASE_MODEL = ""  # adapter label of requests served by the base model alone


@dataclass(frozen=True)
class UsageGroup:
    """Token totals of one tenant's requests in a period for one adapter (or the base model)."""

    adapter: str  # "name@version", or BASE_MODEL
    requests: int
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Line:
    adapter: str
    component: str  # prompt | completion | adapter_surcharge
    tokens: int
    unit_price: int  # micro-units per million tokens
    amount: int  # micro-units, rounded once (money.line_amount)


COMPONENTS = ("prompt", "completion", "adapter_surcharge")


def build_lines(groups: Iterable[UsageGroup], price: Price) -> list[Line]:
    """One line per adapter and component with tokens; zero-token lines are left out.

    Lines are ordered (base model first, then adapters by name) so a statement renders the same every time.
    """
    lines: list[Line] = []
    merged: dict[str, list[int]] = {}
    for group in groups:
        totals = merged.setdefault(group.adapter, [0, 0])
        totals[0] += group.prompt_tokens
        totals[1] += group.completion_tokens
    for adapter in sorted(merged):
        prompt, completion = merged[adapter]
        quantities = {"prompt": prompt, "completion": completion}
        if adapter != BASE_MODEL:
            quantities["adapter_surcharge"] = prompt + completion
        for component in COMPONENTS:
            tokens = quantities.get(component, 0)
            if tokens == 0:
                continue
            unit_price = getattr(price, component)
            lines.append(Line(adapter, component, tokens, unit_price, line_amount(tokens, unit_price)))
    return lines


def total_amount(lines: Iterable[Line]) -> int:
    return sum(line.amount for line in lines)
