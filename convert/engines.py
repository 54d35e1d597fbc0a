"""Serving-engine command lines for a DFlash drafter (notes section 2, engine conventions).

The same folder serves both engines: vLLM counts drafted tokens without the anchor
(``num_speculative_tokens = block_size - 1``), SGLang counts the whole block
(``--speculative-num-draft-tokens = block_size``).

A DFlash 2 folder takes the same flags: both engines pick DFlash 2 from the config's
``architectures: ["DFlash2DraftModel"]`` and build the convolutions and the selector from
``dflash_config``. vLLM: method ``"dflash"`` (``vllm/config/speculative.py``), model
``vllm/model_executor/models/qwen3_dflash2.py`` registered for ``DFlash2DraftModel``, the V2 model
runner forced by ``VllmConfig._is_dflash2_draft`` (vllm-project/vllm PR #52816). SGLang: the DFLASH
worker with ``DFlash2DraftModel`` in ``python/sglang/srt/models/dflash.py`` ``EntryClass``
(sgl-project/sglang PR #35371). See [`DFLASH2_ENGINE_NOTE`].

A DSpark folder (DeepSpec's ``architectures: ["Qwen3DSparkModel"]``, issue 38) drafts ``block_size``
tokens and verifies ``block_size + 1`` (slot k is ``start + k + 1``), so both counts move by one:
vLLM method ``"dspark"`` with ``num_speculative_tokens = block_size`` (vllm-project/vllm
``vllm/config/speculative.py`` @ 002e77c1: ``DSparkModelTypes = Literal["dspark"]``, a draft whose
``architectures`` hold ``Qwen3DSparkModel`` is detected as ``"dspark"``, and its Qwen3-Omni check
requires ``num_speculative_tokens`` == the trained ``block_size``); SGLang ``--speculative-algorithm
DSPARK`` with ``--speculative-num-draft-tokens = block_size + 1`` (sgl-project/sglang
``python/sglang/srt/arg_groups/speculative_hook.py`` @ 004c82e0 ``_handle_dspark``: "DSpark
speculative_num_draft_tokens must equal gamma + 1", gamma read from the checkpoint's ``block_size``;
``arg_groups/fields/spec.py`` @ 015c8726 lists ``DSPARK`` among the builtin algorithms). See
[`DSPARK_ENGINE_NOTE`].
"""

import json
import os
import re
import shlex

TARGET_PLACEHOLDER = "<target-model>"


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(value) -> bool:
    """Whether ``value`` reads as a Hub repo id ``org/name`` and is not an existing local path
    (``pair/target`` from the repository root is a folder, not the Hub repo ``pair/target``)."""
    return bool(value) and bool(_HUB_ID.match(str(value))) and not os.path.exists(value)


# What a DFlash 2 folder needs of the engines beyond the flags (printed by the converter).
DFLASH2_ENGINE_NOTE = ("DFlash 2 (architectures DFlash2DraftModel): same flags; vLLM needs a build with "
                       "vllm-project/vllm#52816 (it forces the V2 model runner itself), SGLang a build with "
                       "sgl-project/sglang#35371 (both merged August 2026, after the last tagged releases)")


# What a DSpark folder's flags rest on (printed by the converter).
DSPARK_ENGINE_NOTE = ("DSpark (architectures Qwen3DSparkModel): a block of block_size slots drafts block_size tokens "
                      "and verifies block_size + 1, hence vLLM num_speculative_tokens = block_size and SGLang "
                      "--speculative-num-draft-tokens = block_size + 1 (vLLM method \"dspark\", "
                      "vllm/config/speculative.py; SGLang DSPARK, arg_groups/speculative_hook.py _handle_dspark). "
                      "vLLM's optional \"enable_adaptive_verification\": true uses the confidence head")
DSPARK_BASELINE_NOTE = ("a DeepSpec DFlash baseline (markov_rank 0, no confidence head): both engines route it as "
                        "DSpark by its architectures; that their DSpark models accept markov_rank 0 was not checked")


