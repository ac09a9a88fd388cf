"""What every config section shares: unknown keys refused, assignments validated, true/false never a number."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def positive_int_or(word: str, v: Any) -> Any:
    """A positive integer (not a boolean, which YAML and Python also count as integers), or the one word."""
    if v == word or (isinstance(v, int) and not isinstance(v, bool) and v > 0):
        return v
    raise ValueError(f"expected a positive integer or '{word}'")


def admits_numbers(annotation: Any) -> bool:
    """Whether a field takes numbers and not booleans (int | None, float, int | Literal["full"], ...)."""
    kinds = set(get_args(annotation)) | {annotation}
    return bool(kinds & {int, float}) and bool not in kinds


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """true/false are never numbers, though YAML and Python count them as integers (true would be 1 epoch)."""
        if isinstance(v, bool) and admits_numbers(cls.model_fields[info.field_name].annotation):
            raise ValueError("expected a number")
        return v
