"""User-facing errors: the CLI prints their message as one line and exits non-zero (no traceback)."""


TRT_MISSING = "TensorRT is not installed (pip install '.[trt]' from NVIDIA's index on a GPU machine)"


class SpecdraftError(Exception):
    """An error caused by the user's input (config, paths, data); its message says what to fix."""


class OptionError(SpecdraftError, ValueError):
    """A bad value for one field of an options dataclass. ``key`` is the field's name; the pipeline's config loader
    reports it under its full dotted path (``train.grpo.group_size``)."""

    def __init__(self, key: str, message: str):
        super().__init__(f"option '{key}': {message}")
        self.key, self.message = key, message


def check_range(key: str, value: float, low: float | None = None, high: float | None = None,
                low_open: bool = False) -> None:
    """Raise :class:`OptionError` unless ``low <= value <= high`` (``low < value`` with ``low_open``)."""
    if low is not None and (value <= low if low_open else value < low):
        raise OptionError(key, f"must be {'>' if low_open else '>='} {low:g}, got {value}")
    if high is not None and value > high:
        raise OptionError(key, f"must be <= {high:g}, got {value}")
