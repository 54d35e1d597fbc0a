"""The one error type of the converter: a source that cannot be turned into a verified drafter."""


class ConversionError(ValueError):
    """A source checkpoint that cannot be converted as asked: unsupported dialect, unmapped or missing
    weight key, refused pickle file, inconsistent shard index, or a failed verification.
    The message always names the offending file, key or value."""
