from __future__ import annotations

from datetime import date
from typing import Literal

from pydantic import BaseModel


class UsageBucket(BaseModel):
    date: date
    adapter: str | None  # None: the base model
    adapter_version: str | None
    requests: int
    failed_requests: int  # of `requests`: failed on the server's side; their tokens are not counted (nor billed)
    # of `requests`: cut off by the end of their server process (a kill, a lost machine), recorded after its
    # restart with the tokens of their last checkpoint (counted and billed)
    interrupted_requests: int = 0
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class UsageReport(BaseModel):
    object: Literal["list"] = "list"
    start: date
    end: date
    data: list[UsageBucket]
