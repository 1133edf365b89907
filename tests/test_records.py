"""consulrun/records.py: immutable records declared like frozen dataclasses, built on namedtuple. Pure."""

from __future__ import annotations

import pytest

from consulrun.records import record


@record
class Point:
    """A point."""

    x: int
    y: int = 0
    label: str = "origin"

    @property
    def norm1(self) -> int:
        return abs(self.x) + abs(self.y)

    @classmethod
    def diagonal(cls, n: int) -> "Point":
        return cls(x=n, y=n, label="diagonal")


def test_fields_in_order_with_their_defaults_by_keyword_or_position() -> None:
    assert Point(1) == Point(x=1, y=0, label="origin") == Point(1, 0, "origin")
    assert Point(3, -4).norm1 == 7 and Point.diagonal(2) == Point(2, 2, "diagonal")
    assert repr(Point(1, 2)) == "Point(x=1, y=2, label='origin')"
    assert Point.__doc__ == "A point." and Point.__module__ == __name__
    assert Point(1) != Point(2) and hash(Point(1)) == hash(Point(1))
    with pytest.raises(TypeError):
        Point()  # x has no default  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Point(1, z=3)  # type: ignore[call-arg]


def test_records_are_read_only_and_keep_no_instance_dictionary() -> None:
    point = Point(1)
    with pytest.raises(AttributeError):
        point.x = 2  # type: ignore[misc]
    with pytest.raises(AttributeError):
        point.other = 2  # type: ignore[attr-defined]


def test_a_field_without_a_default_after_one_with_a_default_is_refused() -> None:
    with pytest.raises(TypeError, match="Bad: a field without a default follows one with a default"):
        @record
        class Bad:
            a: int = 1
            b: int
