"""k2-ckpt."""

__version__ = "0.1.0"
