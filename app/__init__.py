"""vramguard: a local image-classification appliance that guards GPU memory."""

__version__ = "0.1.0"
