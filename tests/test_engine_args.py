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
