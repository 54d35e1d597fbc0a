"""Render the model card (``README.md``) of a DFlash drafter folder.

    python -m model_cards.render ./Qwen3-8B-DFlash-b16 --repo-id me/Qwen3-8B-DFlash-b16 --license mit \
        --acceptance acceptance.json -o ./Qwen3-8B-DFlash-b16/README.md

The card is ``dflash_card_template.md`` rendered by ``huggingface_hub.ModelCard.from_template`` with a
``ModelCardData`` header; ``model_cards/README.md`` documents the metadata choices and the
``acceptance.json`` schema (``dflash-acceptance/v1``).
"""

import argparse
import json
import os
import sys
from pathlib import Path

from convert import sources
from convert.cli import CommandError, add_debug_flag, run_command
from convert.engines import engine_commands, is_hub_id
from convert.errors import ConversionError

TEMPLATE_PATH = Path(__file__).with_name("dflash_card_template.md")
# The CI matrix of this project (.ci/run); the card states exactly these.
TESTED_TRANSFORMERS_VERSIONS = ("4.57.1", "5.24.0")
TAGS = ("dflash", "speculative-decoding", "block-diffusion", "draft-model")
ACCEPTANCE_SCHEMA = "dflash-acceptance/v1"
CITATION = (
    "@article{chen2026dflash,\n"
    "  title={{DFlash: Block Diffusion for Flash Speculative Decoding}},\n"
    "  author={Chen, Jian and Liang, Yesheng and Liu, Zhijian},\n"
    "  journal={arXiv preprint arXiv:2602.06036},\n"
    "  year={2026}\n"
    "}"
)

_REQUIRED = {"schema": str, "target": str, "draft": str, "block_size": int, "dtype": str, "device": str, "datasets": list}
_OPTIONAL = {"date": str, "transformers_version": str, "notes": str}
_ROW_REQUIRED = {"name": str, "num_prompts": int, "max_new_tokens": int, "temperature": float, "tau": float, "speedup": float}


class AcceptanceError(CommandError):
    """An ``acceptance.json`` that does not follow the ``dflash-acceptance/v1`` schema; the message names the field."""


