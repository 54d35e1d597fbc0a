"""model_cards/: the rendered card parses back, says what the drafter is, and its usage snippet runs."""

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

from convert.convert_checkpoint import convert_checkpoint
from convert_fixtures import save_tiny_tokenizer, write_source
from model_cards.render import (
    CITATION, TESTED_TRANSFORMERS_VERSIONS, AcceptanceError, build_parser, load_acceptance, main, render_model_card,
    validate_acceptance,
)
from tiny import tiny_target

EXAMPLE = Path(__file__).resolve().parents[1] / "model_cards" / "acceptance.example.json"


def acceptance(**overrides) -> dict:
    record = {
        "schema": "dflash-acceptance/v1", "target": "Qwen/Qwen3-8B", "draft": "me/Tiny-DFlash", "block_size": 4,
        "dtype": "bfloat16", "device": "cpu",
        "datasets": [
            {"name": "gsm8k", "num_prompts": 10, "max_new_tokens": 64, "temperature": 0.0, "tau": 3.25, "speedup": 1.5},
            {"name": "mt-bench", "num_prompts": 8, "max_new_tokens": 64, "temperature": 1.0, "tau": 2.0, "speedup": None},
        ],
    }
    record.update(overrides)
    return record


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    root = tmp_path_factory.mktemp("card")
    src = write_source(root / "src", "z-lab")
    convert_checkpoint(src, root / "ours", target_id="Qwen/Qwen3-8B", target_revision="abc1234", verify=False)
    convert_checkpoint(root / "ours", root / "engine", engine_only=True, verify=False)
    return root


def test_card_metadata_parses_back(drafter):
    card = render_model_card(str(drafter / "ours"), "me/Tiny-DFlash", license="mit")
    data = ModelCard(str(card)).data.to_dict()
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert data["license"] == "mit"
    assert {"dflash", "speculative-decoding", "custom_code"} <= set(data["tags"])
    assert data["base_model"] == "Qwen/Qwen3-8B" and data["base_model_relation"] == "adapter"


def test_card_body_says_what_the_drafter_is(drafter):
    text = str(render_model_card(str(drafter / "ours"), "me/Tiny-DFlash", license="mit", acceptance=acceptance()))
    body = text.split("---", 2)[2]
    assert "It needs its target" in body and "no token embedding and no LM head" in body
    assert "| Target model | `Qwen/Qwen3-8B` |" in body
    assert "| Target revision | `abc1234` |" in body
    assert "| Block size | 4 " in body
    assert "| Target layer ids | `[0, 2]`" in body
    assert "| Mask token id | 96 " in body
    assert "| Weights | safetensors, bfloat16 |" in body
    assert '"num_speculative_tokens": 3' in body and "--speculative-num-draft-tokens 4" in body
    assert "--speculative-draft-model-path me/Tiny-DFlash" in body
    assert "transformers " + ", ".join(TESTED_TRANSFORMERS_VERSIONS) in body
    assert "| gsm8k | 10 | 64 | 0.0 | 3.25 | 1.50x |" in body
    assert "| mt-bench | 8 | 64 | 1.0 | 2.00 | n/a |" in body
    assert "```bibtex\n" + CITATION + "\n```" in body
    assert "title={{DFlash: Block Diffusion for Flash Speculative Decoding}}" in CITATION
    assert 'revision="abc1234"' in body  # the usage snippet pins the target revision


def test_card_names_the_published_repos_not_the_folders_measured(drafter, tmp_path):
    """A record measured from local folders (what bench and demo write) shows the card's repo id and the Hub
    target id, never a path of the machine; the speedup sentence names no clock the record did not use."""
    local = acceptance(target=str(tmp_path / "models" / "Qwen3-8B"), draft="runs/pair-drafter-hf",
                       notes="python -m bench, shipped pair, speedup on cpu time")
    body = str(render_model_card(str(drafter / "ours"), "me/Tiny-DFlash", license="mit", acceptance=local))
    assert "Measured with draft `me/Tiny-DFlash` and target `Qwen/Qwen3-8B`" in body
    assert str(tmp_path) not in body and "runs/pair-drafter-hf" not in body
    assert "wall-clock decoding speed" not in body and "speedup on cpu time" in body


