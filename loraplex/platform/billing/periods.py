"""UTC days and calendar months as half-open datetime ranges."""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, time, timedelta
from typing import Annotated

from pydantic import BeforeValidator

_PERIOD = re.compile(r"([0-9]{4})-([0-9]{2})")
_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
MAX_REPORT_DAYS = 731


def parse_day(value: object) -> date:
    """A UTC day as reports take it: YYYY-MM-DD and nothing else. date.fromisoformat and pydantic would also
    read "20260101", "2026-W01-1", a midnight with an offset or a Unix timestamp, each a different question
    than the one asked. The message starts with "must", for callers to put the parameter's name before it."""
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, str) and _DAY.fullmatch(text):
        try:
            return date.fromisoformat(text)
        except ValueError:
            raise ValueError(f"must be a day of the calendar written YYYY-MM-DD, got {text!r}") from None
    shown = repr(text if not isinstance(text, str) or len(text) <= 40 else text[:40] + "...")
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        why = ""
    elif isinstance(text, int | float) or text.isdigit():
        why = " (with its dashes: not a number or a Unix timestamp)"
    elif "T" in text or ":" in text or " " in text:
        why = " (a day alone: no time or time zone offset)"
    else:
        why = ""
    raise ValueError(f"must be a date written YYYY-MM-DD, like 2026-12-01{why}; got {shown}")


def _day_input(value: object) -> date:
    return value if type(value) is date else parse_day(value)


# a day in a query or a JSON body: YYYY-MM-DD only (see parse_day)
Day = Annotated[date, BeforeValidator(_day_input)]


def day_start(day: date) -> datetime:
    return datetime.combine(day, time.min, tzinfo=UTC)


def day_range(day: date) -> tuple[datetime, datetime]:
    return day_start(day), day_start(day + timedelta(days=1))


def parse_period(period: str) -> tuple[int, int]:
    match = _PERIOD.fullmatch(period or "")
    if not match or not 1 <= int(match.group(2)) <= 12:
        raise ValueError(f"period must look like 2026-01, got {period!r}")
    year = int(match.group(1))
    # a period's bounds include the first day of the next month, which datetime.date must be able to hold
    if not 1 <= year < 9999:
        raise ValueError(f"period year must be between 0001 and 9998, got {period!r}")
    return year, int(match.group(2))


def checked_period(period: str) -> str:
    """The period itself if it is one parse_period reads; its ValueError otherwise (for validators)."""
    parse_period(period)
    return period


def period_bounds(period: str) -> tuple[date, date]:
    """First day of the month and first day of the next month."""
    year, month = parse_period(period)
    first = date(year, month, 1)
    nxt = date(year + (month == 12), 1 if month == 12 else month + 1, 1)
    return first, nxt


def period_of(day: date) -> str:
    return f"{day.year:04d}-{day.month:02d}"


def previous_period(today: date) -> str:
    return period_of(today.replace(day=1) - timedelta(days=1))


def today_utc() -> date:
    return datetime.now(UTC).date()


def resolve_range(start: date | None, end: date | None, *, today: date | None = None) -> tuple[date, date]:
    """Inclusive [start, end]; defaults to the month to date. Refuses reversed or overlong ranges."""
    today = today or today_utc()
    end = end or today
    start = start or end.replace(day=1)
    if start > end:
        raise ValueError(f"start {start} is after end {end}")
    if end >= date.max:  # a day's range ends at the next day's start, which datetime.date cannot hold
        raise ValueError(f"dates must be before {date.max}")
    if (end - start).days + 1 > MAX_REPORT_DAYS:
        raise ValueError(f"a report covers at most {MAX_REPORT_DAYS} days")
    return start, end


def resolve_rollup_range(start: date, end: date | None, *, today: date | None = None) -> tuple[date, date]:
    """Inclusive [start, end] of days to roll up (end defaults to start). Days after today are refused: their
    rollup would record no usage, and once the day had passed reports would read it instead of its records."""
    today = today or today_utc()
    start, end = resolve_range(start, end or start, today=today)
    if end > today:
        raise ValueError(f"{end} has not begun yet (today is {today}, UTC); a day can be rolled up once it has")
    return start, end


def days_in(start: date, end: date) -> list[date]:
    return [start + timedelta(days=i) for i in range((end - start).days + 1)]


def next_period(period: str) -> str:
    _, nxt = period_bounds(period)
    return period_of(nxt)


def upcoming_periods(n: int = 3, today: date | None = None) -> list[str]:
    """This month and the next n-1: the periods a price change can be scheduled for."""
    out = [period_of(today or today_utc())]
    while len(out) < n:
        out.append(next_period(out[-1]))
    return out
