"""Output types of every kind, shared by tests/test_output_types.py and its subprocesses.

Importing this module imports pydantic (the pydantic models are defined here).
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from typing import Literal, NotRequired, TypedDict

from pydantic import BaseModel, ConfigDict, Field, HttpUrl, RootModel, field_validator


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


# ------------------------------------------------------------------ dataclasses


@dataclasses.dataclass
class DcItem:
    label: str
    score: float


@dataclasses.dataclass
class DcBasket:
    """A basket of items."""

    owner: str
    items: list[DcItem]
    note: str | None = None
    color: Color = Color.RED
    mode: Literal["fast", "slow"] = "fast"
    tags: list[str] = dataclasses.field(default_factory=list)


# ------------------------------------------------------------------ TypedDicts


class TdPoint(TypedDict):
    x: int
    y: int


class TdShape(TypedDict):
    name: str
    points: list[TdPoint]
    color: Literal["red", "blue"]
    closed: NotRequired[bool | None]


# ------------------------------------------------------------------ pydantic


class PItem(BaseModel):
    label: str = Field(description="what the item is")
    score: float = Field(ge=0, le=1)


class Cat(BaseModel):
    kind: Literal["cat"]
    meows: int


class Dog(BaseModel):
    kind: Literal["dog"]
    barks: bool


class PBasket(BaseModel):
    """A basket of items."""

    owner: str
    items: list[PItem]
    first: PItem = Field(description="the first item")
    note: str | None = None
    color: Color = Color.RED
    mode: Literal["fast", "slow"] = "fast"
    pet: Cat | Dog = Field(discriminator="kind")
    count: int = Field(default=0, ge=0)
    seen: datetime.date | None = None

    @field_validator("owner")
    @classmethod
    def owner_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("owner must not be blank")
        return value


class TreeNode(BaseModel):
    """Recursive, with two ways out: no children, or no next sibling."""

    name: str
    children: list[TreeNode]
    next: TreeNode | None = None


class Forest(BaseModel):
    trees: list[TreeNode]
    largest: TreeNode | None


class Loop(BaseModel):
    """Recursive with no way out: no finite instance."""

    name: str
    inner: Loop


class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: int


# Refused constructs, one per model (each names its field).
class WithDict(BaseModel):
    scores: dict[str, int]


class WithSet(BaseModel):
    tags: set[str]


class WithTuple(BaseModel):
    pair: tuple[int, str]


class WithAny(BaseModel):
    blob: object


class WithMaxLength(BaseModel):
    inner: PItem
    code: str = Field(max_length=3)


class WithUri(BaseModel):
    link: HttpUrl


class Nested(BaseModel):
    holder: WithDict


@dataclasses.dataclass
class DcWithBytes:
    data: bytes


class Listing(RootModel[list[int]]):
    pass


class Plain:
    """Not an output type at all."""

    value: int
