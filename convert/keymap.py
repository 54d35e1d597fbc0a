"""The single explicit key map from every supported weight dialect to this project's state dict.

Our state-dict names equal the published z-lab / SpecForge checkpoints (notes section 2): ``fc.weight``,
``hidden_norm.weight``, ``norm.weight`` and ``layers.{i}.*`` (DFlash 2 adds ``layers.{i}.{attention,mlp}_conv.*``
and ``candidate_selector.*``, codebooks without a ``.weight`` suffix), with no ``model.`` prefix, no
``embed_tokens`` and no ``lm_head``. So the map is short, and it is the only place where a source
key may be renamed or dropped; every other key must already be one of the model's own names.
"""

import re

from .errors import ConversionError

try:  # run from the repository root
    from configuration_dflash import UNUSED_TENSORS
except ImportError:  # installed with `pip install .`
    from dflash_hf.configuration_dflash import UNUSED_TENSORS

# (pattern, replacement) pairs, tried in order; the first pattern that matches renames the key.
KEY_RENAMES = (
    # DFlash 2 codebooks saved by a trainer's nn.Embedding (z-lab's own class loads the published names
    # into ``.weight`` with key_mapping): the published names have no suffix.
    (re.compile(r"^(?:model\.)?(candidate_selector\.(?:predecessor|successor)_codebook)\.weight$"), r"\1"),
    # Exports that saved the draft inside a wrapper with `base_model_prefix = "model"`.
    (re.compile(r"^model\.((?:fc|hidden_norm|norm)\.weight|layers\.\d+\..+|candidate_selector\..+)$"), r"\1"),
)

# Keys that are dropped on purpose, with the reason printed in the conversion plan: the tensors that
# ``from_pretrained`` drops too (``configuration_dflash.UNUSED_TENSORS``, the one list).
DROPPED_KEYS = tuple((re.compile(pattern), reason) for pattern, reason in UNUSED_TENSORS)


def drop_reason(key: str):
    """Why ``key`` is dropped, or None when it is kept."""
    for pattern, reason in DROPPED_KEYS:
        if pattern.match(key):
            return reason
    return None


def rename_key(key: str) -> str:
    """The project name of source key ``key`` (unchanged when no rename rule matches)."""
    for pattern, replacement in KEY_RENAMES:
        if pattern.match(key):
            return pattern.sub(replacement, key)
    return key


# Source keys of a dialect that is refused by name (z-lab tests/fixtures/assistant-safetensors-header.json).
REFUSED_KEY = (re.compile(r"^encoder\.(?:fc|output_norm_enc)\."),
               "the Muse Glimmer v1 assistant dialect (encoder.fc / encoder.output_norm_enc) is not read here")


def map_keys(source_keys, keep=()) -> tuple[dict, dict]:
    """Map source keys to project keys. ``keep``: project keys the model has (a DSpark drafter's own
    ``embed_tokens`` / ``lm_head``), kept even where ``DROPPED_KEYS`` would drop them.

    Returns:
        ``(mapping, dropped)``: ``mapping`` is ``{source_key: project_key}`` for every kept key;
        ``dropped`` is ``{source_key: reason}``.

    Raises:
        ConversionError: two source keys map to the same project key (both are named), or a key of a
            dialect refused by name (``REFUSED_KEY``).
    """
    mapping, dropped, seen = {}, {}, {}
    for key in sorted(source_keys):
        if REFUSED_KEY[0].match(key):
            raise ConversionError(f"source key {key!r}: {REFUSED_KEY[1]}")
        reason = None if rename_key(key) in keep else drop_reason(key)
        if reason is not None:
            dropped[key] = reason
            continue
        new = rename_key(key)
        if new in seen:
            raise ConversionError(f"source keys {seen[new]!r} and {key!r} both map to {new!r}")
        seen[new] = key
        mapping[key] = new
    return mapping, dropped


def check_keys(mapping: dict, source_shapes: dict, expected_shapes: dict) -> None:
    """Check that the mapped source keys are exactly the model's keys, with the model's shapes.

    Args:
        mapping: ``{source_key: project_key}`` from [`map_keys`].
        source_shapes: ``{source_key: shape tuple}``.
        expected_shapes: ``{project_key: shape tuple}`` of a ``DFlashDraftModel`` built from the config.

    Raises:
        ConversionError: naming every unmapped source key (a key the model does not have), every
            missing model key, and every shape mismatch.
    """
    mapped = {new: old for old, new in mapping.items()}
    problems = []
    unknown = sorted(k for k in mapped if k not in expected_shapes)
    if unknown:
        names = ", ".join(repr(mapped[k]) + ("" if mapped[k] == k else f" (as {k!r})") for k in unknown)
        problems.append(f"unmapped source key(s) that the DFlash draft does not have: {names}")
    missing = sorted(k for k in expected_shapes if k not in mapped)
    if missing:
        problems.append(f"missing key(s) that the DFlash draft needs: {', '.join(map(repr, missing))}")
    for key in sorted(set(mapped) & set(expected_shapes)):
        got, want = tuple(source_shapes[mapped[key]]), tuple(expected_shapes[key])
        if got != want:
            problems.append(f"tensor {mapped[key]!r} has shape {list(got)}, but the config implies {list(want)} "
                            f"for {key!r}")
    if problems:  # the first problem on the first line: command lines print only that line
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise ConversionError(f"the source weights do not fit the DFlash draft built from its config: {problems[0]}"
                              f"{more}" + ("".join("\n  " + p for p in problems) if more else ""))


__all__ = ["DROPPED_KEYS", "KEY_RENAMES", "REFUSED_KEY", "check_keys", "drop_reason", "map_keys", "rename_key"]
