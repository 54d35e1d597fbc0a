"""Reading a source drafter: where it is, which dialect it speaks, which weight files it has.

Supported dialects (all read through the one config path, ``DFlashConfig``):

- ``z-lab``: the z-lab Hub repos; Qwen3 ``config.json`` + ``dflash_config`` and
  ``auto_map = {"AutoModel": "dflash.DFlashDraftModel"}`` with the remote code in ``dflash.py``
  (that code is never imported or run here).
- ``specforge``: SpecForge exports and this project's ``--engine-only`` folders; the same config
  without ``auto_map`` and without code.
- ``dflash-hf``: this project's own format (``auto_map`` into ``modeling_dflash``); converting it
  again is a lossless no-op.

Each of them as DFlash (``DFlashDraftModel``) or DFlash 2 (``DFlash2DraftModel``: the DFlash 2 keys
``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k`` in ``dflash_config``
or at top level; z-lab ``tests/fixtures/dflash2-config.json``).

Any of them with weights in one ``*.safetensors`` file, in shards listed by
``model.safetensors.index.json``, or (only with ``allow_pickle``) in ``pytorch_model.bin`` pickles,
single or sharded, read with ``torch.load(weights_only=True)``.

Refused with a message saying why: vllm-project/speculators DFlash exports (reduced draft vocabulary
with ``d2t``/``t2d`` maps), the Muse Glimmer v1 assistant dialect (``MuseGlimmerAssistantModel``,
``encoder.*`` weight names; z-lab ``tests/fixtures/assistant-config.json``), DSpark drafters, and any
config that is not a Qwen3-dialect DFlash draft (``configuration_dflash.DRAFT_ARCHITECTURES``).
"""

import contextlib
import json
import os
import re

from .errors import ConversionError

# The project's remote-code files: what ``save_pretrained`` copies next to a drafter (the modeling file
# and its relative imports) and what ``auto_map`` points into.
REMOTE_CODE_FILES = ("configuration_dflash.py", "modeling_dflash.py", "remote_code_cache.py", "generation_utils.py",
                     "generation_arguments.py", "speculative_sampling.py", "stopping_criteria.py", "decode_step.py",
                     "generation_output.py", "native_routes.py", "custom_generate_template.py", "target_taps.py",
                     "target_cache.py", "target_families.py", "static_generate.py", "dflash2.py", "dspark.py",
                     "cache_reuse.py", "user_processors.py", "proposers.py", "target_facts.py",
                     "draft_trees.py", "verify_policy.py", "verify_cost.py", "tested_versions.py")
# A single-dot relative import, as transformers reads them (`from .x import ...`, `import .x`).
_RELATIVE_IMPORT = re.compile(r"^\s*(?:from\s+\.(\w+)\s+import|import\s+\.(\w+))", re.MULTILINE)
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a Hub download of a source needs: the config and the weights, never its code.
_DOWNLOAD_PATTERNS = ("config.json", "*.safetensors", SAFETENSORS_INDEX)
_PICKLE_PATTERNS = ("pytorch_model*.bin", PICKLE_INDEX)
# Config keys of dialects that the DFlash draft here cannot represent.
_SPECULATORS_KEYS = ("speculators_model_type", "speculators_config", "speculators_version")
_MUSE_GLIMMER_V1 = ("MuseGlimmerAssistantModel", "muse_glimmer_assistant")


def remote_code_files(folder: str) -> tuple:
    """The code files that ``folder`` (a drafter in this project's format) needs to load: its
    ``modeling_dflash.py`` and every flat file that file imports relatively (transformers 4.57 copies
    exactly those, so the modeling file imports each sibling itself).

    A folder is judged by its own modeling file, not by today's ``REMOTE_CODE_FILES``: one written by an
    older version of this package (six code files before the generation code was split by concern) still
    loads, renders and pushes. A folder without a modeling file needs ``REMOTE_CODE_FILES``.
    """
    path = os.path.join(folder, "modeling_dflash.py")
    if not os.path.isfile(path):
        return REMOTE_CODE_FILES
    with open(path, encoding="utf-8") as f:
        imported = {a or b for a, b in _RELATIVE_IMPORT.findall(f.read())}
    return ("modeling_dflash.py",) + tuple(sorted(f"{name}.py" for name in imported))


