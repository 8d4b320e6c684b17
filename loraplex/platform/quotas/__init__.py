"""Per-tenant quotas: requests/min, tokens/min, concurrent requests, monthly token budget."""

from loraplex.platform.quotas.base import QuotaExceeded, QuotaLimiter, QuotaLimits, Reservation

__all__ = ["QuotaExceeded", "QuotaLimiter", "QuotaLimits", "Reservation"]
