"""Push a converted DFlash drafter folder to the Hugging Face Hub, with a model card.

    python -m convert.push_to_hub ./Qwen3-8B-DFlash-b16 --repo-id me/Qwen3-8B-DFlash-b16 --license mit --dry-run
    python -m convert.push_to_hub ./Qwen3-8B-DFlash-b16 --repo-id me/Qwen3-8B-DFlash-b16 --license mit --private

Uses ``huggingface_hub`` (``create_repo``, ``create_branch`` for a new ``--revision``,
``upload_folder``); the token comes from ``--token``, else ``HF_TOKEN``, else the cached
``huggingface-cli login``. When the folder has no ``README.md`` (or with ``--regenerate-card``) the
card of ``model_cards/`` is rendered and written into the folder before the upload.
``--dry-run`` checks the folder, lists exactly the files ``upload_folder`` would send and prints the
generated card (or writes it to ``--card-out``). A target recorded as a local path is refused unless
``--target-id`` gives its Hub id.
"""

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import sources
from .cli import add_debug_flag, quiet_loading, run_command
from .engines import is_hub_id
from .errors import ConversionError

# Passed to upload_folder as ignore_patterns (it adds its own DEFAULT_IGNORE_PATTERNS: .git, .cache/huggingface).
IGNORE_PATTERNS = ("__pycache__", "__pycache__/*", "*/__pycache__/*", "*.pyc", ".DS_Store", "*/.DS_Store", "_dflash_convert_tmp_*")


@dataclass
class PushPlan:
    """What [`push_to_hub`] sends: ``files`` are the folder-relative paths ``upload_folder`` uploads;
    ``card`` is ``"existing"``, ``"generated"`` or ``"none"``; ``card_text`` is the generated card, exactly as
    uploaded; ``url`` is the commit or PR URL after a push."""

    folder: str
    repo_id: str
    revision: str = None
    create_pr: bool = False
    private: bool = False
    dry_run: bool = True
    card: str = "none"
    files: list = field(default_factory=list)
    url: str = None
    card_text: str = None

    def describe(self) -> str:
        """A human-readable summary, printed by the command line."""
        where = f"{self.repo_id}@{self.revision or 'main'}" + (" (as a pull request)" if self.create_pr else "")
        head = f"{'Would upload' if self.dry_run else 'Uploaded'} {len(self.files)} file(s) from {self.folder} to {where}"
        lines = [head + (", private repo" if self.private else "")]
        lines += [f"  {name}" + (" (generated model card)" if name == "README.md" and self.card == "generated" else "")
                  for name in self.files]
        if self.url:
            lines.append(f"  -> {self.url}")
        return "\n".join(lines)


def files_to_upload(folder: str, allow_patterns=None, ignore_patterns=IGNORE_PATTERNS) -> list:
    """The folder-relative paths that ``HfApi.upload_folder`` would upload, in its order.

    Same listing and filtering as ``upload_folder``: every file under ``folder``, filtered by
    ``allow_patterns`` / ``ignore_patterns`` plus huggingface_hub's ``DEFAULT_IGNORE_PATTERNS``.
    """
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    root = Path(folder).expanduser().resolve()
    names = [p.relative_to(root).as_posix() for p in sorted(root.glob("**/*")) if p.is_file()]
    ignore = list(ignore_patterns or []) + list(DEFAULT_IGNORE_PATTERNS)
    return list(filter_repo_objects(names, allow_patterns=allow_patterns, ignore_patterns=ignore))