def resolve_source(source: str, revision=None, allow_pickle: bool = False, token=None) -> str:
    """A local folder for ``source``: the folder itself, or a Hub snapshot of repo id ``source``.

    The Hub download takes only ``config.json`` and the weights (plus ``.bin`` files with
    ``allow_pickle``); remote code in the source repo is never downloaded. ``token`` None means the
    usual places (``HF_TOKEN``, the cached login).

    Raises:
        ConversionError: ``source`` is neither an existing folder nor a Hub repo id, a ``revision``
            is given for a local folder, or the Hub cannot give the repo (unknown, gated, offline: named).
    """
    if os.path.isdir(source):
        if revision is not None:
            raise ConversionError(f"--revision {revision!r} applies to Hub repo ids, but {source!r} is a local folder")
        return os.path.abspath(source)
    from .paths import looks_local

    if looks_local(source):  # `pair/drafterx` while pair/ exists: a mistyped folder, never a Hub id
        raise ConversionError(f"source {source}: no such folder")
    if os.path.exists(source) or not _REPO_ID.match(source):
        raise ConversionError(f"source {source!r} is neither a folder nor a Hub repo id of the form 'org/name'")
    import huggingface_hub

    from .cli import hub_error_message

    patterns = list(_DOWNLOAD_PATTERNS) + (list(_PICKLE_PATTERNS) if allow_pickle else [])
    try:
        return huggingface_hub.snapshot_download(repo_id=source, revision=revision, allow_patterns=patterns, token=token)
    except Exception as err:
        message = hub_error_message(err, source)
        if message is None:
            raise
        raise ConversionError(message) from err


