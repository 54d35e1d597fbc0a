"""What every command line of the project shares: one-line errors, ``--debug``, quiet model loading.

Used by ``convert.convert_checkpoint``, ``convert.push_to_hub``, ``model_cards.render`` and ``demo.py``
(and reusable by ``train/``). Light on purpose: nothing here imports torch or transformers at import
time, so a command's ``--help`` answers before the heavy imports.

Only EXPECTED failures become one line on stderr (exit status 1): [`CommandError`] and its subclasses,
file-system errors (``OSError``: missing file, permission, output exists, a model folder or id that
transformers cannot resolve), huggingface_hub errors (unknown repo, gated repo, offline) and the
``ValueError`` of an argument ``spec_generate`` refuses (raised by the package's own code, under a
``spec_generate`` call: ``--block-size 32`` for a drafter trained with 16).
Anything else is a bug and keeps its full traceback; ``--debug`` shows the traceback of expected
failures too.
"""

import argparse
import importlib
import os
import sys

from .errors import CommandError
from .sources import REMOTE_CODE_FILES

__all__ = ["CommandError", "add_debug_flag", "expected_failure", "hub_error_message", "launch", "missing_package_message",
           "quiet_loading", "run_command"]


def add_debug_flag(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--debug`` (show the traceback of an expected failure instead of one line) to ``parser``."""
    parser.add_argument("--debug", action="store_true", help="on an error, show the full traceback instead of one line")
    return parser


def add_kernels_flag(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--use-kernels`` (load Hub kernels, ``loading.model_load_kwargs``) to ``parser``."""
    parser.add_argument("--use-kernels", action="store_true",
                        help="let transformers load Hub kernels (off by default, also on transformers >= 5.25 where "
                             "from_pretrained turns them on: the package's loads stay offline; USE_HUB_KERNELS, "
                             "when set, is left to transformers)")
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


def refused_by_spec_generate(err: BaseException) -> bool:
    """True when ``err`` is a ``ValueError`` that the package's own code raised inside a ``spec_generate``
    call (an argument it refuses, a drafter that does not fit the target), not one from torch or
    transformers (a bug, which keeps its traceback). Read from the traceback: the innermost frame lies in
    one of the package's code files (``REMOTE_CODE_FILES``, wherever transformers copied them)."""
    if not isinstance(err, ValueError) or err.__traceback__ is None:
        return False
    frames, tb = [], err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    return (os.path.basename(frames[-1].co_filename) in REMOTE_CODE_FILES
            and any(code.co_name.startswith("spec_generate") for code in frames))


# Optional packages the command lines import on demand -> the extra of pyproject.toml that installs them.
OPTIONAL_PACKAGES = {"datasets": "bench", "matplotlib": "bench", "tqdm": "bench", "tokenizers": "train",
                     "yaml": "test", "jinja2": "test", "flash_attn": "flash", "bitsandbytes": "quantization",
                     "torchao": "quantization", "optimum": "quantization"}


def missing_package_message(err: BaseException):
    """``"<package> is not installed: pip install -e '.[extra]'"`` for an optional package a command imports on
    demand (``OPTIONAL_PACKAGES``), or None. ``dflash-hf benchmark --dataset gsm8k`` after a plain
    ``pip install -e .`` printed a 31-line traceback ending in ``No module named 'datasets'``."""
    if not isinstance(err, ModuleNotFoundError) or not err.name:
        return None
    top = err.name.split(".")[0]
    extra = OPTIONAL_PACKAGES.get(top)
    if extra is None:
        return None
    return f"{top} is not installed (this command needs it): pip install -e '.[{extra}]' (or pip install {top})"


def expected_failure(err: BaseException):
    """The one-line message of an expected failure, or None when ``err`` is a bug (keep its traceback)."""
    if isinstance(err, CommandError) or refused_by_spec_generate(err):
        return _first_line(err)
    missing = missing_package_message(err)
    if missing is not None:
        return missing
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
        return interrupted()
    except Exception as err:  # noqa: BLE001 - re-raised unless it is an expected failure
        message = expected_failure(err)
        if message is None or debug:
            raise
        more = len(str(err).strip().splitlines()) > 1
        print(f"error: {message}" + (" (--debug shows the details)" if more else ""), file=sys.stderr)
        return 1


def interrupted() -> int:
    """Say ``interrupted`` on stderr; the exit status of Ctrl-C (130)."""
    print("interrupted", file=sys.stderr)
    return 130


def main_of(module: str):
    """The ``main`` function of ``module``, imported (the heavy imports of a command happen here)."""
    return importlib.import_module(module).main


def launch(module: str, argv=None, parser=None) -> int:
    """Run ``module``'s ``main(argv)`` from a light ``__main__``, Ctrl-C safe from the first instruction.

    ``parser()`` (when given) parses ``argv`` first, so that ``--help`` and usage errors (exit 2) answer
    before the heavy imports; then ``module`` is imported (torch, transformers: seconds) and its ``main``
    runs, which handles its own failures (see [`run_command`]). A Ctrl-C during the import or the
    parsing prints ``interrupted`` and returns 130 instead of a traceback through the import machinery.
    """
    try:
        if parser is not None:
            parser().parse_args(argv)
        main = main_of(module)
    except KeyboardInterrupt:
        return interrupted()
    return main(argv)
