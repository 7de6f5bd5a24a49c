"""The tray icon, drawn at runtime: a gauge of memory used against the budget.

A vertical bar fills from the bottom with the share of the budget in use,
coloured by state (green ok, amber high, red shedding, grey when the server is
down). Black ticks sticking out on both sides mark the low and high
watermarks; a white tick across the bar marks the peak. Drawn for 16x16 and
32x32 (Windows tray sizes) and anything larger.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image, ImageDraw

COLOURS = {
    "ok": (46, 160, 67, 255),
    "high": (240, 170, 0, 255),
    "shedding": (215, 40, 40, 255),
    "down": (140, 140, 140, 255),
}
OUTLINE = (30, 30, 30, 255)
EMPTY = (235, 235, 235, 255)
TICK = (0, 0, 0, 255)
PEAK = (255, 255, 255, 255)


@dataclass(frozen=True)
class Gauge:
    """What the icon shows; fractions are of the budget, clipped to 0..1."""

    used: float
    peak: float
    low: float
    high: float
    state: str


@dataclass(frozen=True)
class Layout:
    """Pixel geometry for one icon size (shared with the tests)."""

    size: int

    @property
    def left(self) -> int:
        return round(self.size * 0.28)

    @property
    def right(self) -> int:
        return self.size - 1 - round(self.size * 0.28)

    @property
    def top(self) -> int:
        return 0

    @property
    def bottom(self) -> int:
        return self.size - 1

    @property
    def inner_height(self) -> int:
        return self.bottom - self.top - 1

    def row(self, fraction: float) -> int:
        """The pixel row for a fraction of the budget (0 at the bottom edge)."""
        fraction = min(1.0, max(0.0, fraction))
        return self.bottom - 1 - round(fraction * (self.inner_height - 1))


def draw_icon(gauge: Gauge, size: int = 64) -> Image.Image:
    image = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    box = Layout(size)
    colour = COLOURS.get(gauge.state, COLOURS["down"])
    body = COLOURS["down"] if gauge.state == "down" else EMPTY
    draw.rectangle((box.left, box.top, box.right, box.bottom), fill=body, outline=OUTLINE)
    if gauge.used > 0:
        top = box.row(gauge.used)
        draw.rectangle((box.left + 1, top, box.right - 1, box.bottom - 1), fill=colour)
    stick_out = max(2, size // 8)
    for fraction in (gauge.low, gauge.high):
        y = box.row(fraction)
        draw.line((box.left - stick_out, y, box.left, y), fill=TICK)
        draw.line((box.right, y, box.right + stick_out, y), fill=TICK)
    if gauge.peak > 0:
        y = box.row(gauge.peak)
        draw.line((box.left + 1, y, box.right - 1, y), fill=PEAK)
    return image
