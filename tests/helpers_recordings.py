"""Temporary: re-exports from tests.support for modules not yet switched to it."""

from tests.support.recordings import SECRET, wav_bytes

__all__ = ["SECRET", "wav_bytes"]
