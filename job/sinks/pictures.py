"""The job's one plotting stack, Pillow: line charts (curves.png, pr_curves.png), dots (a sweep's params.png),
matrices (confusion.png and TensorBoard's confusion image) and grids of images (worst.png), each drawn where a person
looks at it (a report, an evaluation's image, a sweep's results), never per step. matplotlib draws such figures too,
but importing it and laying out a figure costs 0.3-0.5 s of CPU at the end of every run (8% of a CPU Iris run); each
of these takes a few milliseconds."""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

# matplotlib's tab10, the colours a reader of its charts knows
COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]  # fmt: skip
LIGHT, DARK = np.array([247, 251, 255]), np.array([8, 48, 107])  # matplotlib's Blues, its two ends


def font(size: int = 11) -> ImageFont.ImageFont:
    return ImageFont.load_default(size)


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def side_by_side(panels: Sequence[Image.Image], gap: int = 8) -> Image.Image:
    """Panels in a row on white, tops aligned."""
    img = Image.new("RGB", (sum(p.width for p in panels) + gap * (len(panels) - 1), max(p.height for p in panels)),
                    "white")  # fmt: skip
    x = 0
    for p in panels:
        img.paste(p, (x, 0))
        x += p.width + gap
    return img


def ticks(lo: float, hi: float, n: int = 8) -> list[float]:
    """About n round values (1, 2 or 5 times a power of ten apart) from lo to hi."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / n
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def label(v: float) -> str:
    return f"{v:.6g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.1e}"


def round_ticks(lo: float, hi: float) -> list[tuple[float, str]]:
    return [(t, label(t)) for t in ticks(lo, hi)]


def log_ticks(lo: float, hi: float, n: int = 8) -> list[tuple[float, str]]:
    """Ticks of a log scale from 10**lo to 10**hi, at their logs: 1, 2 and 5 times powers of ten, only the powers
    where those are too many (every few powers where those are), round linear ticks where none falls within."""
    powers = range(math.floor(lo), math.ceil(hi) + 1)
    found = [m * 10.0**k for k in powers for m in (1, 2, 5) if lo - 1e-9 <= math.log10(m) + k <= hi + 1e-9]
    if len(found) > n:
        tens = [10.0**k for k in powers if lo - 1e-9 <= k <= hi + 1e-9]
        found = tens[:: -(-len(tens) // n)]
    if not found:
        found = [t for t in ticks(10**lo, 10**hi, 3) if t > 0]
    return [(math.log10(v), label(v)) for v in found]


def chart(
    lines: Sequence[tuple[str, Sequence[float], Sequence[float | None]]],
    title: str,
    xlabel: str,
    ylabel: str,
    ylim: tuple[float, float] | None = None,
    xlim: tuple[float, float] | None = None,
    steps: bool = False,
    size: tuple[int, int] = (460, 340),
    legend: str = "upper right",
    joined: bool = True,
    xticks: Callable[[float, float], list[tuple[float, str]]] = round_ticks,
) -> Image.Image:
    """A line chart: each line (name, xs, ys; a None or non-finite y leaves a gap) in its colour, a dot at each point
    (`steps`: drawn as steps after each point, without dots; not `joined`: the dots alone), round ticks with a light
    grid (`xticks`: those of x from its range, as (x, label)), a legend of the named lines in a corner ("upper right"
    or "lower left")."""
    f = font()
    width, height = size
    left, right, top, bottom = 56, 12, 24, 40
    points = [(x, y) for _, xs, ys in lines for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
    x_lo, x_hi = xlim or (min((x for x, _ in points), default=0), max((x for x, _ in points), default=1))
    y_lo, y_hi = ylim or (min((y for _, y in points), default=0), max((y for _, y in points), default=1))
    if x_hi <= x_lo:
        x_lo, x_hi = x_lo - 0.5, x_hi + 0.5
    if y_hi <= y_lo:
        y_lo, y_hi = y_lo - 0.5, y_hi + 0.5
    pad = 0 if ylim else 0.05 * (y_hi - y_lo)
    y_lo, y_hi = y_lo - pad, y_hi + pad
    w, h = width - left - right, height - top - bottom
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)

    def at(x: float, y: float) -> tuple[float, float]:
        return left + (x - x_lo) / (x_hi - x_lo) * w, top + (1 - (y - y_lo) / (y_hi - y_lo)) * h

    for t in ticks(y_lo, y_hi):
        _, py = at(x_lo, t)
        draw.line((left, py, left + w, py), fill=(230, 230, 230))
        draw.text((left - 4, py), label(t), fill="black", font=f, anchor="rm")
    for t, text in xticks(x_lo, x_hi):
        px, _ = at(t, y_lo)
        draw.line((px, top, px, top + h), fill=(230, 230, 230))
        draw.text((px, top + h + 4), text, fill="black", font=f, anchor="mt")
    draw.rectangle((left, top, left + w, top + h), outline="black")
    for i, (_, xs, ys) in enumerate(lines):
        colour = COLOURS[i % len(COLOURS)]
        run: list[tuple[float, float]] = []
        for x, y in [*zip(xs, ys), (None, None)]:  # the None closes the last stretch
            if x is None or y is None or not math.isfinite(y):
                if steps and len(run) > 1:  # across at each point's value to the next point, then up or down
                    stepped = [run[0]]
                    for px, py in run[1:]:
                        stepped += [(px, stepped[-1][1]), (px, py)]
                    run = stepped
                if joined and len(run) > 1:
                    draw.line(run, fill=colour, width=2)
                if not steps:
                    for px, py in run:
                        draw.ellipse((px - 2, py - 2, px + 2, py + 2), fill=colour)
                run = []
            else:
                run.append(at(x, y))
    draw.text((left + w / 2, 4), title, fill="black", font=f, anchor="mt")
    draw.text((left + w / 2, height - 4), xlabel, fill="black", font=f, anchor="md")
    tag = Image.new("RGB", (h, 14), "white")
    ImageDraw.Draw(tag).text((h / 2, 7), ylabel, fill="black", font=f, anchor="mm")
    img.paste(tag.rotate(90, expand=True), (2, top))
    named = [(i, name) for i, (name, _, _) in enumerate(lines) if name]
    if named:
        line_h = 14
        box_w = max(int(f.getlength(name)) for _, name in named) + 30
        x0 = left + w - box_w - 6 if legend == "upper right" else left + 6
        y0 = top + 6 if legend == "upper right" else top + h - 6 - line_h * len(named) - 4
        draw.rectangle((x0, y0, x0 + box_w, y0 + line_h * len(named) + 4), fill="white", outline=(200, 200, 200))
        for row, (i, name) in enumerate(named):
            y = y0 + 2 + row * line_h + line_h / 2
            draw.line((x0 + 4, y, x0 + 20, y), fill=COLOURS[i % len(COLOURS)], width=2)
            draw.text((x0 + 24, y), name, fill="black", font=f, anchor="lm")
    return img


def matrix(
    values: np.ndarray, names: list[str], title: str, number: str | None = None, scale: float | None = None
) -> Image.Image:
    """A square matrix as shaded cells (white to dark blue at `scale`, default the largest value), row names on the
    left ("true"), column names along the top written upwards ("predicted"); `number`: the format of each cell's
    value printed in it (e.g. "{:.2f}"), where there are few enough cells."""
    f = font()
    n = len(names)
    cell = max(16, min(48, 480 // max(n, 1)))
    side = max((int(f.getlength(name)) for name in names), default=0) + 8
    top, left = 20 + side + 14, 30 + side
    width = max(left + n * cell + 8, int(f.getlength(title)) + 16)
    img = Image.new("RGB", (width, top + n * cell + 8), "white")
    draw = ImageDraw.Draw(img)
    draw.text((6, 4), title, fill="black", font=f)
    if scale is None:
        scale = float(values.max()) if values.size and values.max() > 0 else 1.0
    for t in range(n):
        draw.text((left - 4, top + t * cell + cell / 2), names[t], fill="black", font=f, anchor="rm")
        for p in range(n):
            v = float(values[t, p]) / scale
            x0, y0 = left + p * cell, top + t * cell
            draw.rectangle(
                (x0, y0, x0 + cell - 1, y0 + cell - 1), fill=tuple(int(c) for c in LIGHT + (DARK - LIGHT) * v)
            )
            if number is not None and n <= 12:  # few enough to print each cell
                ink = "white" if v > 0.5 else "black"
                draw.text((x0 + cell / 2, y0 + cell / 2), number.format(float(values[t, p])), fill=ink, font=f,
                          anchor="mm")  # fmt: skip
    for p, name in enumerate(names):  # the predicted classes along the top, written upwards
        text = Image.new("RGB", (side, cell), "white")
        ImageDraw.Draw(text).text((2, cell / 2), name, fill="black", font=f, anchor="lm")
        img.paste(text.rotate(90, expand=True), (left + p * cell, top - side - 2))
    draw.text((2, top + n * cell / 2), "true", fill="grey", font=f, anchor="lm")
    draw.text((left + n * cell / 2, top - side - 12), "predicted", fill="grey", font=f, anchor="mm")
    return img


def grid(pictures: np.ndarray, titles: list[str], captions: list[str], columns: int = 6) -> Image.Image:
    """Images (N x H x W x C uint8, C 1 or 3) in rows of `columns`, each shown at least 96 pixels wide (enlarged by
    a whole factor, nearest neighbour: a 32-pixel input stays sharp), its title above and its caption beneath."""
    f = font(10)
    n, h, w = pictures.shape[:3]
    zoom = max(1, -(-96 // max(w, 1)))
    cw, ch = max(w * zoom, 150), h * zoom
    box_w, box_h = cw + 8, ch + 34
    rows = -(-n // columns)
    img = Image.new("RGB", (min(n, columns) * box_w, rows * box_h), "white")
    draw = ImageDraw.Draw(img)
    for i in range(n):
        x0, y0 = (i % columns) * box_w, (i // columns) * box_h
        picture = pictures[i]
        shown = Image.fromarray(picture[..., 0] if picture.shape[2] == 1 else picture).convert("RGB")
        shown = shown.resize((w * zoom, h * zoom), Image.NEAREST)
        img.paste(shown, (x0 + (box_w - shown.width) // 2, y0 + 16))
        draw.text((x0 + box_w / 2, y0 + 8), titles[i], fill="black", font=f, anchor="mm")
        draw.text((x0 + box_w / 2, y0 + 16 + ch + 9), captions[i], fill="black", font=f, anchor="mm")
    return img


def scatter(
    xs: Sequence[float],
    ys: Sequence[float],
    title: str,
    xlabel: str,
    ylabel: str,
    log: bool = False,
    names: Sequence[str] | None = None,
    span: tuple[float, float] | None = None,
    size: tuple[int, int] = (320, 280),
) -> Image.Image:
    """Points as dots: x on a log scale (`log`: positive values), or each x the index of one of `names`, written under
    its column; `span`: the x range shown (else the points')."""
    if names is not None:
        named = [(float(i), name) for i, name in enumerate(names)]
        lim = (-0.5, len(names) - 0.5)
        return chart([("", xs, ys)], title, xlabel, ylabel, xlim=lim, size=size, joined=False, xticks=lambda *_: named)
    at = [math.log10(x) for x in xs] if log else list(xs)
    lo, hi = span or (min(xs, default=1.0), max(xs, default=10.0 if log else 1.0))
    lo, hi = (math.log10(lo), math.log10(hi)) if log else (lo, hi)
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    pad = 0.05 * (hi - lo)  # the dots at the ends clear of the frame
    return chart([("", at, ys)], title, xlabel, ylabel, xlim=(lo - pad, hi + pad), size=size, joined=False,
                 xticks=log_ticks if log else round_ticks)  # fmt: skip
