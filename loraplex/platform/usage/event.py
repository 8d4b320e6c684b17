from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime


def _column_widths() -> dict[str, int]:
    from loraplex.platform.models import UsageRecord

    return {c.name: c.type.length for c in UsageRecord.__table__.columns if getattr(c.type, "length", None)}


@dataclass(frozen=True)
class UsageEvent:
    request_id: str
    tenant_id: int
    api_key_id: int | None
    model: str
    adapter_name: str | None
    adapter_version: str | None
    endpoint: str
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: int | None
    latency_ms: int
    status: str  # ok | cancelled | error | interrupted (settled from a checkpoint after a crash)
    end_user: str | None
    created_at: str  # ISO 8601, UTC

    @staticmethod
    def now_iso() -> str:
        return datetime.now(UTC).isoformat()

    def to_json(self) -> str:
        # Every field is a plain value: the instance dict serializes as is (asdict's deep copy cost more
        # than the JSON encoding on the request path).
        return json.dumps(vars(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str | bytes) -> UsageEvent:
        return cls(**json.loads(line))

    def to_row(self) -> dict:
        row = asdict(self)
        for key, value in row.items():
            # What PostgreSQL would refuse (NUL, a string past its column's width) must never drop the record:
            # the API refuses such values where it can, this is the last line.
            if isinstance(value, str):
                if "\x00" in value:
                    value = value.replace("\x00", "\ufffd")
                width = _WIDTHS.get(key)
                row[key] = value[:width] if width is not None else value
        row["created_at"] = datetime.fromisoformat(self.created_at)
        return row


_WIDTHS = _column_widths()
