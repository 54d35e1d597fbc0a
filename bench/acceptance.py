"""The ``dflash-acceptance/v1`` record a measurement writes for a model card (schema: model_cards/README.md).

One naming rule for ``python -m bench --acceptance-out`` and ``demo.py --json``: the dataset is named by
``--dataset-name``, else ``--dataset`` (an evaluation set), else the ``--prompts`` file's stem
(``heldout_prompts`` for the shipped pair's prompts), so a card never shows your prompts under the
shipped pair's name. The record is validated with the card renderer's own validator before it is
written, so what ``model_cards.render --acceptance`` and ``convert.push_to_hub --acceptance`` read back
is always accepted.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["acceptance_record", "dataset_name", "display_path", "write_acceptance"]

ROOT = Path(__file__).resolve().parents[1]


def display_path(path) -> str:
    """``path`` relative to the repository when it lies inside it (``pair/target``), else as given."""
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except (ValueError, OSError):
        return str(path)


def dataset_name(name=None, dataset=None, prompts=None) -> str:
    """``name`` (``--dataset-name``), else ``dataset`` (``--dataset``), else the stem of the ``prompts`` file."""
    if name:
        return str(name)
    if dataset:
        return str(dataset)
    if prompts:
        return Path(prompts).stem
    raise ValueError("no dataset name: pass --dataset-name")


def acceptance_record(target: str, draft: str, block_size: int, dtype: str, device: str, name: str, num_prompts: int,
                      max_new_tokens: int, temperature: float, tau: float, speedup=None, transformers_version=None,
                      notes=None) -> dict:
    """A validated ``dflash-acceptance/v1`` record with one dataset row.

    Args:
        tau: acceptance length, mean tokens committed per verify step (bonus included), in [1, block_size].
        speedup: tokens/s over the target alone with the same settings (> 0), or None when not timed.

    Raises:
        model_cards.render.AcceptanceError: a value the schema refuses (named).
    """
    from model_cards.render import validate_acceptance

    record = {"schema": "dflash-acceptance/v1", "target": display_path(target), "draft": display_path(draft), "block_size": int(block_size),
              "dtype": str(dtype), "device": str(device),
              "datasets": [{"name": name, "num_prompts": int(num_prompts), "max_new_tokens": int(max_new_tokens),
                            "temperature": float(temperature), "tau": round(float(tau), 4),
                            "speedup": None if speedup is None else round(float(speedup), 4)}]}
    if transformers_version:
        record["transformers_version"] = str(transformers_version)
    if notes:
        record["notes"] = str(notes)
    return validate_acceptance(record)


def write_acceptance(record: dict, path) -> None:
    """Write ``record`` as JSON to ``path`` (a temporary name, then renamed: never half a file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
