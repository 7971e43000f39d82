"""The one error type of checkpoint conversion and loading."""


class ConversionError(ValueError):
    """A checkpoint folder that cannot be converted or loaded; the message names the file,
    the tensor and what was expected."""