def test_card_without_acceptance_or_hub_target(drafter, tmp_path):
    card = render_model_card(str(drafter / "ours"), "me/Tiny-DFlash", license="apache-2.0", target_id=str(tmp_path))
    data = ModelCard(str(card)).data.to_dict()
    assert "base_model" not in data  # a local path is not a Hub id
    assert "No acceptance figures were recorded" in str(card)


def test_engine_only_card_has_no_custom_code_or_snippet(drafter):
    card = render_model_card(str(drafter / "engine"), "me/Tiny-DFlash-engine", license="mit")
    data = ModelCard(str(card)).data.to_dict()
    assert "custom_code" not in data["tags"] and "dflash" in data["tags"]
    assert "engine-only" in str(card) and "```python" not in str(card)


def test_usage_snippet_runs_on_tiny_models(drafter, tmp_path):
    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    save_tiny_tokenizer(tmp_path / "target")
    card = render_model_card(str(drafter / "ours"), str(drafter / "ours"), license="mit",
                             target_id=str(tmp_path / "target"))
    snippet = re.search(r"```python\n(.*?)```", str(card), re.S).group(1)
    scope = {}
    exec(compile(snippet, "model-card-snippet", "exec"), scope)
    input_ids = scope["input_ids"]
    expected = target.generate(input_ids, max_new_tokens=256, do_sample=False)
    assert scope["output"].shape[1] == input_ids.shape[1] + 256
    assert torch.equal(scope["output"], expected)


def test_acceptance_schema_is_enforced():
    assert validate_acceptance(acceptance())["block_size"] == 4
    assert load_acceptance(EXAMPLE)["schema"] == "dflash-acceptance/v1"
    bad = [
        (acceptance(schema="v0"), "acceptance.schema"),
        ({k: v for k, v in acceptance().items() if k != "device"}, "'device'"),
        (acceptance(extra=1), r"unknown field\(s\) \['extra'\]"),
        (acceptance(block_size="4"), r"acceptance\.block_size must be int"),
        (acceptance(datasets=[]), "datasets is empty"),
    ]
    rows = [("tau", 5.0, r"tau=5\.0 is outside \[1, block_size=4\]"), ("tau", 0.5, "outside"),
            ("speedup", 0, "speedup must be > 0"), ("num_prompts", 0, r"num_prompts must be >= 1"),
            ("temperature", -1.0, "temperature must be >= 0"), ("name", 3, r"datasets\[0\]\.name must be str")]
    for field, value, message in rows:
        record = copy.deepcopy(acceptance())
        record["datasets"][0][field] = value
        bad.append((record, message))
    for record, message in bad:
        with pytest.raises(AcceptanceError, match=message):
            validate_acceptance(record)


def test_acceptance_for_a_larger_block_is_refused(drafter):
    with pytest.raises(AcceptanceError, match="exceeds the draft's block_size=4"):
        render_model_card(str(drafter / "ours"), "me/x", license="mit", acceptance=acceptance(block_size=16))


def test_render_cli_writes_the_card(drafter, tmp_path, capsys):
    path = tmp_path / "acceptance.json"
    path.write_text(json.dumps(acceptance()))
    out = tmp_path / "README.md"
    assert main([str(drafter / "ours"), "--repo-id", "me/Tiny-DFlash", "--license", "mit",
                 "--acceptance", str(path), "-o", str(out)]) == 0
    assert ModelCard.load(out).data.license == "mit" and "| gsm8k |" in out.read_text()
    capsys.readouterr()
    assert main([str(drafter / "src"), "--repo-id", "me/x", "--license", "mit"]) == 1  # z-lab: convert first
    assert main([str(tmp_path), "--repo-id", "me/x", "--license", "mit"]) == 1
    err = capsys.readouterr().err
    assert "convert_checkpoint on it first" in err and "no config.json" in err
    for action in build_parser()._actions:
        assert action.help, action.dest