def check_push_folder(folder: str, files: list) -> str:
    """Check that ``files`` of ``folder`` make a loadable drafter in this project's format; return its dialect.

    Raises:
        ConversionError: not a folder; a config that is not this project's format or its engine-only
            layout (convert it first); ``auto_map`` without the remote-code files; no safetensors
            weights; pickle files that would be uploaded (named).
    """
    if not os.path.isdir(folder):
        raise ConversionError(f"{folder!r} is not a folder")
    dialect = sources.detect_dialect(sources.read_config(folder))
    if dialect not in ("dflash-hf", "specforge"):
        raise ConversionError(f"{folder!r} is in the {dialect} dialect; run python -m convert.convert_checkpoint on it first")
    missing = [name for name in sources.remote_code_files(folder) if name not in files]
    if dialect == "dflash-hf" and missing:
        raise ConversionError(f"config.json has auto_map but the upload lacks {missing}; AutoModel could not load it")
    if not any(name.endswith(".safetensors") for name in files):
        raise ConversionError(f"no .safetensors weights in {folder!r}")
    pickles = [name for name in files if name.endswith(sources.PICKLE_SUFFIXES)]
    if pickles:
        raise ConversionError(f"refusing to upload pickle files {pickles}; remove them (the safetensors weights suffice)")
    return dialect


def check_push_weights(folder: str) -> None:
    """Read the header of every safetensors weight file of ``folder`` (nothing is loaded), so that a truncated
    or corrupt file is refused before a dry run reports success or an upload starts.

    Raises:
        ConversionError: naming the unreadable file, or an index that names a missing shard.
    """
    fmt, paths = sources.find_weight_files(folder)
    sources.tensor_shapes(folder, fmt, paths)


def check_target_id(folder: str, target_id=None) -> None:
    """Refuse a card whose target is not a Hub repo id (the card's links, ``base_model`` and engine commands
    would point at a path of the machine that trained it, e.g. the shipped ``pair/target``).

    Raises:
        ConversionError: ``target_id`` is given but is not ``org/name``, or it is not given and the
            folder's config records a local path as ``target_model_id``.
    """
    if target_id is not None:
        if not is_hub_id(target_id):
            raise ConversionError(f"--target-id {target_id!r} is not a Hub repo id of the form 'org/name' (or it is a local path)")
        return
    recorded = sources.read_config(folder).get("target_model_id")
    if recorded is not None and not is_hub_id(recorded):
        raise ConversionError(f"{os.path.join(folder, 'config.json')} records the target as {recorded!r}, a local path, "
                              "not a Hub repo id: pass --target-id ORG/NAME (the target's Hub id) for the model card")


def push_to_hub(
    folder: str,
    repo_id: str,
    *,
    private: bool = False,
    revision=None,
    create_pr: bool = False,
    token=None,
    commit_message=None,
    dry_run: bool = False,
    card: bool = True,
    regenerate_card: bool = False,
    license=None,
    target_id=None,
    target_revision=None,
    acceptance=None,
    api=None,
) -> PushPlan:
    """Upload the drafter ``folder`` to the Hub repo ``repo_id``.

    Args:
        folder: a converted drafter folder (this project's format or its engine-only layout).
        repo_id: ``org/name`` on the Hub; created if missing (``private`` applies only then).
        revision: branch to push to (created from main if missing); None is ``main``.
        create_pr: open a pull request against ``revision`` instead of committing to it.
        token: Hub token; None uses ``HF_TOKEN`` or the cached login.
        commit_message: default ``"Upload DFlash drafter"``.
        dry_run: check and list the files, upload nothing, write nothing.
        card: write a model card when the folder has none; ``regenerate_card`` replaces an existing one.
        license, target_id, target_revision, acceptance: passed to ``model_cards.render_model_card``
            (``license`` is required when a card is generated).
        api: an ``HfApi``-like object (``create_repo``, ``create_branch``, ``upload_folder``); tests pass a fake.

    Returns:
        The [`PushPlan`]; ``url`` is set after a real push.

    Raises:
        ConversionError: the folder is not a pushable drafter (see [`check_push_folder`]), its target is
            not a Hub id (see [`check_target_id`]), or a card must be generated but no ``license`` was given.
        AcceptanceError: an invalid acceptance record.
        huggingface_hub errors: from the Hub calls (authentication, permissions, network).
    """
    files = files_to_upload(folder)
    check_push_folder(folder, files)
    check_push_weights(folder)
    check_target_id(folder, target_id)
    plan = PushPlan(folder=os.path.abspath(folder), repo_id=repo_id, revision=revision, create_pr=create_pr,
                    private=private, dry_run=dry_run, files=files)
    card_text = None
    if card and (regenerate_card or "README.md" not in files):
        if not license:
            raise ConversionError("a model card is generated for this upload: pass --license (license=...), e.g. mit or apache-2.0")
        from model_cards.render import render_model_card

        card_text = str(render_model_card(folder, repo_id, license=license, target_id=target_id,
                                          target_revision=target_revision, acceptance=acceptance))
        plan.card, plan.card_text, plan.files = "generated", card_text, sorted(set(files) | {"README.md"})
    elif "README.md" in files:
        plan.card = "existing"
    if dry_run:
        return plan
    if card_text is not None:
        Path(folder, "README.md").write_text(card_text, encoding="utf-8")
    plan.url = _upload(api, folder, repo_id, private, revision, create_pr, token, commit_message)
    plan.dry_run = False
    return plan


