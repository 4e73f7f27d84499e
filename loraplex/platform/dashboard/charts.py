"""Stacked bar charts as plain geometry for an inline SVG (templates/_chart.html draws it): no chart
library, no script, nothing fetched. One bar per day; each series is one colour (a CSS class)."""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

WIDTH, HEIGHT = 720, 210
LEFT, RIGHT, TOP, BOTTOM = 52, 8, 10, 26  # plot margins: y labels on the left, day labels below
MAX_X_LABELS = 8
NUM_Y_STEPS = 4


@dataclass(frozen=True)
class Series:
    label: str
    css: str  # class of its bars and legend swatch
    values: list[int]  # one per day

    @property
    def total(self) -> int:
        return sum(self.values)


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    css: str
    title: str  # the native tooltip


@dataclass(frozen=True)
class Chart:
    title: str
    series: list[Series]
    bars: list[Bar]
    y_ticks: list[tuple[float, str]]  # (y, label)
    x_labels: list[tuple[float, str]]  # (x of the bar's centre, label)
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    right_x: int = WIDTH - RIGHT
    baseline: int = HEIGHT - BOTTOM

    @property
    def is_empty(self) -> bool:
        return not any(s.total for s in self.series)


def nice_step(value: float) -> float:
    """The smallest 1, 2, 2.5 or 5 times a power of ten that is at least `value`; whole numbers only."""
    if value <= 1:
        return 1
    base = 10 ** math.floor(math.log10(value))
    return next(m * base for m in (1, 2, 2.5, 5, 10) if m * base >= value and float(m * base).is_integer())


def short_number(n: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.1f}".rstrip("0").rstrip(".") + suffix
    return f"{n:g}"


def stacked_bars(title: str, days: list[dt.date], series: list[Series]) -> Chart:
    """Bars for `days` (oldest first), each stacking `series` values bottom-up in the given order."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    totals = [sum(s.values[i] for s in series) for i in range(len(days))]
    top = NUM_Y_STEPS * nice_step(max(totals, default=0) / NUM_Y_STEPS)  # whole-number ticks
    slot = plot_w / max(len(days), 1)
    width = max(1.0, slot * 0.72)
    bars = []
    for i, day in enumerate(days):
        x = LEFT + i * slot + (slot - width) / 2
        y = float(TOP + plot_h)
        for s in series:
            h = s.values[i] / top * plot_h
            if h > 0:
                y -= h
                tip = f"{day:%a %d %b}: {s.values[i]:,} {s.label}"
                bars.append(Bar(round(x, 2), round(y, 2), round(width, 2), round(h, 2), s.css, tip))
    y_ticks = [(round(TOP + plot_h * (1 - i / NUM_Y_STEPS), 2), short_number(top * i / NUM_Y_STEPS))
               for i in range(NUM_Y_STEPS + 1)]
    step = max(1, math.ceil(len(days) / MAX_X_LABELS))
    x_labels = [(round(LEFT + i * slot + slot / 2, 2), f"{day:%d %b}") for i, day in enumerate(days)
                if (len(days) - 1 - i) % step == 0]  # always label the newest day
    return Chart(title, series, bars, y_ticks, x_labels)
