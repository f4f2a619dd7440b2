"""k2-optim."""

__version__ = "0.1.0"