def _is(value, kind) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def _check_fields(data: dict, required: dict, optional: dict, where: str, nullable=()) -> None:
    if not isinstance(data, dict):
        raise AcceptanceError(f"{where} must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(required) - set(optional))
    if unknown:
        raise AcceptanceError(f"{where} has unknown field(s) {unknown}; the schema allows {sorted(required) + sorted(optional)}")
    for name, kind in {**required, **optional}.items():
        if name not in data:
            if name in required:
                raise AcceptanceError(f"{where} is missing the field {name!r}")
            continue
        if data[name] is None and name in nullable:
            continue
        if not _is(data[name], kind):
            raise AcceptanceError(f"{where}.{name} must be {kind.__name__}, got {data[name]!r}")


def validate_acceptance(data: dict) -> dict:
    """Check an acceptance record against the ``dflash-acceptance/v1`` schema and return it.

    Raises:
        AcceptanceError: wrong ``schema`` tag, a missing / unknown / mistyped field, no datasets,
            ``block_size < 1``, a non-positive count, a negative temperature, ``tau`` outside
            ``[1, block_size]`` or a non-positive ``speedup``; the message names the field.
    """
    _check_fields(data, _REQUIRED, _OPTIONAL, "acceptance")
    if data["schema"] != ACCEPTANCE_SCHEMA:
        raise AcceptanceError(f"acceptance.schema must be {ACCEPTANCE_SCHEMA!r}, got {data['schema']!r}")
    block = data["block_size"]
    if block < 1:
        raise AcceptanceError(f"acceptance.block_size must be >= 1, got {block}")
    if not data["datasets"]:
        raise AcceptanceError("acceptance.datasets is empty")
    for i, row in enumerate(data["datasets"]):
        where = f"acceptance.datasets[{i}]"
        _check_fields(row, _ROW_REQUIRED, {}, where, nullable=("speedup",))
        for name in ("num_prompts", "max_new_tokens"):
            if row[name] < 1:
                raise AcceptanceError(f"{where}.{name} must be >= 1, got {row[name]}")
        if row["temperature"] < 0:
            raise AcceptanceError(f"{where}.temperature must be >= 0, got {row['temperature']}")
        if not 1 <= row["tau"] <= block:
            raise AcceptanceError(f"{where}.tau={row['tau']} is outside [1, block_size={block}] (tau counts committed tokens per step)")
        if row["speedup"] is not None and row["speedup"] <= 0:
            raise AcceptanceError(f"{where}.speedup must be > 0 or null, got {row['speedup']}")
    return data


def load_acceptance(path) -> dict:
    """Read and validate an ``acceptance.json`` file.

    Raises:
        AcceptanceError: invalid JSON or a record that breaks the schema (see [`validate_acceptance`]).
    """
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as err:
            raise AcceptanceError(f"{path} is not valid JSON: {err}") from err
    if isinstance(data, dict) and "main" in data and "environment" in data and "schema" not in data:
        raise AcceptanceError(f"{path} is a `python -m bench` report, not an acceptance record: rerun the benchmark "
                              "with --acceptance-out PATH [--dataset-name NAME] and pass that file")
    return validate_acceptance(data)


def card_metadata(target_id, license: str, remote_code: bool):
    """The YAML header of the card.

    The target goes into ``base_model`` with ``base_model_relation: adapter`` when it is a Hub repo id
    (see model_cards/README.md for why); local target paths are left out of the metadata.
    """
    from huggingface_hub import ModelCardData

    tags = list(TAGS) + (["custom_code"] if remote_code else [])
    extra = {"base_model": target_id, "base_model_relation": "adapter"} if is_hub_id(target_id) else {}
    return ModelCardData(license=license, library_name="transformers", pipeline_tag="text-generation", tags=tags, **extra)


def _read_folder(folder: str):
    from convert.convert_checkpoint import translate_config

    raw = sources.read_config(folder)
    dialect = sources.detect_dialect(raw)
    if dialect not in ("dflash-hf", "specforge"):
        raise ConversionError(f"{folder!r} is in the {dialect} dialect; run python -m convert.convert_checkpoint on it first")
    config = translate_config(raw)
    needed = sources.remote_code_files(folder)
    remote_code = dialect == "dflash-hf" and all(os.path.isfile(os.path.join(folder, f)) for f in needed)
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "unknown dtype"
    return config, remote_code, dtype


def _published_names(acceptance: dict, repo_id: str, target_id) -> dict:
    """The record as the card shows it: the draft named by ``repo_id`` and the target by ``target_id`` when that
    is a Hub id, in place of the local folders the measurement ran from (a public card naming
    ``runs/pair-drafter-hf`` or a home folder helps no reader). The record itself is not changed."""
    shown = dict(acceptance, draft=repo_id)
    if target_id and is_hub_id(target_id):
        shown["target"] = target_id
    return shown


def render_model_card(
    folder: str,
    repo_id: str,
    *,
    license: str,
    target_id=None,
    target_revision=None,
    acceptance=None,
    transformers_versions=TESTED_TRANSFORMERS_VERSIONS,
):
    """The model card (a ``huggingface_hub.ModelCard``) of the drafter in ``folder``, to be published as ``repo_id``.

    Args:
        folder: a drafter folder in this project's format (or its engine-only layout).
        repo_id: where the card will live; used in the usage snippet and engine commands.
        license: the Hub license id of the drafter's weights (e.g. ``"mit"``, ``"apache-2.0"``).
        target_id / target_revision: default to the config's ``target_model_id`` / ``target_revision``.
        acceptance: an acceptance record (dict, validated) or a path to ``acceptance.json``.
        transformers_versions: the versions the code was tested with, stated in the card.

    Raises:
        ConversionError: the folder is not a drafter in this project's format or its engine-only layout.
        AcceptanceError: the acceptance record breaks the schema or its block size exceeds the draft's.
        CommandError (a ValueError): empty ``license`` or ``repo_id``.
    """
    if not license or not repo_id:
        raise CommandError(f"license and repo_id are required, got license={license!r}, repo_id={repo_id!r}")
    config, remote_code, dtype = _read_folder(folder)
    target_id = target_id or config.target_model_id
    target_revision = target_revision or config.target_revision
    if isinstance(acceptance, (str, os.PathLike)):
        acceptance = load_acceptance(acceptance)
    elif acceptance is not None:
        acceptance = validate_acceptance(acceptance)
    if acceptance is not None and acceptance["block_size"] > config.block_size:
        raise AcceptanceError(f"acceptance.block_size={acceptance['block_size']} exceeds the draft's block_size={config.block_size}")
    if acceptance is not None:
        acceptance = _published_names(acceptance, repo_id, target_id)
    commands = engine_commands(repo_id, config.block_size, target_id, draft_layer_types=config.layer_types)
    layer_summary = ", ".join(f"{t} x{config.layer_types.count(t)}" for t in dict.fromkeys(config.layer_types))
    if config.sliding_window and "sliding_attention" in config.layer_types:
        layer_summary += f", window {config.sliding_window}"
    from huggingface_hub import ModelCard

    return ModelCard.from_template(
        card_metadata(target_id, license, remote_code),
        template_path=str(TEMPLATE_PATH),
        model_name=repo_id.rstrip("/").split("/")[-1],
        repo_id=repo_id,
        repo_id_literal=json.dumps(repo_id),
        target_id=target_id,
        target_id_literal=json.dumps(target_id or "<target-model>"),
        target_url=f"https://huggingface.co/{target_id}" if is_hub_id(target_id) else target_id,
        target_revision=target_revision,
        revision_kwarg=f", revision={json.dumps(target_revision)}" if target_revision and is_hub_id(target_id) else "",
        block_size=config.block_size,
        target_layer_ids=list(config.target_layer_ids),
        mask_token_id=config.mask_token_id,
        num_hidden_layers=config.num_hidden_layers,
        layer_summary=layer_summary,
        hidden_size=config.hidden_size,
        dflash2={k: getattr(config, k) for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
        if config.is_dflash2 else None,
        dtype=dtype,
        remote_code=remote_code,
        vllm_command=commands["vllm"],
        sglang_command=commands["sglang"],
        acceptance=acceptance,
        transformers_versions=list(transformers_versions),
        citation=CITATION,
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m model_cards.render`` argument parser."""
    parser = argparse.ArgumentParser(prog="python -m model_cards.render", description="Render the model card of a DFlash drafter folder.")
    parser.add_argument("folder", help="drafter folder in this project's format (or engine-only)")
    parser.add_argument("--repo-id", required=True, help="Hub repo id the card is for, e.g. me/Qwen3-8B-DFlash-b16")
    parser.add_argument("--license", required=True, help="Hub license id of the weights, e.g. mit or apache-2.0")
    parser.add_argument("--target-id", help="target repo id (default: target_model_id from the config)")
    parser.add_argument("--target-revision", help="target revision (default: target_revision from the config)")
    parser.add_argument("--acceptance", help="acceptance.json (schema dflash-acceptance/v1) to show in the card")
    parser.add_argument("-o", "--output", help="write the card here (default: print it)")
    return add_debug_flag(parser)


def main(argv=None) -> int:
    """Command-line entry point; returns the exit status (0 ok, 1 refused: one line on stderr)."""
    return run_command(_run, build_parser().parse_args(argv))


def _run(args) -> int:
    card = render_model_card(args.folder, args.repo_id, license=args.license, target_id=args.target_id,
                             target_revision=args.target_revision, acceptance=args.acceptance)
    target = args.target_id or sources.read_config(args.folder).get("target_model_id")
    if target is not None and not is_hub_id(target):
        print(f"warning: the target {target!r} is not a Hub repo id: the card links to it and serves it as is; "
              "pass --target-id ORG/NAME", file=sys.stderr)
    if args.output:
        card.save(args.output)
        print(f"wrote {args.output}")
    else:
        print(str(card))
    return 0


if __name__ == "__main__":
    sys.exit(main())
