"""The tray icon, drawn at runtime: a gauge of memory used against the budget.

A vertical bar fills from the bottom with the share of the budget in use,
coloured by state (green ok, amber high, red shedding, grey when the server is
down), inside a frame of the same colour. Black ticks across the bar, sticking
out on both sides, mark the low and high watermarks (the part inside the bar
stays visible on a dark taskbar); a blue line across the bar marks the peak.
Drawn for 16x16 and 32x32 (Windows tray sizes) and anything larger.
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
EMPTY = (235, 235, 235, 255)
TICK = (0, 0, 0, 255)
PEAK = (40, 70, 220, 255)


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
    def frame(self) -> int:
        """Frame width: thick enough to survive the panel scaling the icon down."""
        return max(1, self.size // 16)

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
    def inner_top(self) -> int:
        return self.top + self.frame

    @property
    def inner_bottom(self) -> int:
        return self.bottom - self.frame

    @property
    def inner_height(self) -> int:
        return self.inner_bottom - self.inner_top + 1

    def row(self, fraction: float) -> int:
        """The pixel row for a fraction of the budget (the inner bottom row for 0)."""
        fraction = min(1.0, max(0.0, fraction))
        return self.inner_bottom - round(fraction * (self.inner_height - 1))


def draw_icon(gauge: Gauge, size: int = 64) -> Image.Image:
    image = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    box = Layout(size)
    colour = COLOURS.get(gauge.state, COLOURS["down"])
    body = COLOURS["down"] if gauge.state == "down" else EMPTY
    # The frame carries the state's colour, so an idle (empty) gauge still says "healthy".
    draw.rectangle((box.left, box.top, box.right, box.bottom), fill=body, outline=colour,
                   width=box.frame)
    inner = (box.left + box.frame, box.right - box.frame)
    if gauge.used > 0:
        draw.rectangle((inner[0], box.row(gauge.used), inner[1], box.inner_bottom), fill=colour)
    stick_out = max(2, size // 8)
    for fraction in (gauge.low, gauge.high):  # through the bar too: visible on dark panels
        y = box.row(fraction)
        draw.line((box.left - stick_out, y, box.right + stick_out, y), fill=TICK)
    if gauge.peak > 0:
        y = box.row(gauge.peak)
        draw.line((inner[0], y, inner[1], y), fill=PEAK)
    return image
