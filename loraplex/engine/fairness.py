"""Tenant fairness in the spirit of S-LoRA's virtual token counter (VTC).

Each tenant accumulates the service it received (weighted prompt and output tokens). The scheduler admits
from the tenant with the least service first. A tenant that comes back after being idle is lifted to the
least counter among backlogged tenants, so idling does not bank credit to burst with later.
"""

from __future__ import annotations


class VirtualTokenCounter:
    def __init__(self, prompt_weight: float = 1.0, output_weight: float = 2.0):
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}

    def on_arrival(self, tenant: str, backlogged: set[str]) -> None:
        """A request of `tenant` arrives; `backlogged` are the tenants with queued or running work."""
        others = [self.counters.get(t, 0.0) for t in backlogged if t != tenant]
        if tenant not in backlogged and others:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(others))
        else:
            self.counters.setdefault(tenant, 0.0)

    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        self.counters[tenant] = (
            self.counters.get(tenant, 0.0) + self.prompt_weight * prompt_tokens + self.output_weight * output_tokens
        )

    def counter(self, tenant: str) -> float:
        """The service `tenant` received so far (0 for one never seen)."""
        return self.counters.get(tenant, 0.0)

    def order(self, tenants, tiebreak=None) -> list[str]:
        """Tenants from least to most service received; `tiebreak(tenant)` orders equal ones (a tenant just
        arrived is level with the least-served backlogged one)."""
        if tiebreak is None:
            return sorted(tenants, key=lambda t: self.counters.get(t, 0.0))
        return sorted(tenants, key=lambda t: (self.counters.get(t, 0.0), tiebreak(t)))
