"""The error types of the command-line tools: input a command refuses, with a message that says why."""


class CommandError(ValueError):
    """An expected failure of a command: a missing, unreadable or corrupt input file, an unknown or
    unreachable Hub id, a bad flag combination, an output that already exists. The message names the
    file, id or flag and what to do; the command lines print it as one line (see ``convert/cli.py``)."""


class ConversionError(CommandError):
    """A source checkpoint that cannot be converted as asked: unsupported dialect, unmapped or missing
    weight key, refused pickle file, inconsistent shard index, or a failed verification.
    The message always names the offending file, key or value."""
