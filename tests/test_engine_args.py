"""The engine command lines the converter and the model cards print use only argument names the engines
accept (issue 26: SGLang 0.5.23 refused `--mamba-scheduler-strategy`). The accepted names are a fixture
taken from each engine's public source (tests/fixtures/engine_args.json names file and commit)."""

import json
import shlex
from pathlib import Path

import pytest

from convert.engines import HYBRID_TARGET_TYPES, engine_commands

ARGS = json.loads((Path(__file__).parent / "fixtures" / "engine_args.json").read_text())
CASES = [dict(), dict(draft_layer_types=["sliding_attention", "full_attention"])] + [
    dict(target_model_type=t) for t in HYBRID_TARGET_TYPES]


def _options(words):
    """``{--flag: value}`` of a tokenized command line (flags followed by one value)."""
    out, i = {}, 0
    while i < len(words):
        if words[i].startswith("--"):
            out[words[i]] = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else None
        i += 1
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: next(iter(c.values()), "plain") if isinstance(
    next(iter(c.values()), ""), str) else "mixed-layers")
def test_commands_use_only_accepted_arguments(case):
    cmds = engine_commands("me/drafter", 16, "org/target", **case)
    words = shlex.split(cmds["sglang"])
    assert words[:3] == ["python", "-m", ARGS["sglang"]["module"]]
    options = _options(words[3:])
    assert set(options) <= set(ARGS["sglang"]["options"]), set(options) - set(ARGS["sglang"]["options"])
    assert not set(options) & set(ARGS["sglang"]["refused"])
    for flag, choices in ARGS["sglang"]["choices"].items():
        assert flag not in options or options[flag] in choices, (flag, options[flag])
    assert options["--speculative-num-draft-tokens"] == "16"

    words = [w for w in shlex.split(cmds["vllm"]) if "=" not in w or w.startswith("{")]  # drop the env prefix
    assert words[0] == "vllm" and words[1] in ARGS["vllm"]["command"]
    options = _options(words[3:])
    assert set(options) <= set(ARGS["vllm"]["options"])
    spec = json.loads(options["--speculative-config"])
    assert set(spec) <= set(ARGS["vllm"]["speculative_config_keys"]) and spec["method"] in ARGS["vllm"]["methods"]
    assert spec["num_speculative_tokens"] == 15


def test_hybrid_targets_get_the_renamed_sglang_cache_flag():
    cmd = engine_commands("me/drafter", 16, "org/target", target_model_type="qwen3_5")["sglang"]
    assert "--mamba-radix-cache-strategy extra_buffer" in cmd and "--mamba-scheduler-strategy" not in cmd


@pytest.mark.parametrize("block_size", [7, 3])
def test_dspark_commands_use_the_engines_dspark_names_and_counts(block_size):
    """A DSpark drafter (issue 38) drafts block_size tokens and verifies block_size + 1: vLLM's method ``"dspark"``
    with ``num_speculative_tokens = block_size``, SGLang's ``DSPARK`` with ``--speculative-num-draft-tokens =
    block_size + 1`` (the fixture's ``dspark_source`` entries cite the engines' files); only accepted names."""
    cmds = engine_commands("me/drafter", block_size, "org/target", dspark=True,
                           draft_layer_types=["sliding_attention", "full_attention"])
    words = shlex.split(cmds["sglang"])
    assert words[:3] == ["python", "-m", ARGS["sglang"]["module"]]
    options = _options(words[3:])
    assert set(options) <= set(ARGS["sglang"]["options"]) and not set(options) & set(ARGS["sglang"]["refused"])
    assert options["--speculative-algorithm"] == "DSPARK" in ARGS["sglang"]["choices"]["--speculative-algorithm"]
    assert ARGS["sglang"]["dspark_num_draft_tokens"] == "block_size + 1"
    assert options["--speculative-num-draft-tokens"] == str(block_size + 1)
    assert options["--speculative-draft-model-path"] == "me/drafter" and options["--model-path"] == "org/target"

    words = shlex.split(cmds["vllm"])
    assert words[:2] == ["vllm", "serve"]  # no DFlash V2-runner switch for DSpark
    options = _options(words[3:])
    assert set(options) <= set(ARGS["vllm"]["options"])
    spec = json.loads(options["--speculative-config"])
    assert set(spec) <= set(ARGS["vllm"]["speculative_config_keys"])
    assert spec["method"] == "dspark" and spec["method"] in ARGS["vllm"]["methods"]
    assert ARGS["vllm"]["dspark_num_speculative_tokens"] == "block_size"
    assert spec["num_speculative_tokens"] == block_size and spec["model"] == "me/drafter"
    plain = engine_commands("me/drafter", block_size, "org/target")  # the DFlash counts stay as they were
    assert '"method": "dflash"' in plain["vllm"] and f"--speculative-num-draft-tokens {block_size}" in plain["sglang"]
