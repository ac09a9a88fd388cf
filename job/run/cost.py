"""What a run costs: device hours, the price of one (train.price_per_device_hour: a number, or one per device), what
has been spent and what finishing will have cost, and train.budget, the device time or money a run may spend before
it stops at a checkpoint (exit 0; a larger budget continues it)."""

from __future__ import annotations

from typing import Any

from job.config.budget import Budget
from job.duration import format_duration

Price = float | dict[str, float] | None


def price_of(price: Price, device: dict[str, Any]) -> float | None:
    """The price of a device hour of the device an attempt recorded (run.json's devices[0]): the number, or from a
    map the entry for its exact name, else the longest key its name contains (case aside: "H100" for "NVIDIA H100
    80GB HBM3"), else its type ("cpu", "cuda", "mps"); None when there is no price for it."""
    if price is None or isinstance(price, (int, float)):
        return price
    name, kind = str(device.get("name") or ""), str(device.get("type") or "")
    if name in price:
        return price[name]
    inside = [k for k in price if k and k.lower() in name.lower()]
    if inside:
        return price[max(inside, key=len)]
    return price.get(kind)


def totals(
    attempts: list[dict[str, Any]], price: Price, done_steps: int | None = None, total_steps: int | None = None
) -> dict[str, Any]:
    """run.json's `cost`: the attempts' device hours summed, the price, what they cost (None without a price for
    every attempt's device), and `projected`, what the run will have cost when it ends, extrapolated from the steps
    done to the steps it has in all (None where either is unknown). The figures the summary line, TensorBoard and a
    tracker show."""
    hours = [a.get("device_hours") or 0.0 for a in attempts]
    device_hours = round(sum(hours), 6)
    prices = [price_of(price, (a.get("devices") or [{}])[0]) for a in attempts]
    spent = None
    if price is not None and None not in prices:
        spent = round(
            device_hours * price if isinstance(price, (int, float)) else sum(h * p for h, p in zip(hours, prices)), 6
        )
    projected = None
    if spent is not None and done_steps and total_steps:
        projected = round(spent * max(total_steps, done_steps) / done_steps, 6)
    return {"device_hours": device_hours, "price_per_device_hour": price, "spent": spent, "projected": projected}


def spent_of(cost: dict[str, Any], budget: Budget) -> float | None:
    """What a cost block has spent, in the budget's unit (device hours, or money); None: unpriced."""
    return cost["spent"] if budget.money else cost["device_hours"]


def describe(cost: dict[str, Any]) -> str:
    """'0.0123 device hours, $0.03 spent' for the end line."""
    spent = cost.get("spent")
    return hours_text(cost["device_hours"]) + ("" if spent is None else f", {money_text(spent)} spent")


def hours_text(hours: float) -> str:
    """Device hours in words: '1.25 device hours', or under a minute's worth, '4.2s of device time'."""
    return (
        f"{hours:.3g} device hours" if hours >= 1 / 60 else f"{format_duration(round(hours * 3600, 1))} of device time"
    )


def money_text(amount: float) -> str:
    return f"${amount:.2f}" if amount >= 1 else f"${amount:.3g}"


def in_budget_unit(amount: float, budget: Budget) -> str:
    return money_text(amount) if budget.money else hours_text(amount)
