"""What every command line of the project shares: one-line errors, ``--debug``, quiet model loading.

Used by ``convert.convert_checkpoint``, ``convert.push_to_hub``, ``model_cards.render`` and ``demo.py``
(and reusable by ``train/``). Light on purpose: nothing here imports torch or transformers at import
time, so a command's ``--help`` answers before the heavy imports.

Only EXPECTED failures become one line on stderr (exit status 1): [`CommandError`] and its subclasses,
file-system errors (``OSError``: missing file, permission, output exists, a model folder or id that
transformers cannot resolve) and huggingface_hub errors (unknown repo, gated repo, offline).
Anything else is a bug and keeps its full traceback; ``--debug`` shows the traceback of expected
failures too.
"""

import argparse
import sys

from .errors import CommandError

__all__ = ["CommandError", "add_debug_flag", "expected_failure", "hub_error_message", "quiet_loading", "run_command"]


def add_debug_flag(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--debug`` (show the traceback of an expected failure instead of one line) to ``parser``."""
    parser.add_argument("--debug", action="store_true", help="on an error, show the full traceback instead of one line")
    return parser


def quiet_loading() -> None:
    """Silence the transformers / huggingface_hub progress bars ("Loading weights", downloads)."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def hub_error_message(err: BaseException, repo_id: str):
    """One line explaining a huggingface_hub error met while fetching ``repo_id``, or None if ``err`` is not one."""
    try:
        from huggingface_hub import errors
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        return None
    offline = tuple(c for c in (getattr(errors, "LocalEntryNotFoundError", None), getattr(errors, "OfflineModeIsEnabled", None)) if c)
    if offline and isinstance(err, offline):
        return (f"no local folder {repo_id!r}, and the Hub cannot be reached to look for repo {repo_id!r} (it is not "
                "in the local cache; HF_HUB_OFFLINE=1 or no network): go online, or pass a local folder")
    if isinstance(err, errors.GatedRepoError):
        return f"Hub repo {repo_id!r} is gated: accept its terms on https://huggingface.co/{repo_id} and log in (`huggingface-cli login`)"
    if isinstance(err, errors.RepositoryNotFoundError):
        return (f"no Hub repo {repo_id!r} (or it is private): check the id, or pass --token / run "
                "`huggingface-cli login` for a private repo")
    if isinstance(err, errors.RevisionNotFoundError):
        return f"the revision asked for does not exist in Hub repo {repo_id!r}: check --revision"
    if isinstance(err, errors.EntryNotFoundError):
        return f"a file is missing in Hub repo {repo_id!r}: {_first_line(err)}"
    if isinstance(err, errors.HfHubHTTPError):
        return f"the Hub refused a request for {repo_id!r}: {_first_line(err)}"
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _network_error(err: BaseException) -> bool:
    """A transport error of the HTTP client huggingface_hub uses (httpx: connect/read/timeout), which is
    not an ``OSError``; requests' connection errors are ``OSError`` and handled with those."""
    return isinstance(err, ConnectionError) or any(
        c.__module__.split(".")[0].startswith("httpx") and c.__name__ == "TransportError" for c in type(err).__mro__)


def expected_failure(err: BaseException):
    """The one-line message of an expected failure, or None when ``err`` is a bug (keep its traceback)."""
    if isinstance(err, CommandError):
        return _first_line(err)
    message = hub_error_message(err, "the Hub repo")
    if message is not None:
        return message
    if _network_error(err):
        return f"cannot reach the Hugging Face Hub (no network?): {_first_line(err)}"
    if isinstance(err, OSError):  # file system, and transformers' "not a folder nor a Hub id" / "couldn't connect"
        if err.filename and err.strerror:
            return f"{err.strerror}: {err.filename}"
        return _first_line(err)
    return None


def run_command(command, args) -> int:
    """Run ``command(args)`` (returns an exit status) the way every CLI of the project does.

    An expected failure (see [`expected_failure`]) prints ``error: <one line>`` on stderr and returns 1
    (a hint to use ``--debug`` follows when the message had more lines); Ctrl-C prints ``interrupted``
    and returns 130. With ``args.debug`` both raise as usual. Any other exception propagates with
    its traceback: it is a bug, never hidden.
    """
    debug = getattr(args, "debug", False)
    try:
        return command(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - re-raised unless it is an expected failure
        message = expected_failure(err)
        if message is None or debug:
            raise
        more = len(str(err).strip().splitlines()) > 1
        print(f"error: {message}" + (" (--debug shows the details)" if more else ""), file=sys.stderr)
        return 1