def vllm_num_speculative_tokens(block_size: int) -> int:
    """vLLM's ``num_speculative_tokens`` for a drafter trained with ``block_size``.

    Raises:
        ValueError: ``block_size < 2`` (a block of one token drafts nothing).
    """
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"block_size must be an integer >= 2 to draft anything, got {block_size!r}")
    return block_size - 1


# Targets with linear-attention (Gated DeltaNet) layers: SGLang keeps per-position recurrent states
# during verify with this cache option (notes section 7, the reference Qwen3.5-35B-A3B deployment).
# SGLang renamed it: `--mamba-scheduler-strategy` is refused by 0.5.23, which takes
# `--mamba-radix-cache-strategy` (server_args.py field `mamba_radix_cache_strategy`, choices auto /
# no_buffer / extra_buffer / extra_buffer_lazy); tests/fixtures/engine_args.json cites the source.
HYBRID_TARGET_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def engine_commands(draft: str, block_size: int, target=None, draft_layer_types=None, target_model_type=None,
                    dspark: bool = False) -> dict:
    """``{"vllm": command, "sglang": command}`` serving ``target`` with drafter ``draft``.

    Args:
        draft: the drafter's folder or Hub repo id, as the engine should read it.
        block_size: the drafter's trained block size.
        target: the target's folder or repo id; None writes a ``<target-model>`` placeholder.
        draft_layer_types: the drafter's ``layer_types``. A drafter mixing ``sliding_attention`` and
            ``full_attention`` layers (Qwen3.6, Gemma 4 drafters) needs vLLM's V2 model runner
            (``VLLM_USE_V2_MODEL_RUNNER=1``; vLLM's DFlash model raises otherwise).
        target_model_type: the target's ``model_type``; hybrid linear-attention targets
            (``HYBRID_TARGET_TYPES``) get SGLang's ``--mamba-radix-cache-strategy extra_buffer``.
        dspark: a DSpark drafter (module docstring): vLLM method ``"dspark"`` with ``num_speculative_tokens =
            block_size``, SGLang ``DSPARK`` with ``--speculative-num-draft-tokens = block_size + 1``; the V2
            model-runner switch is DFlash's and is not written for it.

    Raises:
        ValueError: ``block_size < 2`` (DFlash) or ``< 1`` (DSpark).
    """
    target = target or TARGET_PLACEHOLDER
    if dspark:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"a DSpark block_size must be an integer >= 1, got {block_size!r}")
        method, drafted, verified, algorithm, env = "dspark", block_size, block_size + 1, "DSPARK", ""
    else:
        method, drafted, verified, algorithm = "dflash", vllm_num_speculative_tokens(block_size), block_size, "DFLASH"
        kinds = set(draft_layer_types or [])
        env = "VLLM_USE_V2_MODEL_RUNNER=1 " if {"sliding_attention", "full_attention"} <= kinds else ""
    spec = {"method": method, "model": draft, "num_speculative_tokens": drafted}
    vllm = f"{env}vllm serve {_quote(target)} --speculative-config {shlex.quote(json.dumps(spec))}"
    sglang = (
        f"python -m sglang.launch_server --model-path {_quote(target)} --speculative-algorithm {algorithm} "
        f"--speculative-draft-model-path {_quote(draft)} --speculative-num-draft-tokens {verified}"
    )
    if target_model_type in HYBRID_TARGET_TYPES:
        sglang += " --mamba-radix-cache-strategy extra_buffer"
    return {"vllm": vllm, "sglang": sglang}


def _quote(value: str) -> str:
    return value if value == TARGET_PLACEHOLDER else shlex.quote(value)


__all__ = ["DFLASH2_ENGINE_NOTE", "DSPARK_BASELINE_NOTE", "DSPARK_ENGINE_NOTE", "HYBRID_TARGET_TYPES", "TARGET_PLACEHOLDER", "engine_commands", "is_hub_id", "vllm_num_speculative_tokens"]