def _upload(api, folder, repo_id, private, revision, create_pr, token, commit_message) -> str:
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    if revision and revision != "main":
        api.create_branch(repo_id=repo_id, branch=revision, repo_type="model", exist_ok=True)
    info = api.upload_folder(
        repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision, create_pr=create_pr,
        commit_message=commit_message or "Upload DFlash drafter", ignore_patterns=list(IGNORE_PATTERNS),
    )
    return getattr(info, "pr_url", None) or getattr(info, "commit_url", None) or str(info)


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m convert.push_to_hub`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m convert.push_to_hub",
        description="Push a converted DFlash drafter folder to the Hugging Face Hub with a model card.",
    )
    parser.add_argument("folder", help="drafter folder written by convert.convert_checkpoint")
    parser.add_argument("--repo-id", required=True, help="Hub repo id to push to, e.g. me/Qwen3-8B-DFlash-b16")
    parser.add_argument("--private", action="store_true", help="create the repo as private (ignored if it exists)")
    parser.add_argument("--revision", help="branch to push to; created from main if missing (default main)")
    parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing directly")
    parser.add_argument("--token", help="Hub token (default: HF_TOKEN, else the cached `huggingface-cli login`)")
    parser.add_argument("--commit-message", help="commit message (default 'Upload DFlash drafter')")
    parser.add_argument("--dry-run", action="store_true", help="check the folder and list the files that would be uploaded")
    parser.add_argument("--no-card", dest="card", action="store_false", help="do not generate a model card")
    parser.add_argument("--regenerate-card", action="store_true", help="replace an existing README.md with a fresh card")
    parser.add_argument("--license", help="Hub license id of the weights for the card, e.g. mit or apache-2.0")
    parser.add_argument("--target-id", help="target repo id for the card (default: target_model_id from the config)")
    parser.add_argument("--target-revision", help="target revision for the card (default: from the config)")
    parser.add_argument("--acceptance", help="acceptance.json (schema dflash-acceptance/v1) to show in the card")
    parser.add_argument("--card-out", metavar="PATH",
                        help="with --dry-run: write the generated card here instead of printing it")
    return add_debug_flag(parser)


def main(argv=None) -> int:
    """Command-line entry point; returns the exit status (0 ok, 1 refused: one line on stderr)."""
    return run_command(_run, build_parser().parse_args(argv))


def _run(args) -> int:
    if args.card_out and not args.dry_run:
        raise ConversionError("--card-out shows the card of a --dry-run; add --dry-run (a real push writes README.md into the folder)")
    quiet_loading()
    plan = push_to_hub(
        args.folder, args.repo_id, private=args.private, revision=args.revision, create_pr=args.create_pr,
        token=args.token, commit_message=args.commit_message, dry_run=args.dry_run, card=args.card,
        regenerate_card=args.regenerate_card, license=args.license, target_id=args.target_id,
        target_revision=args.target_revision, acceptance=args.acceptance,
    )
    print(plan.describe())
    if plan.dry_run and plan.card_text is not None:
        if args.card_out:
            Path(args.card_out).write_text(plan.card_text, encoding="utf-8")
            print(f"wrote the card README.md would hold to {args.card_out}")
        else:
            print("\n----- README.md (generated model card), exactly as it would be uploaded -----")
            print(plan.card_text, end="" if plan.card_text.endswith("\n") else "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
