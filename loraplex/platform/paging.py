"""Cursor pagination in the OpenAI list style, shared by the APIs, the console and the CLI.

A page is `limit` rows ordered by a unique key, after (or before) a cursor: the key of the last (first) row of
the page before. The cursor is a plain key comparison in SQL, so a row deleted between two pages never makes a
page skip or repeat another row, and the database reads no more than `limit + 1` rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel
from sqlalchemy import Select, or_
from sqlalchemy.orm import Session

from loraplex.platform.ids import MAX_ROW_ID, parse_row_id

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
MAX_SEARCH = 200
PAGING_PARAMS = ("limit", "after", "before", "q")

T = TypeVar("T")


class PagingError(ValueError):
    """A page parameter that cannot be used, with the parameter's name."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class PageParams:
    limit: int = DEFAULT_LIMIT
    after: Any = None
    before: Any = None
    search: str | None = None
    requested: bool = False  # any paging parameter was sent (where a bare list is still the default)


class Page(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    first_id: int | str | None
    last_id: int | str | None
    has_more: bool  # more rows past this page, in the direction it was read (after: later rows, before: earlier)


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:40]) + "..."


def parse_limit(text: str | None) -> int:
    if text is None or text == "":
        return DEFAULT_LIMIT
    text = text.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 7 or not 1 <= int(text) <= MAX_LIMIT:
        raise PagingError(f"limit must be a whole number from 1 to {MAX_LIMIT}, got {_shown(text)}", "limit")
    return int(text)


def parse_id_cursor(text: str | None, param: str) -> int | None:
    """An `after`/`before` cursor that is a row id."""
    if text is None or text == "":
        return None
    value = parse_row_id(text.strip())
    if value is None:
        raise PagingError(f"{param} must be an id from a previous page (a whole number from 1 to {MAX_ROW_ID}), "
                          f"got {_shown(text)}", param)
    return value


def parse_name_cursor(text: str | None, param: str) -> str | None:
    """An `after`/`before` cursor that is a name (adapters are listed by name, their id)."""
    if text is None or text == "":
        return None
    if len(text) > 256 or not text.isprintable():
        raise PagingError(f"{param} must be an id from a previous page, got {_shown(text)}", param)
    return text


def parse_search(text: str | None) -> str | None:
    if text is None or text.strip() == "":
        return None
    if len(text) > MAX_SEARCH or not text.isprintable():
        raise PagingError(f"q must be printable text of at most {MAX_SEARCH} characters", "q")
    return text.strip()


def page_params(query: Mapping[str, str], cursor: Callable[[str | None, str], Any] = parse_id_cursor) -> PageParams:
    """Read limit, after, before and q from a query string (or a form); PagingError names the bad one."""
    return PageParams(limit=parse_limit(query.get("limit")), after=cursor(query.get("after"), "after"),
                      before=cursor(query.get("before"), "before"), search=parse_search(query.get("q")),
                      requested=any(name in query for name in PAGING_PARAMS))


def matching(search: str | None, *columns: Any) -> Any:
    """A case-insensitive substring match of `search` on any of `columns`, with LIKE's % and _ (and the escape
    character) in the input taken literally; None when there is nothing to match."""
    if search is None:
        return None
    return or_(*(column.icontains(search, autoescape=True) for column in columns))


def fetch_page(session: Session, stmt: Select, key: Any, params: PageParams, *, scalars: bool = True,
               descending: bool = False) -> tuple[list[Any], bool]:
    """The rows of one page of `stmt`, ordered by the unique column `key` (newest first with `descending`), and
    whether more lie beyond it in the direction it was read."""
    if params.after is not None:
        stmt = stmt.where(key < params.after if descending else key > params.after)
    if params.before is not None:
        stmt = stmt.where(key > params.before if descending else key < params.before)
    backwards = params.before is not None and params.after is None
    stmt = stmt.order_by(key.desc() if descending != backwards else key).limit(params.limit + 1)
    rows = list(session.scalars(stmt) if scalars else session.execute(stmt))
    has_more = len(rows) > params.limit
    rows = rows[:params.limit]
    if backwards:
        rows.reverse()
    return rows, has_more


def make_page(data: list[T], has_more: bool, key_of: Callable[[T], int | str]) -> Page[T]:
    return Page[Any](data=data, first_id=key_of(data[0]) if data else None,
                     last_id=key_of(data[-1]) if data else None, has_more=has_more)
