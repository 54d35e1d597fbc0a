"""Convert any supported DFlash drafter (folder or Hub repo id) into this project's format, verified.

    python -m convert.convert_checkpoint z-lab/Qwen3-8B-DFlash-b16 ./Qwen3-8B-DFlash-b16
    python -m convert.convert_checkpoint ./specforge-export ./out --engine-only --dry-run

The one path for every dialect (see ``convert/sources.py`` for the list):

1. ``config.json`` -> ``DFlashConfig`` (the config class reads every published spelling);
2. weights -> renamed / dropped through the single key map of ``convert/keymap.py``, then checked
   against the model built from that config: an unmapped or missing key is an error naming it;
3. ``DFlashDraftModel`` (``DFlash2DraftModel`` for DFlash 2) loaded strictly, ``save_pretrained`` into a temporary folder next to the
   output (this writes the project's remote-code files and ``auto_map``; ``--engine-only`` removes
   both for engines that refuse unknown files); the config stays in the published Qwen3 dialect;
4. verification (on by default): the written folder reloads (with ``AutoModel(trust_remote_code=True)``
   unless engine-only), its tensors equal the source's bit for bit, its forward equals the source
   weights' forward on random inputs, plain ``AutoConfig`` reads it as Qwen3 + ``dflash_config``, and
   with ``--verify-target`` the draft logits on the target's real features match and greedy
   ``spec_generate`` gives the same tokens and acceptance lengths;
5. the temporary folder is renamed to the output: a failure anywhere leaves no output folder.
"""

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field

from .cli import add_debug_flag, launch, quiet_loading, run_command

