"""User-facing errors: the CLI prints their message as one line and exits non-zero (no traceback)."""


class SpecdraftError(Exception):
    """An error caused by the user's input (config, paths, data); its message says what to fix."""
