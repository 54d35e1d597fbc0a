"""Bring any published DFlash drafter into this project's format, and push drafters to the Hub.

Run from the repository root:

    python -m convert.convert_checkpoint SOURCE OUTPUT [--engine-only] [--dry-run] ...
    python -m convert.push_to_hub FOLDER --repo-id ORG/NAME [--dry-run] ...

Every script is also a plain function (the modules keep their names, so nothing here shadows them):

    from convert.convert_checkpoint import convert_checkpoint
    from convert.push_to_hub import push_to_hub
"""

from .errors import ConversionError

__all__ = ["ConversionError"]
