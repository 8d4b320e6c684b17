"""Usage records: journaled before the response completes, inserted in batches off the request path."""

from loraplex.platform.usage.event import UsageEvent
from loraplex.platform.usage.recorder import UsageRecorder

__all__ = ["UsageEvent", "UsageRecorder"]
