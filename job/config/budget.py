"""train.budget read: the device time or money a run may spend, as the user wrote it ('2h30m', '$12.50'). What a run
has spent against it is the run's to count (job/run/cost.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from job.duration import parse_duration

MONEY = re.compile(r"\$\s*(\d+(?:\.\d*)?|\.\d+)")


@dataclass(frozen=True)
class Budget:
    """train.budget read: an amount of device hours, or of money (`money`); `text` as the user wrote it."""

    amount: float
    money: bool
    text: str

    def describe(self) -> str:
        return f"train.budget={self.text}"

    def raises(self, earlier: str | None) -> bool:
        """Whether this budget goes beyond an `earlier` one (train.budget as an attempt recorded it; None: none):
        a larger amount, or another unit (money against device time), or an earlier one unreadable."""
        if earlier is None:
            return True
        try:
            before = parse_budget(earlier)
        except ValueError:
            return True
        return before.money != self.money or self.amount > before.amount


def parse_budget(text: str) -> Budget:
    """'$12.50' (money, priced by train.price_per_device_hour) or a duration of device time ('2h30m', '90m', seconds).
    Raises ValueError."""
    money = MONEY.fullmatch(text.strip())
    if money:
        amount = float(money[1])
    else:
        try:
            amount = parse_duration(text) / 3600
        except ValueError:
            raise ValueError("expected device time such as 2h30m or 90m, or money such as $12.50") from None
    if amount <= 0:
        raise ValueError("expected a budget above 0")
    return Budget(amount, bool(money), text.strip())
