"""The transformers versions this package is tested on, in one place, and the one warning for a newer one.

``TESTED_TRANSFORMERS`` lists the versions ``.ci/run`` runs (its lanes), oldest first; ``pyproject.toml``
admits the oldest up to, not including, the minor after the newest (``transformers>=4.57.1,<5.26``), and
the README's Install section names them (``tests/test_tested_versions.py`` holds the four together).

Hub users never see ``pyproject.toml``: they load a drafter with ``trust_remote_code=True`` under whatever
transformers they have. A few paths read transformers' private cache or generation internals, which change
between minors without notice (5.25 changed how a linear-attention cache layer counts its tokens and broke
every hybrid target here: issue 48). At the first call on one of them under a transformers newer than the
newest tested minor, ``warn_if_untested`` logs ONE warning per process naming the tested versions and that
path; nothing is refused (the output may still be right; the tests have not said so).
"""

import threading

import transformers
from transformers.utils import logging

logger = logging.get_logger(__name__)

TESTED_TRANSFORMERS = ("4.57.1", "5.24.0", "5.25.0")  # the CI lanes, oldest first

# The paths that read transformers' internals, by the name the warning gives them.
PATHS_AT_RISK = {
    "hybrid cache": "hybrid linear-attention targets (target_cache: cache layer states and token counters)",
    "cache reuse": "continuing from a passed cache (cache_reuse: cache layers, sliding-window recording)",
    "native route": "speculation_type='dflash' (native_routes: transformers' DFlash generator's frames)",
    "taps": "target feature taps (target_taps: hidden-state capture, decoder layers)",
}

_LOCK = threading.Lock()
_WARNED = [False]  # the once-only flag: one warning per process, whichever path comes first


def _minor(text: str) -> tuple:
    """``(major, minor)`` of a version string: ``"5.26.0.dev0"`` -> ``(5, 26)``.

    Raises:
        ValueError: naming the string, when it does not start with two dot-separated integers."""
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"transformers version {text!r} does not start with major.minor") from None


def untested_newer(installed: str = None) -> bool:
    """Whether ``installed`` (default: the running transformers) is a minor newer than the newest tested one
    (patch releases of a tested minor count as tested)."""
    installed = transformers.__version__ if installed is None else installed
    return _minor(installed) > _minor(TESTED_TRANSFORMERS[-1])


def warn_if_untested(path: str) -> None:
    """Log one warning per process when the running transformers is newer than every tested version, naming
    the tested versions and ``path`` (a key of ``PATHS_AT_RISK``); later calls, on any path, say nothing.

    Raises:
        KeyError: ``path`` is not a key of ``PATHS_AT_RISK`` (naming it and the keys)."""
    if path not in PATHS_AT_RISK:
        raise KeyError(f"unknown path {path!r}; known: {sorted(PATHS_AT_RISK)}")
    if _WARNED[0] or not untested_newer():
        return
    with _LOCK:
        if _WARNED[0]:
            return
        _WARNED[0] = True
    others = ", ".join(name for name in PATHS_AT_RISK if name != path)
    logger.warning(
        f"transformers {transformers.__version__} is newer than any version dflash-hf is tested on "
        f"({', '.join(TESTED_TRANSFORMERS)}): {PATHS_AT_RISK[path]} reads transformers internals that change "
        f"between minor versions, and may fail or part from generate's output (so may: {others}). Install "
        f"transformers<{_next_minor()} for a tested setup, or check the output against target.generate. "
        "This warning is given once per process.")


def _next_minor() -> str:
    """The first minor the package does not admit: ``"5.26"`` for a newest tested ``"5.25.0"``."""
    major, minor = _minor(TESTED_TRANSFORMERS[-1])
    return f"{major}.{minor + 1}"


def requirement() -> str:
    """The requirement ``pyproject.toml`` must state: ``"transformers>=4.57.1,<5.26"``."""
    return f"transformers>={TESTED_TRANSFORMERS[0]},<{_next_minor()}"


__all__ = ["PATHS_AT_RISK", "TESTED_TRANSFORMERS", "requirement", "untested_newer", "warn_if_untested"]
