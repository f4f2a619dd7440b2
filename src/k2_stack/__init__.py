"""k2-stack: the `k2` command, thin entrypoints composing the k2 packages."""

__version__ = "0.1.0"
