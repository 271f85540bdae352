"""Stratus: serve each inference request on the cheapest tier that answers it well in time."""

from importlib import metadata

try:
    __version__ = metadata.version("stratus-router")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
