"""Typed values: what the domain reads instead of AWS wire dicts, stored in their wire shape.

A value is a frozen pydantic model whose fields are snake_case in Python and PascalCase on the
wire (the alias), so the stored JSON is byte-for-byte what the API answered before the values
existed, and old rows load unchanged (no migration). The API converts wire to value on the way
in (`from_wire`) and back on the way out (`wire()`); the domain works only with attributes, so
strict mypy sees a misspelled member.

`ValueJSON(Model)` is the column type that stores one such value (or a list of them) in a JSON
column. Values are frozen: change one with `model_copy(update=...)` and assign it back, which is
also what makes SQLAlchemy see the change (a JSON column does not track in-place mutation).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter
from pydantic.alias_generators import to_pascal
from sqlalchemy import JSON
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

T = TypeVar("T")


class WireValue(BaseModel):
    """A frozen value with PascalCase wire names; members the model does not name are kept as sent."""

    model_config = ConfigDict(frozen=True, alias_generator=to_pascal, populate_by_name=True, extra="allow")

    @classmethod
    def from_wire(cls, data: Any) -> Any:
        """The value of a wire (or stored) dict; a pydantic ValidationError if it does not fit."""
        return cls.model_validate(data)

    def wire(self) -> dict[str, Any]:
        """The AWS shape: PascalCase members, unset (None) members left out."""
        dumped: dict[str, Any] = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        return dumped


class ValueJSON(TypeDecorator[T], Generic[T]):
    """A JSON column holding a typed value (or a list of them) in its wire shape."""

    impl = JSON
    cache_ok = True

    def __init__(self, kind: Any) -> None:
        super().__init__()
        self.kind = kind
        self.adapter: TypeAdapter[Any] = TypeAdapter(kind)

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        if value is None:
            return None
        return self.adapter.dump_python(value, mode="json", by_alias=True, exclude_none=True)

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        if value is None:
            return None
        return self.adapter.validate_python(value)
