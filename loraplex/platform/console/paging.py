"""Paged lists on console pages: a search box and Previous/Next links that keep the page's other parameters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from fastapi import HTTPException, Request
from sqlalchemy import Select
from sqlalchemy.orm import Session

from loraplex.platform.paging import (
    PageParams,
    PagingError,
    fetch_page,
    matching,
    page_params,
    parse_id_cursor,
)


@dataclass(frozen=True)
class Pager:
    search: str  # what the search box shows
    previous_url: str | None
    next_url: str | None


def page_of(request: Request, session: Session, stmt: Select, key: Any, key_of: Callable[[Any], Any], *,
            search_columns: tuple[Any, ...] = (), cursor=parse_id_cursor,
            descending: bool = False) -> tuple[list[Any], Pager]:
    """One page of `stmt` for a console list; a bad parameter is a 400 page that names it."""
    try:
        params = page_params(request.query_params, cursor)
    except PagingError as exc:
        raise HTTPException(400, f"The page address is not valid: {exc}.") from exc
    if params.search and search_columns:
        stmt = stmt.where(matching(params.search, *search_columns))
    rows, has_more = fetch_page(session, stmt, key, params, descending=descending)
    return rows, _pager(request, params, rows, has_more, key_of)


def _pager(request: Request, params: PageParams, rows: list[Any], has_more: bool, key_of) -> Pager:
    kept = [(k, v) for k, v in request.query_params.multi_items() if k not in ("after", "before")]

    def link(**cursor: Any) -> str:
        return f"{request.url.path}?{urlencode(kept + list(cursor.items()))}"

    backwards = params.before is not None and params.after is None
    previous_url = next_url = None
    if rows and (has_more if backwards else params.after is not None):
        previous_url = link(before=key_of(rows[0]))
    if rows and (backwards or has_more):
        next_url = link(after=key_of(rows[-1]))
    elif not rows and (params.after is not None or params.before is not None):
        previous_url = link()  # past the end (rows deleted meanwhile): back to the first page
    return Pager(search=params.search or "", previous_url=previous_url, next_url=next_url)
