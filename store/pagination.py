"""Keyset pagination, newest first, over any table with `created_at` and `id` (OpenAI's cursor:
a page's last id is the next request's `after`).

(created_at, id) is a total order, so a page boundary never skips or repeats a row even when
rows share a timestamp. The boundary is one row-value comparison, `(created_at, id) < (x, y)`,
which Postgres turns into the start of a backward index range scan on an index that begins
with (created_at) or (<filter column>, created_at): a page reads `limit + 1` index entries
however deep it is, where OFFSET (or an OR of the two conditions, which an index cannot
start from) would read every row before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from sqlalchemy import Select, tuple_
from sqlalchemy.orm import Session

Row = TypeVar("Row")


@dataclass(slots=True)
class Page(Generic[Row]):
    rows: list[Row]
    has_more: bool


def page_after(session: Session, query: Select, model, cursor, limit: int, *, ascending: bool = False) -> Page:
    """`query` selects `model` rows already filtered; `cursor` is the row of the previous page's
    last id (None for the first page)."""
    key = tuple_(model.created_at, model.id)
    if ascending:
        if cursor is not None:
            query = query.where(key > tuple_(cursor.created_at, cursor.id))
        query = query.order_by(model.created_at.asc(), model.id.asc())
    else:
        if cursor is not None:
            query = query.where(key < tuple_(cursor.created_at, cursor.id))
        query = query.order_by(model.created_at.desc(), model.id.desc())
    rows = list(session.execute(query.limit(limit + 1)).scalars())
    return Page(rows[:limit], len(rows) > limit)