def read_config(folder: str) -> dict:
    """The parsed ``config.json`` of ``folder``.

    Raises:
        ConversionError: no ``config.json``, or it is not a JSON object.
    """
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"no config.json in {folder!r}: not a Hugging Face checkpoint folder")
    with open(path, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as err:
            raise ConversionError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise ConversionError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def detect_dialect(config: dict) -> str:
    """Name the dialect of a source ``config.json``: ``"z-lab"``, ``"specforge"``, ``"dflash-hf"`` or ``"deepspec"``
    (DeepSpec's ``Qwen3DSparkModel`` folders, DSpark and its DFlash block7 baselines).

    Raises:
        ConversionError: a known but unsupported dialect (speculators, Muse Glimmer v1 assistant) or a
            config that is not a Qwen3-dialect DFlash / DFlash 2 draft; the message names the deciding key.
    """
    architectures = list(config.get("architectures") or [])
    found = [k for k in _SPECULATORS_KEYS if k in config]
    if found:
        raise ConversionError(
            f"config key {found[0]!r}: vllm-project/speculators DFlash exports are not supported (reduced draft "
            "vocabulary with d2t/t2d maps and aux_hidden_state_layer_ids; the DFlash draft here uses the full target vocabulary)"
        )
    found = [a for a in architectures if a in _MUSE_GLIMMER_V1] + [t for t in [config.get("model_type")] if t in _MUSE_GLIMMER_V1]
    if found:
        raise ConversionError(
            f"{found[0]!r} marks the Muse Glimmer v1 assistant dialect (weights 'encoder.fc' / 'encoder.output_norm_enc', "
            "config without dflash_config), which is not read here; convert from the published DFlash / DFlash 2 layout"
        )
    model_type = config.get("model_type")
    if model_type != "qwen3":
        raise ConversionError(f"config model_type={model_type!r}: only Qwen3-dialect DFlash drafts (model_type 'qwen3') are supported")
    refusal = _architecture_refusal(architectures)
    if refusal:
        raise ConversionError(f"config {refusal}")
    if set(architectures) & set(_dspark_architectures()):
        return "deepspec"
    if not architectures and "dflash_config" not in config:
        raise ConversionError("config has neither architectures ['DFlashDraftModel'] nor dflash_config: not a DFlash draft")
    auto_model = (config.get("auto_map") or {}).get("AutoModel", "")
    if auto_model.startswith("modeling_dflash."):
        return "dflash-hf"
    if auto_model:
        return "z-lab"
    return "specforge"


def _architecture_refusal(architectures):
    """``configuration_dflash.architecture_refusal``: the loader's one rule for which draft architectures are
    implemented (DeepSpec's DSpark models included, ``Gemma4DSparkModel`` and every other name refused),
    imported at call time so ``--help`` needs no torch."""
    try:  # run from the repository root
        from configuration_dflash import architecture_refusal
    except ImportError:  # installed with `pip install .`
        from dflash_hf.configuration_dflash import architecture_refusal
    return architecture_refusal(architectures, accept_dspark=True)


def _dspark_architectures():
    try:  # run from the repository root
        from configuration_dflash import DSPARK_ARCHITECTURES
    except ImportError:  # installed with `pip install .`
        from dflash_hf.configuration_dflash import DSPARK_ARCHITECTURES
    return DSPARK_ARCHITECTURES


def find_weight_files(folder: str, allow_pickle: bool = False) -> tuple[str, list]:
    """The weight files of ``folder`` and their format, safetensors first.

    Returns:
        ``(format, paths)`` with format one of ``"safetensors"``, ``"safetensors-sharded"``,
        ``"pickle"``, ``"pickle-sharded"``.

    Raises:
        ConversionError: no weights; several unindexed safetensors files; an index naming a missing
            shard; pickle files only and ``allow_pickle`` False.
    """
    names = sorted(os.listdir(folder))
    if SAFETENSORS_INDEX in names:
        return "safetensors-sharded", _indexed_files(folder, SAFETENSORS_INDEX)
    tensors = [n for n in names if n.endswith(".safetensors")]
    if len(tensors) == 1:
        return "safetensors", [os.path.join(folder, tensors[0])]
    if len(tensors) > 1:
        raise ConversionError(f"{folder!r} holds several .safetensors files {tensors} but no {SAFETENSORS_INDEX}")
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if not pickles and PICKLE_INDEX not in names:
        raise ConversionError(f"no weights in {folder!r}: expected *.safetensors (or pytorch_model.bin with allow_pickle)")
    if not allow_pickle:
        raise ConversionError(
            f"{folder!r} has only pickle weights {pickles or [PICKLE_INDEX]}; they are refused because unpickling can run code. "
            "Pass --allow-pickle (allow_pickle=True) to read them with torch.load(weights_only=True)"
        )
    if PICKLE_INDEX in names:
        return "pickle-sharded", _indexed_files(folder, PICKLE_INDEX)
    if len(pickles) > 1:
        raise ConversionError(f"{folder!r} holds several pickle files {pickles} but no {PICKLE_INDEX}")
    return "pickle", [os.path.join(folder, pickles[0])]


def _indexed_files(folder: str, index_name: str) -> list:
    weight_map = _read_index(folder, index_name)
    paths = []
    for shard in sorted(set(weight_map.values())):
        path = os.path.join(folder, shard)
        if not os.path.isfile(path):
            raise ConversionError(f"{index_name} lists shard {shard!r}, which is not in {folder!r}")
        paths.append(path)
    return paths


def _read_index(folder: str, index_name: str) -> dict:
    with open(os.path.join(folder, index_name), encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConversionError(f"{index_name} in {folder!r} has no weight_map")
    return weight_map


def tensor_shapes(folder: str, fmt: str, paths: list) -> dict:
    """``{key: shape}`` of every source tensor; safetensors headers only, nothing is loaded.

    Raises:
        ConversionError: as [`load_tensors`] (duplicate keys, index and shards disagree).
    """
    if fmt.startswith("safetensors"):
        from safetensors import safe_open

        per_file = {}
        for path in paths:
            with _readable_safetensors(path):
                with safe_open(path, framework="pt") as f:
                    per_file[path] = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        return _merge(folder, fmt, per_file)
    return {k: tuple(v.shape) for k, v in load_tensors(folder, fmt, paths).items()}


@contextlib.contextmanager
def _readable_safetensors(path: str):
    """Turn safetensors' own error (``incomplete metadata``, ``header too large``: no file name) into a
    ``ConversionError`` that names ``path``."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as err:
        raise ConversionError(f"{path} is not a readable safetensors file ({err}): it is truncated or corrupt; "
                              "download or save it again") from err


def load_tensors(folder: str, fmt: str, paths: list) -> dict:
    """``{key: tensor}`` of every source tensor, on CPU, in the stored dtypes.

    Pickles go through ``torch.load(weights_only=True)``, which refuses anything but tensors and
    plain containers.

    Raises:
        ConversionError: a key stored twice, a pickle holding something other than a dict of
            tensors, or (sharded) a key in a shard that the index does not list or the reverse.
    """
    per_file = {}
    for path in paths:
        if fmt.startswith("safetensors"):
            from safetensors.torch import load_file

            with _readable_safetensors(path):
                per_file[path] = load_file(path, device="cpu")
        else:
            import torch

            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
                raise ConversionError(f"{path} does not hold a flat dict of tensors")
            per_file[path] = state
    return _merge(folder, fmt, per_file)


def _merge(folder: str, fmt: str, per_file: dict) -> dict:
    """Merge per-file dicts, checking duplicates and (sharded formats) agreement with the index."""
    merged, origin = {}, {}
    for path, entries in per_file.items():
        for key, value in entries.items():
            if key in merged:
                raise ConversionError(f"key {key!r} is stored twice, in {origin[key]} and {os.path.basename(path)}")
            merged[key], origin[key] = value, os.path.basename(path)
    if fmt.endswith("-sharded"):
        index_name = SAFETENSORS_INDEX if fmt.startswith("safetensors") else PICKLE_INDEX
        weight_map = _read_index(folder, index_name)
        for key, shard in origin.items():
            if weight_map.get(key) != shard:
                raise ConversionError(f"key {key!r} is in shard {shard!r} but {index_name} says {weight_map.get(key)!r}")
        absent = sorted(set(weight_map) - set(origin))
        if absent:
            raise ConversionError(f"{index_name} lists key(s) found in no shard: {', '.join(map(repr, absent))}")
    return merged


__all__ = [
    "REMOTE_CODE_FILES", "detect_dialect", "remote_code_files", "find_weight_files", "load_tensors", "read_config", "resolve_source", "tensor_shapes",
]
