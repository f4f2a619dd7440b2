"""k2-model."""

__version__ = "0.1.0"
