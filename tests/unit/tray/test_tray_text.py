"""The tray's icon, tooltip, menu text and notifications, without a display."""

from __future__ import annotations

import pytest
from samples import sample

from tray.icon import COLOURS, PEAK, TICK, Gauge, Layout, draw_icon
from tray.text import TOOLTIP_LIMIT, Notifier, gauge_of, menu_lines, tooltip

MiB, GiB = 1024**2, 1024**3


def column(image, x: int) -> list[tuple[int, int, int, int]]:
    return [image.getpixel((x, y)) for y in range(image.height)]


@pytest.mark.parametrize("size", [16, 32, 64])
@pytest.mark.parametrize(("fraction", "state"), [(0.0, "ok"), (0.38, "ok"), (0.8, "high"),
                                                 (0.95, "shedding"), (1.0, "shedding")])
def test_fill_matches_the_fraction_and_colour_the_state(size, fraction, state):
    gauge = Gauge(used=fraction, peak=0.0, low=0.75, high=0.9, state=state)
    image = draw_icon(gauge, size)
    box = Layout(size)
    pixels = column(image, (box.left + box.right) // 2)
    assert pixels[box.top] == pixels[box.bottom] == COLOURS[state]  # the frame
    inside = range(box.inner_top, box.inner_bottom + 1)
    coloured = [y for y in inside if pixels[y] == COLOURS[state]]
    if fraction == 0:
        assert not coloured
        return
    # walk up from the bottom through the fill (a watermark tick may cross it)
    top = box.inner_bottom
    while top - 1 >= box.inner_top and pixels[top - 1] in (COLOURS[state], TICK):
        top -= 1
    expected = box.row(fraction)
    assert top == expected or (top == expected - 1 and pixels[top] == TICK)
    assert min(coloured) >= top
    filled = box.inner_bottom - expected + 1
    assert abs(filled / box.inner_height - fraction) <= 1.5 / box.inner_height + 0.02


@pytest.mark.parametrize("size", [16, 32, 64])
def test_watermark_ticks_and_peak_are_drawn(size):
    gauge = Gauge(used=0.2, peak=0.6, low=0.75, high=0.9, state="ok")
    image = draw_icon(gauge, size)
    box = Layout(size)
    for fraction in (0.75, 0.9):
        y = box.row(fraction)
        assert image.getpixel((box.left - 1, y)) == TICK
        assert image.getpixel((box.right + 1, y)) == TICK
        assert image.getpixel(((box.left + box.right) // 2, y)) == TICK
    assert image.getpixel(((box.left + box.right) // 2, box.row(0.6))) == PEAK
    assert image.getpixel((0, 0))[3] == 0  # transparent around the gauge


def test_server_down_is_grey_and_empty():
    image = draw_icon(gauge_of(None), 32)
    box = Layout(32)
    inside = column(image, 16)[box.inner_top:box.inner_bottom + 1]
    assert set(inside) == {COLOURS["down"], TICK}  # a grey bar: no reading
    assert tooltip(None) == "vramguard: not running"
    assert menu_lines(None) == ["vramguard is not running"]


SAMPLE = sample()


def test_tooltip_and_menu_text():
    """Used is Models plus Images in progress, out of the Limit (Models plus Room for
    images): the weights count as used memory, as on the dashboard."""
    assert tooltip(SAMPLE) == "vramguard: healthy, 41% of the limit used, peak 63%"
    assert menu_lines(SAMPLE) == [
        "Used: 4.3 GiB of the 10.5 GiB limit (41%)",
        "Models 500 MiB, images in progress 3.8 GiB, GPU cache 3.9 GiB",
        "Peak: 6.6 GiB (63%)",
        "State: healthy",
        "Waiting: 3, batch up to 4",
    ]
    assert len(tooltip(sample(state="shedding", paused=True))) <= TOOLTIP_LIMIT
    squeezed = menu_lines(sample(budget_bytes=0, state="shedding"))
    assert squeezed[0] == ("Used: 4.3 GiB; no room for images left (other programs hold "
                           "the GPU memory)")


def test_gauge_from_a_sample():
    limit = (10 * GiB + 500 * MiB)
    gauge = gauge_of(SAMPLE)
    assert gauge.used == pytest.approx((500 * MiB + 3.8 * GiB) / limit, abs=0.001)
    assert gauge.peak == pytest.approx((500 * MiB + 6.1 * GiB) / limit, abs=0.001)
    assert gauge.low == pytest.approx((500 * MiB + 7.5 * GiB) / limit, abs=0.001)
    assert gauge.high == pytest.approx((500 * MiB + 9 * GiB) / limit, abs=0.001)
    assert gauge.state == "ok"


def test_notifications_once_per_episode():
    notifier = Notifier()
    seen = [notifier.update(s) for s in
            ("ok", "high", "high", "shedding", "shedding", "high", "ok", "high", "down", "high")]
    shown = [i for i, message in enumerate(seen) if message]
    assert shown == [1, 3, 7, 9]
    assert "full" in seen[3]
