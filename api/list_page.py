"""OpenAI's list shape, shared by every paginated endpoint: {object, data, first_id, last_id, has_more}."""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from pydantic import BaseModel

Item = TypeVar("Item", bound=BaseModel)


class ListPage(BaseModel, Generic[Item]):
    object: Literal["list"] = "list"
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool

    @classmethod
    def of(cls, data: list[Item], has_more: bool) -> "ListPage[Item]":
        """A page of `data` (items with an `id`); pass `last_id` as `after` for the next one."""
        return cls(
            data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None, has_more=has_more
        )
