"""One name for each memory quantity, for people: the tray, the dashboard, `vramguard
doctor`, the `/v1/memory` field descriptions and the README all use these, and
`docs/memory.md` has them in one table (`tests/unit/test_vocabulary.py` holds them to it).

Each is right by one definition only; two names for one quantity, or one name for two,
read as a contradiction to a person who is not an ML engineer. The models' weights are
used memory: "Used" is Models plus Images in progress, out of the Limit.
"""

from __future__ import annotations

from typing import NamedTuple


class Name(NamedTuple):
    name: str
    meaning: str
    fields: str  # where /v1/memory (and each live sample) has it


GPU_MEMORY = Name("GPU memory", "all the memory of the GPU (without a GPU: of the computer)",
                  "total_bytes")
MODELS = Name("Models", "what the loaded models take", "weights_bytes")
IMAGES = Name("Images in progress", "what the images being worked on take right now",
              "usage_bytes")
USED = Name("Used", "Models plus Images in progress", "weights_bytes + usage_bytes")
GPU_CACHE = Name("GPU cache", "memory PyTorch keeps to reuse; Empty GPU cache gives it back",
                 "reserved_bytes - allocated_bytes")
OTHER_PROGRAMS = Name("Other programs", "what other programs use of the GPU memory",
                      "others_bytes")
FREE = Name("Free", "GPU memory no program uses", "free_bytes")
LIMIT = Name("Limit", "the most vramguard lets Models and Images in progress take together",
             "weights_bytes + budget_bytes")
ROOM_FOR_IMAGES = Name("Room for images", "the Limit less Models: what images may take",
                       "budget_bytes")
GETTING_FULL = Name("Getting full", "the line above which Images in progress make the state "
                    "getting full", "low_watermark_bytes")
FULL = Name("Full", "the line above which new images wait (the state is full)",
            "high_watermark_bytes")
PEAK = Name("Peak", "the most vramguard held (Models, Images in progress and GPU cache) since "
            "it started or since Reset peak", "peak_reserved_bytes")
PER_IMAGE = Name("Memory per image", "what one more image in a batch takes (measured)",
                 "bytes_per_sample")
PER_BATCH = Name("Memory per batch", "what a batch takes whatever its size (measured)",
                 "fixed_bytes")

MEMORY_NAMES: tuple[Name, ...] = (GPU_MEMORY, MODELS, IMAGES, USED, GPU_CACHE, OTHER_PROGRAMS,
                                  FREE, LIMIT, ROOM_FOR_IMAGES, GETTING_FULL, FULL, PEAK,
                                  PER_IMAGE, PER_BATCH)

# The guard's states (GuardState values) in words, with the colour the icon shows.
STATE_WORDS = {"ok": "healthy", "high": "getting full", "shedding": "full: new images wait",
               "down": "not running"}
STATE_COLOURS = {"ok": "green", "high": "amber", "shedding": "red", "down": "grey"}

EMPTY_GPU_CACHE = "Empty GPU cache"  # the action; the result cache is "saved answers"
