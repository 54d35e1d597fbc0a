"""Remote-code module-cache repair: a drafter folder loaded in a process runs that folder's own files.

Why: transformers runs a folder's remote code from one cache package per folder (4.57: keyed by the
folder's basename only) and re-executes ``modeling_dflash.py`` when it or a file it imports changed,
but a plain relative import then returns the sibling module already in ``sys.modules``: a second
folder with the same name, or the same folder after an edit, would silently run the FIRST folder's
``generation_utils.py`` (tests/test_remote_code.py). ``modeling_dflash.py`` calls
[`_forget_stale_siblings`] before its other relative imports and [`_record_sibling_sources`] after them.

This module is itself a sibling whose own file may differ between two such folders, so
``modeling_dflash.py`` drops it from ``sys.modules`` before importing it: it runs afresh every time
the modeling file runs (it holds no state), and it never judges itself.
"""

import hashlib
import os
import sys

_SOURCE_SHA = "__dflash_source_sha256__"  # set on each sibling module: the sha256 of the file it ran


def _sibling_modules(caller: str) -> dict:
    """``{name: module}`` of the modules of this file's package that were loaded from this file's folder,
    except ``caller`` (the modeling file, running) and this module (always run afresh, see above)."""
    here = os.path.dirname(os.path.abspath(__file__))
    prefix = __package__ + "."
    found = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.startswith(prefix) and name not in (caller, __name__) and path \
                and os.path.dirname(os.path.abspath(path)) == here:
            found[name] = module
    return found


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _forget_stale_siblings(caller: str) -> None:
    """Drop the sibling modules from ``sys.modules`` when a file of theirs changed since it ran.

    Every module of this package loaded from this folder (siblings of siblings included) whose file no
    longer has the bytes it ran is stale, and when one is, all of them are forgotten (a module whose own
    file is unchanged may hold names imported from a changed one), so the modeling file's imports that
    follow run the folder's own files. Modules that transformers loads itself
    (``__transformers_module_hash__``: the configuration file) are left to its own reload check.
    """
    ours = {n: m for n, m in _sibling_modules(caller).items() if not hasattr(m, "__transformers_module_hash__")}
    if any(not os.path.isfile(m.__file__) or getattr(m, _SOURCE_SHA, None) != _file_sha256(m.__file__)
           for m in ours.values()):
        for name in ours:
            del sys.modules[name]


def _record_sibling_sources(caller: str) -> None:
    """Stamp each newly imported sibling module with the sha256 of the file it ran (see [`_forget_stale_siblings`])."""
    for module in _sibling_modules(caller).values():
        if not hasattr(module, _SOURCE_SHA) and not hasattr(module, "__transformers_module_hash__"):
            setattr(module, _SOURCE_SHA, _file_sha256(module.__file__))


_REMOTE_CODE_PACKAGE = "transformers_modules."  # where transformers runs trust_remote_code files
_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "token", "revision", "code_revision", "local_files_only")


def _folder_own_class(cls, pretrained_model_name_or_path, kwargs):
    """The draft class of the folder's own remote code, or ``cls``.

    transformers 5 maps a remote config class to the first model class loaded for it
    (``AutoModel.register``), so a second folder with the same ``configuration_dflash.py`` but another
    ``generation_utils.py`` (or the same folder after an edit, or a DFlash 1 folder after a DFlash 2 one)
    would get the first folder's class. When ``cls`` is itself remote code and the folder's config names
    a class of ``modeling_dflash`` in ``auto_map``, that class is resolved again from the folder with transformers' public ``get_class_from_dynamic_module``
    (keyed by the folder's files), so the folder's own code runs. Our class imported directly (from
    the repository or ``dflash_hf``) is never swapped.
    """
    config = kwargs.get("config")
    reference = (getattr(config, "auto_map", None) or {}).get("AutoModel")
    if not cls.__module__.startswith(_REMOTE_CODE_PACKAGE) or not str(reference).startswith("modeling_dflash."):
        return cls
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if kwargs.get(k) is not None}
    return get_class_from_dynamic_module(reference, pretrained_model_name_or_path, **hub_kwargs)
