"""The one exception type the CLI turns into a one-line message on stderr."""

from __future__ import annotations


class LoadgenError(Exception):
    """Bad input or an unusable environment: reported to the user, never a traceback."""
