"""Paged lists on console pages: a search box and Previous/Next links that keep the page's other parameters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

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
    prefix: str = ""  # of the list's parameter names, where a page has two lists (`plans_q`, `plans_after`)

    @property
    def search_param(self) -> str:
        return f"{self.prefix}q"


def page_of(request: Request, session: Session, stmt: Select, key: Any, key_of: Callable[[Any], Any], *,
            search_columns: tuple[Any, ...] = (), cursor=parse_id_cursor,
            descending: bool = False, prefix: str = "") -> tuple[list[Any], Pager]:
    """One page of `stmt` for a console list; a bad parameter is a 400 page that names it. `prefix` names the
    list's parameters (`{prefix}q`, `{prefix}limit`, ...) beside another list's on the same page."""
    query = {name[len(prefix):]: value for name, value in request.query_params.items() if name.startswith(prefix)}
    try:
        params = page_params(query, cursor)
    except PagingError as exc:
        raise HTTPException(400, f"The page address is not valid: {prefix}{exc}.") from exc
    if params.search and search_columns:
        stmt = stmt.where(matching(params.search, *search_columns))
    rows, has_more = fetch_page(session, stmt, key, params, descending=descending)
    return rows, _pager(request, params, rows, has_more, key_of, prefix)


def _pager(request: Request, params: PageParams, rows: list[Any], has_more: bool, key_of, prefix: str) -> Pager:
    after, before = f"{prefix}after", f"{prefix}before"
    kept = [(k, v) for k, v in request.query_params.multi_items() if k not in (after, before)]

    def link(**cursor: Any) -> str:
        return f"{request.url.path}?{urlencode(kept + [(prefix + k, v) for k, v in cursor.items()])}"

    backwards = params.before is not None and params.after is None
    previous_url = next_url = None
    if rows and (has_more if backwards else params.after is not None):
        previous_url = link(before=key_of(rows[0]))
    if rows and (backwards or has_more):
        next_url = link(after=key_of(rows[-1]))
    elif not rows and (params.after is not None or params.before is not None):
        previous_url = link()  # past the end (rows deleted meanwhile): back to the first page
    return Pager(search=params.search or "", previous_url=previous_url, next_url=next_url, prefix=prefix)


def back_to(request: Request, path: str) -> str:
    """Where a form posted from a paged list goes back to: the page of the list it was posted from (the
    referring page, when it is `path` on this host), so a row edited on the third page is shown again."""
    referer = urlsplit(request.headers.get("referer") or "")
    if referer.netloc == request.headers.get("host", "") and referer.path == path:
        return path + (f"?{referer.query}" if referer.query else "")
    return path
