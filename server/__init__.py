"""kvserve's server: OpenAI-compatible REST API over the engine (server -> engine -> attention)."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvserve")
except PackageNotFoundError:  # run from a source tree without installing
    __version__ = "0.1.0"
