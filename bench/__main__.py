"""``python -m bench``: Ctrl-C and usage errors answer from the first instruction, before torch loads."""
import sys

from convert.cli import launch

sys.exit(launch("bench.cli"))
