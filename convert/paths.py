"""Where a model argument of a command line points: a local folder or a Hub repo. One rule for every command.

An argument is a LOCAL PATH when it starts with ``.``, ``/`` or ``~``, or when its first path component
exists here (``pair/targetx`` while ``pair/`` exists): a missing one is "no such folder", said at once,
with no Hub call (transformers would otherwise try it as a Hub id and retry for most of a minute).
Anything else is a Hub repo id; when it is neither a local folder nor reachable on the Hub, the
message says both, so a user who meant a folder sees that it is not there.

Light on purpose (no torch, no transformers): the commands check their arguments before loading models.
Used by ``demo.py``, ``python -m bench``, ``convert.convert_checkpoint`` (``--verify-target``) and
``train.train_drafter`` (``--target``, ``--init``).
"""
import os
import re

from .errors import CommandError

__all__ = ["hub_lookup", "locate_model", "looks_local"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def looks_local(value: str) -> bool:
    """True when ``value`` names a local path: it starts with ``.``, ``/`` or ``~`` (or is absolute), or its
    first path component exists in the working directory."""
    value = str(value)
    if value.startswith((".", "/", "~")) or os.path.isabs(value):
        return True
    first = value.replace(os.sep, "/").split("/", 1)[0]
    return bool(first) and os.path.exists(first)


def hub_lookup(repo_id: str, revision=None, token=None) -> None:
    """Ask the Hub whether model repo ``repo_id`` exists (one request, no retries, no download).

    Raises whatever huggingface_hub raises: ``RepositoryNotFoundError``, ``GatedRepoError``, a
    connection error or ``OfflineModeIsEnabled`` (a ``ConnectionError``) when the Hub cannot be reached.
    Tests replace this function to stay offline.
    """
    import huggingface_hub

    huggingface_hub.model_info(repo_id, revision=revision, token=token)


def _in_cache(repo_id: str, revision=None) -> bool:
    """True when the Hugging Face cache already holds ``repo_id``'s ``config.json`` (usable offline)."""
    try:
        import huggingface_hub

        return isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json", revision=revision), str)
    except Exception:  # noqa: BLE001 - a malformed id or an old huggingface_hub: not cached
        return False


def _unreachable(err: BaseException) -> bool:
    """A connection failure, offline mode, or an HTTP-client transport error (httpx is not an OSError)."""
    from .cli import _network_error

    names = {c.__name__ for c in type(err).__mro__}
    return _network_error(err) or bool(names & {"OfflineModeIsEnabled", "LocalEntryNotFoundError", "Timeout",
                                                "ConnectTimeout", "ReadTimeout", "ConnectionError"})


def locate_model(value, flag: str, revision=None, token=None) -> str:
    """What to pass to ``from_pretrained`` for the command-line argument ``flag value``.

    Returns:
        the local folder (``~`` expanded) when ``value`` is a local path, else ``value`` itself, a Hub
        repo id that is in the local cache or that the Hub answers for.

    Raises:
        CommandError: one line naming ``flag`` and ``value``: "no such folder" for a missing local path
            (no Hub call); a file where a folder is expected; "no local folder X, and the Hub cannot be
            reached to look for repo X"; "no local folder X, and no Hub repo X"; a gated repo.
    """
    value = str(value)
    if looks_local(value):
        path = os.path.expanduser(value)
        if os.path.isdir(path):
            return path
        what = "a file, not a model folder" if os.path.exists(path) else "no such folder"
        raise CommandError(f"{flag} {value}: {what}")
    if not _HUB_ID.match(value):
        raise CommandError(f"{flag} {value}: no local folder {value!r}, and {value!r} is not a Hub repo id ('org/name')")
    if _in_cache(value, revision):
        return value
    try:
        hub_lookup(value, revision=revision, token=token)
    except Exception as err:  # noqa: BLE001 - sorted below; anything unexpected keeps its traceback
        if _unreachable(err):
            raise CommandError(f"{flag} {value}: no local folder {value!r}, and the Hub cannot be reached to look "
                               f"for repo {value!r} (no network, or HF_HUB_OFFLINE=1)") from err
        from .cli import hub_error_message

        message = hub_error_message(err, value)
        if message is None:
            raise
        if type(err).__name__ == "RepositoryNotFoundError":
            message = f"no local folder {value!r}, and {message}"
        raise CommandError(f"{flag} {value}: {message}") from err
    return value
