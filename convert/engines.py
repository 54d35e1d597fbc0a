"""Serving-engine command lines for a DFlash drafter (notes section 2, engine conventions).

The same folder serves both engines: vLLM counts drafted tokens without the anchor
(``num_speculative_tokens = block_size - 1``), SGLang counts the whole block
(``--speculative-num-draft-tokens = block_size``).
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


def vllm_num_speculative_tokens(block_size: int) -> int:
    """vLLM's ``num_speculative_tokens`` for a drafter trained with ``block_size``.

    Raises:
        ValueError: ``block_size < 2`` (a block of one token drafts nothing).
    """
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"block_size must be an integer >= 2 to draft anything, got {block_size!r}")
    return block_size - 1


def engine_commands(draft: str, block_size: int, target=None) -> dict:
    """``{"vllm": command, "sglang": command}`` serving ``target`` with drafter ``draft``.

    Args:
        draft: the drafter's folder or Hub repo id, as the engine should read it.
        block_size: the drafter's trained block size.
        target: the target's folder or repo id; None writes a ``<target-model>`` placeholder.

    Raises:
        ValueError: ``block_size < 2``.
    """
    target = target or TARGET_PLACEHOLDER
    spec = {"method": "dflash", "model": draft, "num_speculative_tokens": vllm_num_speculative_tokens(block_size)}
    vllm = f"vllm serve {_quote(target)} --speculative-config {shlex.quote(json.dumps(spec))}"
    sglang = (
        f"python -m sglang.launch_server --model-path {_quote(target)} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {_quote(draft)} --speculative-num-draft-tokens {block_size}"
    )
    return {"vllm": vllm, "sglang": sglang}


def _quote(value: str) -> str:
    return value if value == TARGET_PLACEHOLDER else shlex.quote(value)


__all__ = ["TARGET_PLACEHOLDER", "engine_commands", "is_hub_id", "vllm_num_speculative_tokens"]
