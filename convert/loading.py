"""Loading the (target, drafter) pair a command line was given, with one-line errors for every bad folder.

Shared by ``demo.py`` and ``python -m bench`` (and usable by any other command). Each failure is a
[`CommandError`] naming the flag, the folder and what to do: a missing folder or Hub id (the rule of
``convert/paths.py``), a folder without ``config.json``, a drafter passed as the target, an
``--engine-only`` folder (no remote code: ``AutoModel`` builds a plain ``Qwen3Model``), a drafter folder
missing one of its code files, unreadable weights, and a drafter built for another target (caught by a
one-token ``spec_generate`` probe, which runs the package's own pairing checks before any real work).
"""
import json
import os

from .errors import CommandError
from .paths import locate_model

__all__ = ["check_pair", "check_roles", "config_role", "load_pair", "model_load_kwargs", "parse_device"]

# The architectures a drafter's config.json names (configuration_dflash's lists, kept here light: no torch).
_DRAFTER_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel", "Qwen3DSparkModel")


# transformers 5.25 made from_pretrained load Hub kernels by default (`use_kernels=None` means on unless the
# environment variable says otherwise): on CUDA it swaps RMSNorm, activations and RoPE for kernels fetched from
# the Hub (other GPU numerics than 5.24's; a first load may reach the network).
KERNELS_ENV = "USE_HUB_KERNELS"
_KERNELS_ON_BY_DEFAULT = (5, 25)


def model_load_kwargs(use_kernels: bool = False, environ=None, transformers_version: str = None) -> dict:
    """The keywords every model load of the package's own command lines and scripts passes to ``from_pretrained``
    about Hub kernels: the package's loads stay offline and keep one numerics unless the user asks.

    Args:
        use_kernels: the user asked for Hub kernels (``--use-kernels``): ``{"use_kernels": True}``.
        environ: the environment (default ``os.environ``); ``USE_HUB_KERNELS`` set there is the user's own
            choice, which transformers reads: ``{}``.
        transformers_version: default the running one. From 5.25 (kernels on by default): ``{"use_kernels":
            False}``; before, ``{}`` (kernels are off there unless asked, and nothing changes in their loads).
    Returns:
        ``dict`` of keyword arguments for ``from_pretrained``.
    """
    if use_kernels:
        return {"use_kernels": True}
    if KERNELS_ENV in (os.environ if environ is None else environ):
        return {}
    if transformers_version is None:
        import transformers

        transformers_version = transformers.__version__
    major, minor = (int(part) for part in transformers_version.split(".")[:2])
    return {"use_kernels": False} if (major, minor) >= _KERNELS_ON_BY_DEFAULT else {}


def parse_device(name: str, flag: str = "--device"):
    """The torch device for a ``--device`` value (``auto``, ``cpu``, ``cuda`` or ``cuda:N``).

    Raises:
        CommandError: a name torch does not parse, another device type, or CUDA asked for without CUDA.
    """
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise CommandError(f"{flag} {name!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CommandError(f"{flag} {name}: this torch has no usable CUDA (torch {torch.__version__}); use {flag} cpu")
    if device.type not in ("cpu", "cuda"):
        raise CommandError(f"{flag} {name!r}: expected auto, cpu, cuda or cuda:N")
    return device


def _config(path: str, flag: str) -> dict:
    """The parsed ``config.json`` of a local folder (a Hub id is read by transformers itself: ``{}``)."""
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        return {}
    if not os.path.isfile(file):
        raise CommandError(f"{flag} {path}: no config.json there; pass a model folder")
    try:
        return json.loads(open(file, encoding="utf-8").read())
    except ValueError as err:
        raise CommandError(f"{flag} {path}: config.json is not valid JSON ({err})") from None


def config_role(config: dict):
    """``"drafter"``, ``"target"`` or None (not known) for a parsed ``config.json``: a drafter names a DFlash
    architecture or carries ``dflash_config`` / ``target_layer_ids``; a target names a ``*ForCausalLM`` or
    ``*ForConditionalGeneration`` architecture and none of those."""
    architectures = config.get("architectures") or []
    if any(a in _DRAFTER_ARCHITECTURES for a in architectures) or "dflash_config" in config or "target_layer_ids" in config:
        return "drafter"
    if any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in architectures):
        return "target"
    return None


def check_roles(target_path: str, draft_path: str, target_flag: str = "--target", draft_flag: str = "--draft") -> None:
    """Refuse a drafter folder where the target belongs, a target where the drafter belongs, and the two
    swapped, saying which folder is the drafter (local folders only; a Hub id is read by transformers).

    Raises:
        CommandError: one line naming the flag, the folder and what it is.
    """
    target_role = config_role(_config(target_path, target_flag))
    draft_role = config_role(_config(draft_path, draft_flag))
    if target_role == "drafter" and draft_role == "target":
        raise CommandError(f"{target_flag} {target_path} is the DFlash drafter and {draft_flag} {draft_path} is a target "
                           f"model: swap them ({target_flag} {draft_path} {draft_flag} {target_path})")
    if target_role == "drafter":
        raise CommandError(f"{target_flag} {target_path}: a DFlash drafter folder; pass the target model (e.g. pair/target)")
    if draft_role == "target":
        raise CommandError(f"{draft_flag} {draft_path}: a target model (a causal LM), not a DFlash drafter; pass the "
                           "drafter folder (e.g. pair/drafter)")