# ----------------------------------------------------------------------------- command line (first, so that
# `--help` and flag errors answer before torch and transformers are imported)


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m convert.convert_checkpoint`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m convert.convert_checkpoint",
        description="Convert a published DFlash drafter (z-lab Hub repo, SpecForge export, this project's own "
        "format; safetensors single or sharded) into a verified folder that loads with "
        "AutoModel.from_pretrained(..., trust_remote_code=True) and with vLLM / SGLang.",
    )
    parser.add_argument("source", help="source folder, or Hub repo id such as z-lab/Qwen3-8B-DFlash-b16")
    parser.add_argument("output", help="output folder; must not exist unless --overwrite")
    parser.add_argument("--revision", help="Hub revision (branch, tag or commit) of a repo-id source")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="accept pytorch_model*.bin pickles, read with torch.load(weights_only=True)")
    parser.add_argument("--engine-only", action="store_true",
                        help="write no remote-code .py files and no auto_map (for engines that refuse unknown files)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output folder, once the new one is complete and verified")
    parser.add_argument("--dry-run", action="store_true",
                        help="check everything and print what would be written; write nothing (a Hub source is "
                        "still downloaded to the Hugging Face cache to read its keys)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip verification (reload, bit-equal tensors, equal outputs on random inputs)")
    parser.add_argument("--verify-target", metavar="TARGET",
                        help="target folder or repo id: also compare draft logits on its features and greedy spec_generate output")
    parser.add_argument("--target-id", help="record the target's Hub repo id in the config (target_model_id)")
    parser.add_argument("--target-revision", help="record the target's revision in the config (target_revision)")
    parser.add_argument("--token", help="Hub token for a private source (default: HF_TOKEN or the cached login)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random verification inputs (default 0)")
    return add_debug_flag(parser)


if __name__ == "__main__":  # --help, flag errors and an early Ctrl-C answer before the heavy imports below
    sys.exit(launch("convert.convert_checkpoint", parser=build_parser))

import torch  # noqa: E402

from . import keymap, sources  # noqa: E402
from ._project import CUSTOM_GENERATE_FILE, REMOTE_CODE_FILES, DFlash2DraftModel, DFlashConfig, DFlashDraftModel, capture_target_features, spec_generate  # noqa: E402
from .engines import DFLASH2_ENGINE_NOTE, DSPARK_BASELINE_NOTE, DSPARK_ENGINE_NOTE, engine_commands, is_hub_id  # noqa: E402
from .errors import ConversionError  # noqa: E402
from .loading import model_load_kwargs  # noqa: E402

MAX_SHARD_SIZE = "5GB"
_MAX_SHARD_BYTES = 5 * 10**9
# Source config keys that describe the source files rather than the drafter; they are rewritten.
_NOT_CARRIED = ("auto_map", "transformers_version", "_name_or_path", "torch_dtype", "dtype")
_TMP_PREFIX = "_dflash_convert_tmp_"


@dataclass
class ConversionPlan:
    """What a conversion reads, maps and writes; returned by [`convert_checkpoint`] (also on a dry run).

    ``mapping`` is ``{source_key: project_key}`` for every kept tensor, ``dropped`` is
    ``{source_key: reason}``; ``files`` are the output files (predicted on a dry run); ``checks``
    lists the verifications that passed.
    """

    source: str
    source_dir: str
    dialect: str
    weight_format: str
    weight_files: list
    mapping: dict
    dropped: dict
    config: DFlashConfig
    output: str
    engine_only: bool
    dry_run: bool
    files: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    checks: list = field(default_factory=list)

    @property
    def renamed(self) -> dict:
        """``{source_key: project_key}`` for the keys whose name changes."""
        return {old: new for old, new in self.mapping.items() if old != new}

    def engine_commands(self, target=None) -> dict:
        """The vLLM / SGLang command lines serving this output (see ``convert/engines.py``)."""
        return engine_commands(self.output, self.config.block_size, target or self.config.target_model_id,
                               draft_layer_types=self.config.layer_types,
                               dspark=bool(getattr(self.config, "is_dspark", False)))

    def describe(self) -> str:
        """A human-readable summary, printed by the command line."""
        cfg = self.config
        kinds = ", ".join(f"{t} x{cfg.layer_types.count(t)}" for t in dict.fromkeys(cfg.layer_types))
        lines = [
            f"DFlash conversion {'plan (dry run, nothing written)' if self.dry_run else 'done'}",
            f"  source:   {self.source}" + ("" if self.source == self.source_dir else f" ({self.source_dir})"),
            f"  dialect:  {self.dialect}; weights: {self.weight_format} ({len(self.weight_files)} file(s))",
            f"  config:   block_size {cfg.block_size}, target_layer_ids {cfg.target_layer_ids}, mask_token_id "
            f"{cfg.mask_token_id}, {cfg.num_hidden_layers} layers ({kinds}), hidden {cfg.hidden_size}",
            f"  keys:     {len(self.mapping)} kept, {len(self.renamed)} renamed, {len(self.dropped)} dropped",
        ]
        if cfg.is_dflash2:
            lines.insert(4, f"  DFlash 2: convolution {cfg.conv_kernel_size} taps, groups of {cfg.conv_group_size} channels; "
                            f"selector top-k {cfg.selector_top_k}, rank {cfg.selector_rank}")
        lines += _capped([f"    renamed {old} -> {new}" for old, new in self.renamed.items()])
        lines += _capped([f"    dropped {key} ({why})" for key, why in self.dropped.items()])
        lines += [f"  note:     {note}" for note in self.notes]
        layout = "engine-only: no remote code, no auto_map" if self.engine_only else "remote code + auto_map"
        lines.append(f"  output:   {self.output} ({layout})")
        if self.engine_only:
            lines.append("  load:     AutoModel.from_pretrained would build a plain Qwen3Model from this folder (it has no "
                         "remote code); in Python load it with DFlashDraftModel.from_pretrained(folder) "
                         "(from dflash_hf.modeling_dflash import DFlashDraftModel, after pip install -e .)")
        lines.append(f"  files:    {', '.join(self.files)}")
        if self.checks:
            lines.append("  verified: " + "; ".join(self.checks))
        commands = self.engine_commands()
        lines += ["  serve with:", f"    vLLM:   {commands['vllm']}", f"    SGLang: {commands['sglang']}"]
        if cfg.is_dflash2:
            lines.append(f"    note:   {DFLASH2_ENGINE_NOTE}")
        if getattr(cfg, "is_dspark", False):
            lines.append(f"    note:   {DSPARK_ENGINE_NOTE}")
            if not cfg.markov_rank:
                lines.append(f"    note:   {DSPARK_BASELINE_NOTE}")
        return "\n".join(lines)


def _capped(lines: list, limit: int = 10) -> list:
    return lines if len(lines) <= limit else lines[:limit] + [f"    ... and {len(lines) - limit} more"]


# ----------------------------------------------------------------------------- config and weights


def translate_config(config_dict: dict, target_id=None, target_revision=None) -> DFlashConfig:
    """The ``DFlashConfig`` of a source ``config.json`` dict (any supported dialect).

    File-bound keys (``auto_map``, ``transformers_version``, ``dtype``...) are not carried: the
    writer sets them for the new folder (the dtype follows the stored weights). ``target_id`` /
    ``target_revision``, when given, are recorded as ``target_model_id`` / ``target_revision``.

    Raises:
        ConversionError: the config is rejected by ``DFlashConfig`` (its message names the value).
    """
    values = {k: v for k, v in config_dict.items() if k not in _NOT_CARRIED}
    if target_id is not None:
        values["target_model_id"] = target_id
    if target_revision is not None:
        values["target_revision"] = target_revision
    try:
        return DFlashConfig.from_dict(values)
    except (TypeError, ValueError) as err:
        raise ConversionError(f"config.json is not a valid DFlash config: {err}") from err


def draft_class(config: DFlashConfig):
    """``DSparkDraftModel`` for a DeepSpec DSpark config, ``DFlash2DraftModel`` for a DFlash 2 one, else
    ``DFlashDraftModel``."""
    if getattr(config, "is_dspark", False):
        return DFlashDraftModel._dspark_class
    return DFlash2DraftModel if config.is_dflash2 else DFlashDraftModel


def _meta_draft(config: DFlashConfig) -> DFlashDraftModel:
    with torch.device("meta"):
        return draft_class(config)(config)


def expected_shapes(config: DFlashConfig) -> dict:
    """``{key: shape}`` of the state dict of a ``DFlashDraftModel`` built from ``config`` (no memory used)."""
    return {k: tuple(v.shape) for k, v in _meta_draft(config).state_dict().items()}


def build_draft(config: DFlashConfig, state_dict: dict) -> DFlashDraftModel:
    """A ``DFlashDraftModel`` holding exactly ``state_dict`` (project key names), in the stored dtypes.

    The model is built on the meta device and the tensors are assigned, so nothing is copied or cast.

    Raises:
        RuntimeError: from ``load_state_dict(strict=True)``; call [`keymap.check_keys`] first for
            messages that name the source keys.
    """
    model = _meta_draft(config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    return model.eval()


def strip_remote_code(folder: str) -> None:
    """Turn a written folder into the engine-only layout: delete the remote-code files and ``auto_map``."""
    for name in REMOTE_CODE_FILES + (CUSTOM_GENERATE_FILE,):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            os.remove(path)
    custom_dir = os.path.join(folder, os.path.dirname(CUSTOM_GENERATE_FILE))
    if os.path.isdir(custom_dir) and not os.listdir(custom_dir):
        os.rmdir(custom_dir)
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config.pop("auto_map", None)
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_folder(model: DFlashDraftModel, folder: str, engine_only: bool = False) -> list:
    """Save ``model`` into ``folder`` in the project's format and return the sorted file names."""
    model.save_pretrained(folder, max_shard_size=MAX_SHARD_SIZE)
    if engine_only:
        strip_remote_code(folder)
    return sorted(os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
                  for root, _, names in os.walk(folder) for name in names)


def _predicted_files(weight_paths: list, engine_only: bool) -> list:
    size = sum(os.path.getsize(p) for p in weight_paths)
    weights = ["model.safetensors"] if size <= _MAX_SHARD_BYTES else [
        "model-XXXXX-of-XXXXX.safetensors (shards of at most 5GB)", "model.safetensors.index.json"]
    return sorted(["config.json"] + weights + ([] if engine_only else [*REMOTE_CODE_FILES, CUSTOM_GENERATE_FILE]))


# ----------------------------------------------------------------------------- verification


def _random_draft_inputs(config: DFlashConfig, dtype, seed: int, context_len: int = 7) -> dict:
    gen = torch.Generator().manual_seed(seed)
    block = config.block_size
    return {
        "position_ids": torch.arange(context_len + block).unsqueeze(0),
        "noise_embedding": torch.randn(1, block, config.hidden_size, generator=gen).to(dtype),
        "target_hidden": torch.randn(1, context_len, config.num_target_features * config.target_hidden_size,
                                     generator=gen).to(dtype),
    }


def _load_written(folder: str, engine_only: bool):
    """Load the written folder the way users will: AutoModel + remote code, or our class (engine-only)."""
    if engine_only:
        # a DFlash 2 folder gives DFlash2DraftModel
        return DFlashDraftModel.from_pretrained(folder, dtype="auto", **model_load_kwargs()).eval()
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype="auto", **model_load_kwargs()).eval()
    want = draft_class(model.config).__name__
    if type(model).__name__ != want or type(model).__module__ == DFlashDraftModel.__module__:
        raise ConversionError(f"AutoModel(trust_remote_code=True) gave {type(model)}, not the folder's own {want}")
    return model


def _check_plain_config(folder: str, config: DFlashConfig) -> None:
    from transformers import AutoConfig

    plain = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    nested = getattr(plain, "dflash_config", None) or {}
    if getattr(config, "is_dspark", False):  # DeepSpec's dialect keeps these keys at top level (engines read them there)
        nested = {k: getattr(plain, k, None) for k in ("target_layer_ids", "mask_token_id", "block_size")}
    want = {"target_layer_ids": config.target_layer_ids, "mask_token_id": config.mask_token_id, "block_size": config.block_size}
    got = {k: nested.get(k) for k in want}
    if plain.model_type != "qwen3" or got != want:
        raise ConversionError(f"plain AutoConfig reads model_type={plain.model_type!r}, dflash_config={nested}; expected qwen3 with {want}")


def _check_tensors(folder: str, reference: DFlashDraftModel) -> None:
    fmt, paths = sources.find_weight_files(folder)
    written = sources.load_tensors(folder, fmt, paths)
    expected = reference.state_dict()
    if set(written) != set(expected):
        raise ConversionError(f"written keys differ from the source: {sorted(set(written) ^ set(expected))}")
    for key, value in expected.items():
        if written[key].dtype != value.dtype or not torch.equal(written[key], value):
            raise ConversionError(f"written tensor {key!r} differs from the source tensor")


def _check_forward(converted, reference, seed: int) -> None:
    inputs = _random_draft_inputs(reference.config, reference.fc.weight.dtype, seed)
    with torch.no_grad():
        want, got = reference(**inputs), converted(**inputs)
    try:
        torch.testing.assert_close(got, want)
    except AssertionError as err:
        raise ConversionError(f"the converted draft's output differs from the source on random inputs:\n{err}") from err


def _draft_logits(draft, target, prompt):
    """Target-head logits of ``draft``'s first block after ``prompt``, drafted from the target's real features."""
    with capture_target_features(target, draft.config.target_layer_ids) as features:
        target(prompt)
        context = features()[:, :-1]  # the anchor sees features of earlier positions only
    block = torch.full((1, draft.config.block_size), draft.config.mask_token_id, dtype=torch.long)
    block[0, 0] = prompt[0, -1]
    positions = torch.arange(prompt.shape[1] - 1 + block.shape[1]).unsqueeze(0)
    hidden = draft(position_ids=positions, noise_embedding=target.get_input_embeddings()(block), target_hidden=context)
    head = target.get_output_embeddings()
    return head(hidden.to(head.weight.dtype))


def _check_generation(converted, reference, target, seed: int) -> None:
    if isinstance(target, str):
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(target, dtype="auto", **model_load_kwargs()).eval()
    from .loading import check_pair

    name = getattr(target, "name_or_path", type(target).__name__)
    check_pair(reference, target, "the drafter", "--verify-target", "", name)  # one line before any forward
    gen = torch.Generator().manual_seed(seed)
    vocab = target.get_input_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (1, 8), generator=gen)
    with torch.no_grad():
        want, got = _draft_logits(reference, target, prompt), _draft_logits(converted, target, prompt)
    try:
        torch.testing.assert_close(got, want)
    except AssertionError as err:
        raise ConversionError(f"the converted draft's logits on the target's features differ from the source:\n{err}") from err
    kwargs = dict(max_new_tokens=2 * reference.config.block_size + 1, stop_token_ids=[], temperature=0.0,
                  return_dict_in_generate=True)
    want = spec_generate(reference, target, prompt, **kwargs)
    got = spec_generate(converted, target, prompt, **kwargs)
    if not torch.equal(got.sequences, want.sequences) or got.acceptance_lengths != want.acceptance_lengths:
        raise ConversionError(
            f"greedy spec_generate differs: source draft gave {want.sequences.tolist()} (acceptance "
            f"{want.acceptance_lengths}), converted {got.sequences.tolist()} (acceptance {got.acceptance_lengths})"
        )


def verify_conversion(folder: str, reference: DFlashDraftModel, engine_only: bool = False, target=None, seed: int = 0) -> list:
    """Check a written folder against the source draft ``reference``; return the checks that passed.

    Args:
        folder: the written (temporary) folder.
        reference: the draft holding the source tensors.
        engine_only: the folder has no remote code (loaded with this project's class instead).
        target: optional target model, folder or Hub repo id: the drafts' logits on the target's real
            features must match, and greedy ``spec_generate`` must give the same tokens and acceptance
            lengths (the tokens alone equal the target's own output whatever the draft: lossless).
        seed: seed of the random inputs.

    Raises:
        ConversionError: naming the first check that failed.
    """
    checks = []
    _check_plain_config(folder, reference.config)
    checks.append("plain AutoConfig reads a qwen3 config with " + (
        "DeepSpec's top-level DSpark keys" if getattr(reference.config, "is_dspark", False) else "dflash_config"))
    _check_tensors(folder, reference)
    checks.append("written tensors equal the source bit for bit")
    converted = _load_written(folder, engine_only)
    checks.append("loads with " + ("DFlashDraftModel.from_pretrained" if engine_only else "AutoModel(trust_remote_code=True)"))
    _check_forward(converted, reference, seed)
    checks.append("same forward output as the source on random inputs")
    if target is not None:
        _check_generation(converted, reference, target, seed)
        checks.append("same draft logits on the target's features and same greedy spec_generate tokens and acceptance")
    return checks


# ----------------------------------------------------------------------------- atomic output


def _check_output(output: str, overwrite: bool) -> None:
    if os.path.lexists(output) and not os.path.isdir(output):
        raise ConversionError(f"output {output!r} exists and is not a folder; it is never replaced")
    if os.path.lexists(output) and not overwrite:
        raise FileExistsError(f"output folder {output!r} already exists; pass --overwrite (overwrite=True) to replace it")


def _check_not_nested(source_dir: str, output: str) -> None:
    src, out = os.path.realpath(source_dir), os.path.realpath(output)
    if os.path.commonpath([src, out]) in (src, out):
        raise ConversionError(f"output {output!r} and source {source_dir!r} overlap; write the output elsewhere")


@contextlib.contextmanager
def staged_output(output: str, overwrite: bool):
    """Yield a temporary folder next to ``output``; on success rename it to ``output``, on any
    failure delete it, so that ``output`` is either complete or untouched.

    Raises:
        FileExistsError: ``output`` appeared meanwhile and ``overwrite`` is False.
    """
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=parent)
    try:
        _normal_permissions(tmp)
        yield tmp
        _check_output(output, overwrite)
        _move_into_place(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _normal_permissions(folder: str) -> None:
    """Give ``folder`` the mode of a folder made with ``mkdir`` (``0o777`` minus the umask), not
    ``mkdtemp``'s owner-only ``0o700``: the renamed output is a normal folder others may read."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)


def _move_into_place(tmp: str, output: str) -> None:
    if not os.path.lexists(output):
        os.rename(tmp, output)
        return
    trash = tempfile.mkdtemp(prefix=_TMP_PREFIX + "old_", dir=os.path.dirname(output))
    previous = os.path.join(trash, "previous")
    os.rename(output, previous)
    try:
        os.rename(tmp, output)
    except BaseException:
        os.rename(previous, output)
        raise
    finally:
        shutil.rmtree(trash, ignore_errors=True)


# ----------------------------------------------------------------------------- the conversion


def last_layer_tap_warning(target_layer_ids, num_target_layers):
    """A warning naming the tap when a drafter taps its target's LAST layer (None otherwise or when the
    target's depth is unknown).

    Layer id k is the output of target layer k (notes section 2); for the last layer this package and the
    authors' code take the state after the final norm (Hugging Face ``hidden_states[-1]``), vLLM feeds the
    state before it, and SGLang does not capture it at all, so the engines serve such a drafter with other
    features than it was trained on. Seen running vLLM 0.33 and SGLang 0.5.23 up to weight loading
    (issue 26); the published drafters stop at layer L - 3.
    """
    if num_target_layers is None or (num_target_layers - 1) not in list(target_layer_ids):
        return None
    return (f"warning: target_layer_ids {list(target_layer_ids)} tap layer {num_target_layers - 1}, the target's last "
            f"layer ({num_target_layers} layers): this package takes it after the final norm, vLLM before it and SGLang "
            "not at all, so the engines serve this drafter differently; drafters trained for engines tap at most "
            f"layer {num_target_layers - 3}")


def plan_conversion(source: str, source_dir: str, output: str, allow_pickle=False, engine_only=False,
                    target_id=None, target_revision=None) -> ConversionPlan:
    """Read a source folder and plan its conversion without loading any tensor data (safetensors).

    Raises:
        ConversionError: unsupported dialect, invalid config, refused pickles, or weights that do not
            fit the config (every unmapped, missing or misshapen key is named).
    """
    raw = sources.read_config(source_dir)
    dialect = sources.detect_dialect(raw)
    config = translate_config(raw, target_id, target_revision)
    fmt, paths = sources.find_weight_files(source_dir, allow_pickle)
    shapes = sources.tensor_shapes(source_dir, fmt, paths)
    expected = expected_shapes(config)
    mapping, dropped = keymap.map_keys(shapes, keep=expected)  # a DSpark drafter keeps its own embed_tokens / lm_head
    keymap.check_keys(mapping, shapes, expected)
    plan = ConversionPlan(
        source=source, source_dir=source_dir, dialect=dialect, weight_format=fmt, weight_files=paths,
        mapping=mapping, dropped=dropped, config=config, output=output, engine_only=engine_only, dry_run=True,
        files=_predicted_files(paths, engine_only),
    )
    nested = raw.get("dflash_config") or {}
    if "target_layer_ids" not in nested and "target_layer_ids" not in raw:
        plan.notes.append(f"no target_layer_ids in the source: legacy layer rule gave {config.target_layer_ids}, now stored explicitly")
    warning = last_layer_tap_warning(config.target_layer_ids, config.num_target_layers)
    if warning:
        plan.notes.append(warning)
    target = config.target_model_id
    if target is not None and not is_hub_id(target):
        plan.notes.append(f"the target is recorded as {target!r}, which is not a Hub repo id: model cards and engine "
                          "commands would point at it; pass --target-id ORG/NAME (push_to_hub refuses it otherwise)")
    if dialect == "z-lab":
        plan.notes.append(f"the source's own remote code ({raw['auto_map']['AutoModel']}) is not used; this project's code replaces it")
    return plan


def _check_roles(source: str, source_dir: str, verify_target) -> None:
    """Refuse a target model as the source and a drafter folder as ``--verify-target`` (the two swapped:
    the message says which folder is the drafter), before any weight is read.

    Raises:
        ConversionError: naming the folder and what it is.
    """
    from .loading import config_role

    target_role = config_role(sources.read_config(verify_target)) if isinstance(verify_target, str) and os.path.isdir(
        verify_target) else None
    if config_role(sources.read_config(source_dir)) == "target":
        swap = (f"; --verify-target {verify_target} is the drafter: swap them (convert {verify_target} ... "
                f"--verify-target {source})") if target_role == "drafter" else ""
        raise ConversionError(f"source {source}: a target model (a causal LM), not a DFlash drafter{swap}")
    if target_role == "drafter":
        raise ConversionError(f"--verify-target {verify_target}: a DFlash drafter folder; pass the target model the "
                              "drafter was trained for")


def convert_checkpoint(
    source: str,
    output: str,
    *,
    revision=None,
    allow_pickle: bool = False,
    engine_only: bool = False,
    overwrite: bool = False,
    dry_run: bool = False,
    verify: bool = True,
    verify_target=None,
    target_id=None,
    target_revision=None,
    token=None,
    seed: int = 0,
) -> ConversionPlan:
    """Convert the DFlash drafter ``source`` (folder or Hub repo id) into a verified folder ``output``.

    Args:
        source: a local folder, or a Hub repo id (only ``config.json`` and weights are downloaded).
        output: the folder to write; it must not exist unless ``overwrite``.
        revision: Hub revision of ``source``.
        allow_pickle: accept ``pytorch_model*.bin`` weights (read with ``torch.load(weights_only=True)``).
        engine_only: write no remote-code files and no ``auto_map`` (for engines that refuse them).
        overwrite: replace an existing ``output`` folder (only once the new one is complete and verified).
        dry_run: plan and check everything, write nothing; ``plan.files`` lists what would be written.
        verify: run [`verify_conversion`] before the output appears.
        verify_target: target model, folder or repo id: also compare the draft logits on its features
            and the greedy ``spec_generate`` tokens and acceptance lengths.
        target_id / target_revision: recorded in the config as ``target_model_id`` / ``target_revision``.
        token: Hub token for downloading ``source`` (None: ``HF_TOKEN`` or the cached login).
        seed: seed of the random verification inputs.

    Returns:
        The [`ConversionPlan`], with ``files`` written and ``checks`` passed.

    Raises:
        FileExistsError: ``output`` exists and ``overwrite`` is False (checked before any work).
        ConversionError: unsupported source, a key that is unmapped or missing (named), a refused
            pickle, overlapping source/output, or a failed verification. Nothing is left at ``output``.
    """
    output = os.path.abspath(output)
    _check_output(output, overwrite)
    if isinstance(verify_target, str):  # a local path that is missing is said now, with no Hub call
        from .paths import locate_model

        verify_target = locate_model(verify_target, "--verify-target")
    source_dir = sources.resolve_source(source, revision, allow_pickle, token)
    _check_roles(source, source_dir, verify_target)
    _check_not_nested(source_dir, output)
    plan = plan_conversion(source, source_dir, output, allow_pickle, engine_only, target_id, target_revision)
    if dry_run:
        return plan
    tensors = sources.load_tensors(source_dir, plan.weight_format, plan.weight_files)
    reference = build_draft(plan.config, {new: tensors[old] for old, new in plan.mapping.items()})
    del tensors
    with staged_output(output, overwrite) as tmp:
        plan.files = write_folder(reference, tmp, engine_only)
        if engine_only and plan.dialect == "deepspec":  # the engines read DeepSpec's own config.json: keep it as is
            shutil.copyfile(os.path.join(source_dir, "config.json"), os.path.join(tmp, "config.json"))
            plan.notes.append("engine-only DeepSpec folder: config.json is the source's, byte for byte"
                              + (" (target_model_id / target_revision not recorded: DeepSpec's config has no such key)"
                                 if target_id or target_revision else ""))
        if verify:
            plan.checks = verify_conversion(tmp, reference, engine_only, verify_target, seed)
    plan.dry_run = False
    return plan


def main(argv=None) -> int:
    """Command-line entry point; returns the exit status (0 ok, 1 refused or failed: one line on stderr)."""
    return run_command(_run, build_parser().parse_args(argv))


def _run(args) -> int:
    quiet_loading()
    plan = convert_checkpoint(
        args.source, args.output, revision=args.revision, allow_pickle=args.allow_pickle,
        engine_only=args.engine_only, overwrite=args.overwrite, dry_run=args.dry_run, verify=args.verify,
        verify_target=args.verify_target, target_id=args.target_id, target_revision=args.target_revision,
        token=args.token, seed=args.seed,
    )
    print(plan.describe())
    return 0

