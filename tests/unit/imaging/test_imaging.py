"""Decoding untrusted bytes and preprocessing them for the model, in this process (the decode
worker processes run the same functions: test_decode_pool.py; the memory a decode takes,
each in a fresh process: live/test_imaging_live.py)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from images import (
    bad_images,
    coffee_image,
    decompression_bomb,
    encode,
    odd_valid_images,
    photo,
    png_header,
    sixteen_bit_png,
)
from PIL import Image

from app.errors import BadImage, ImageTooLarge
from app.imaging.decoding import decode_image, open_image, to_rgb
from app.imaging.pixels import model_input, preprocess
from app.models.efficientnet_lite import PREPROCESSING
from app.preprocessing import Preprocessing

LIMIT = 40_000_000


@pytest.mark.parametrize("name", sorted(odd_valid_images()))
def test_odd_but_valid_images_decode_to_rgb(name):
    image = decode_image(odd_valid_images()[name], LIMIT, shrink_to=256)
    assert image.mode == "RGB"
    pixels = preprocess(image, PREPROCESSING)
    assert pixels.shape == (3, 224, 224) and pixels.dtype == np.float32


@pytest.mark.parametrize("name", sorted(bad_images()))
def test_broken_bodies_are_bad_images(name):
    with pytest.raises(BadImage):
        decode_image(bad_images()[name], LIMIT)


def test_decompression_bomb_is_refused_before_decoding():
    bomb = decompression_bomb(8000)  # 64 million pixels in about 60 KB
    assert len(bomb) < 100_000
    with pytest.raises(ImageTooLarge, match="8000x8000"):
        decode_image(bomb, LIMIT)


def test_pillows_own_bomb_guard_is_mapped_too():
    with pytest.raises(ImageTooLarge):  # 900 million pixels, past Pillow's hard limit
        decode_image(png_header(30000), 10**12)


def test_pixel_limit_is_the_setting():
    png = encode(Image.new("RGB", (100, 100)), "PNG")
    assert decode_image(png, 10_000).size == (100, 100)
    with pytest.raises(ImageTooLarge, match="100x100"):
        decode_image(png, 9_999)


def test_exif_orientation_is_applied():
    upright = Image.new("RGB", (40, 20), (255, 0, 0))
    upright.paste((0, 0, 255), (0, 0, 20, 20))  # left half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: viewers turn it 90 degrees clockwise
    data = encode(upright, "JPEG", exif=exif.tobytes(), quality=95)
    image = decode_image(data, LIMIT)
    assert image.size == (20, 40)
    top = np.asarray(image)[2, 10]
    assert top[2] > 200 and top[0] < 60  # the blue half ends up on top


def test_sixteen_bit_grey_is_scaled_not_clipped():
    image = decode_image(sixteen_bit_png(), LIMIT)
    expected = np.asarray(coffee_image().convert("L"), dtype=np.float64)
    grey = np.asarray(image, dtype=np.float64)[..., 0]
    assert np.abs(grey - expected).mean() < 1.0  # Pillow's own convert would be all white


def test_transparency_becomes_white():
    clear = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    assert to_rgb(clear).getpixel((3, 3)) == (255, 255, 255)


def test_gif_gives_its_first_frame():
    from images import animated_gif

    image = decode_image(animated_gif(), LIMIT)
    red, _, blue = np.asarray(image).reshape(-1, 3).mean(axis=0)
    assert not (blue > 200 and red < 50)  # the second frame is pure blue


def test_jpeg_draft_keeps_at_least_the_resize_size():
    big = coffee_image().resize((2400, 1600))
    image = decode_image(encode(big, "JPEG"), LIMIT, shrink_to=256)
    assert min(image.size) >= 256 and image.size[0] < 2400


def test_inception_normalisation_maps_pixels_to_minus_one_one():
    white = Image.new("RGB", (300, 300), (255, 255, 255))
    black = Image.new("RGB", (300, 300), (0, 0, 0))
    assert preprocess(white, PREPROCESSING).max().item() == pytest.approx(128 / 128)
    assert preprocess(black, PREPROCESSING).min().item() == pytest.approx(-127 / 128)


def test_resize_and_centre_crop_match_the_two_step_version():
    spec = Preprocessing(resize=256, crop=224, mean=(0.0,) * 3, std=(1.0,) * 3)
    image = Image.open(io.BytesIO(photo())).convert("RGB")
    ours = preprocess(image, spec)
    w, h = image.size
    scaled = image.resize((round(w * 256 / h), 256), Image.Resampling.BILINEAR)
    left = (scaled.width - 224) // 2
    reference = np.asarray(scaled.crop((left, 16, left + 224, 240)), dtype=np.float32)
    diff = np.abs(ours.transpose(1, 2, 0) - reference)
    assert diff.mean() < 3.0  # same region and scale, up to resampling rounding


# --- shrinking before converting: the model's input, at a bounded memory cost -------------

PIXEL_UNITS = Preprocessing(resize=256, crop=224, mean=(0.0,) * 3, std=(1.0,) * 3)


def test_the_models_input_matches_decoding_then_preprocessing() -> None:
    """model_input (crop and shrink first, convert last) gives what decoding the whole
    image and preprocessing it gives, up to resampling rounding."""
    ours = model_input(open_image(photo(), LIMIT, PREPROCESSING.resize), PREPROCESSING)
    whole = preprocess(decode_image(photo(), LIMIT), PREPROCESSING)
    assert ours.shape == whole.shape == (3, 224, 224) and ours.dtype == np.float32
    assert np.abs(ours - whole).mean() < 3 / 128  # three pixel levels


def test_shrinking_half_transparent_edges_does_not_darken_them() -> None:
    """Averaging straight (not premultiplied) alpha would turn the red edge next to
    transparent black into dark red on white."""
    half = Image.new("RGBA", (2000, 2000), (0, 0, 0, 0))
    half.paste((255, 0, 0, 255), (0, 0, 1001, 2000))
    pixels = model_input(open_image(encode(half, "PNG"), LIMIT), PIXEL_UNITS)
    assert pixels[0].min() > 250  # red everywhere: 255 on the red half and on white


def test_a_dark_sixteen_bit_image_stays_dark_after_shrinking() -> None:
    """16-bit grey is widened to 32-bit to be shrunk; it is still scaled as 16-bit."""
    dark = Image.fromarray(np.full((1200, 1200), 200, dtype=np.uint16))  # 200 of 65535
    image = decode_image(encode(dark, "PNG"), LIMIT, shrink_to=100)
    assert image.size == (100, 100) and np.asarray(image).max() <= 1