def _load(what: str, flag: str, path: str, load):
    """``load()``, with the failures of a broken folder turned into one line naming ``flag`` and ``path``."""
    from safetensors import SafetensorError

    try:
        return load()
    except SafetensorError as err:
        raise CommandError(f"{flag} {path}: unreadable safetensors weights ({err}); restore or re-download "
                           f"the {what}") from err
    except FileNotFoundError as err:  # remote code: a code file the config's auto_map needs is missing
        missing = os.path.basename(err.filename or "") or str(err)
        raise CommandError(f"{flag} {path}: the {what} folder lacks {missing}; copy the package's code files "
                           "next to its config.json (or re-save it with save_pretrained)") from err
    except (OSError, ValueError, RuntimeError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CommandError(f"{flag} {path}: cannot load the {what}: {first}") from err


def check_pair(draft, target, draft_flag: str, target_flag: str, draft_path: str, target_path: str, device=None) -> None:
    """Raise [`CommandError`] unless ``draft`` was built for ``target``.

    Runs ``draft.spec_generate(target, one token, max_new_tokens=1)``: its argument checks (hidden size,
    layer taps, vocabulary, cache support) run before any forward pass and raise ``ValueError`` naming
    the mismatch, which becomes one line naming both folders.
    """
    import torch

    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    try:
        draft.spec_generate(target, ids, max_new_tokens=1, temperature=0.0, adaptive_block_size=False)
    except ValueError as err:
        first = (str(err).strip().splitlines() or ["ValueError"])[0]
        drafter = f"{draft_flag} {draft_path}".strip()
        raise CommandError(f"{drafter} does not fit {target_flag} {target_path}: {first}") from err


def unlinked_code_file(folder: str):
    """The first code file of ``folder`` that git checked out as a text file holding a link's target path
    (a checkout without symlink support, ``core.symlinks=false``: ``pair/drafter``'s code files are links
    to the root's), as ``(file name, target)``; None when there is none."""
    from pathlib import Path

    for path in sorted(Path(folder).glob("*.py")) + sorted(Path(folder).glob("custom_generate/*.py")):
        if path.is_symlink() or path.stat().st_size > 200:
            continue
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if text.startswith("../") and text.endswith(".py") and "\n" not in text:
            return path.name, text
    return None


def load_pair(target_path: str, draft_path: str, device, dtype, target_flag: str = "--target",
              draft_flag: str = "--draft", check: bool = True, use_kernels: bool = False):
    """``(draft, target, tokenizer)`` in ``dtype``, eval mode, on ``device``, checked to fit each other.

    Args:
        target_path, draft_path: local folders or Hub ids (see ``convert/paths.py``).
        target_flag, draft_flag: the flags to name in errors.
        check: run [`check_pair`] (a one-token probe).
        use_kernels: load Hub kernels (``--use-kernels``); else off on every version (``model_load_kwargs``).

    Raises:
        CommandError: see the module docstring.
    """
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    target_path = locate_model(target_path, target_flag)
    draft_path = locate_model(draft_path, draft_flag)
    check_roles(target_path, draft_path, target_flag, draft_flag)
    draft_config = _config(draft_path, draft_flag)
    if draft_config and not (draft_config.get("auto_map") or {}).get("AutoModel"):
        raise CommandError(f"{draft_flag} {draft_path}: its config.json has no auto_map (an --engine-only or SpecForge "
                           "folder: no remote code), so AutoModel would build a plain Qwen3Model; pass the folder "
                           "convert_checkpoint writes without --engine-only")
    unlinked = unlinked_code_file(draft_path) if os.path.isdir(draft_path) else None
    if unlinked is not None:
        raise CommandError(f"{draft_flag} {draft_path}: {unlinked[0]} holds the text {unlinked[1]!r}, not the code it "
                           "links to: this checkout has no symlinks; run `git config core.symlinks true` and "
                           "`git checkout -- pair/drafter` (on Windows, enable Developer Mode first)")
    tok = _load("target", target_flag, target_path, lambda: AutoTokenizer.from_pretrained(target_path))
    kernels = model_load_kwargs(use_kernels)
    target = _load("target", target_flag, target_path, lambda: AutoModelForCausalLM.from_pretrained(
        target_path, dtype=dtype, **kernels).to(device).eval())
    draft = _load("drafter", draft_flag, draft_path, lambda: AutoModel.from_pretrained(
        draft_path, trust_remote_code=True, dtype=dtype, **kernels).to(device).eval())
    if not hasattr(draft, "spec_generate"):
        from ._project import NOT_A_DRAFTER

        raise CommandError(f"{draft_flag} {draft_path}: AutoModel reads it as a plain {type(draft).__name__}: "
                           f"{NOT_A_DRAFTER} (an --engine-only folder has no remote code); pass the folder "
                           "convert_checkpoint wrote without --engine-only")
    if not hasattr(target, "get_output_embeddings") or target.get_output_embeddings() is None:
        raise CommandError(f"{target_flag} {target_path}: not a causal LM with an output head")
    if check:
        check_pair(draft, target, draft_flag, target_flag, draft_path, target_path, device)
    return draft, target, tok
