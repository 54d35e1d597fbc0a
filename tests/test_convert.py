"""convert/: every input dialect -> this project's format, strict keys, atomic writes, round trip, push dry run.

All sources are tiny fake folders written by the test (tests/convert_fixtures.py); nothing touches the Hub.
"""

import json
import os
import pathlib

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel, Qwen3Config

import convert.convert_checkpoint as cc
from convert import ConversionError
from convert.convert_checkpoint import build_parser, convert_checkpoint, main, verify_conversion
from convert.engines import engine_commands
from convert.push_to_hub import build_parser as push_parser
from convert.push_to_hub import main as push_main
from convert.push_to_hub import push_to_hub
from convert_fixtures import (
    published_config, random_draft_inputs, source_draft, source_tensors, write_source,
)
from tiny import tiny_target

CODE_FILES = ["cache_reuse.py", "configuration_dflash.py", "custom_generate/generate.py", "custom_generate_template.py",
              "decode_step.py", "dflash2.py", "draft_trees.py", "dspark.py",
              "generation_arguments.py", "generation_output.py", "generation_utils.py", "modeling_dflash.py",
              "native_routes.py", "proposers.py", "remote_code_cache.py", "speculative_sampling.py",
              "static_generate.py", "stopping_criteria.py", "target_cache.py", "target_facts.py", "target_families.py",
              "target_taps.py", "tested_versions.py", "user_processors.py", "verify_cost.py", "verify_policy.py"]
OURS = sorted(["config.json", "model.safetensors"] + CODE_FILES)


def _files(folder):
    """Every file under ``folder``, as sorted relative POSIX paths."""
    return sorted(p.relative_to(folder).as_posix() for p in pathlib.Path(folder).rglob("*") if p.is_file())


def _load(folder):
    return AutoModel.from_pretrained(folder, trust_remote_code=True, dtype="auto").eval()


def _assert_same_outputs(model, reference):
    inputs = random_draft_inputs()
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs), reference(**inputs))


def _no_leftovers(parent):
    return [n for n in os.listdir(parent) if n.startswith("_dflash_convert_tmp_")] == []


# ----------------------------------------------------------------------------- every dialect


@pytest.mark.parametrize(
    "dialect, layout",
    [
        ("z-lab", {}),
        ("specforge", {}),
        ("z-lab", {"prefix": "model."}),
        ("specforge", {"sharded": True}),
        ("z-lab", {"pickle": True}),
    ],
    ids=["z-lab", "specforge", "model-prefixed", "sharded", "pickle"],
)
def test_each_dialect_converts_and_loads_with_automodel(tmp_path, dialect, layout):
    src = write_source(tmp_path / "src", dialect, **layout)
    out = tmp_path / "out"
    plan = convert_checkpoint(src, out, allow_pickle=layout.get("pickle", False))
    assert plan.dialect == dialect
    assert _files(out) == OURS == plan.files
    assert len(plan.renamed) == (25 if layout.get("prefix") else 0)
    model = _load(out)
    assert type(model).__name__ == "DFlashDraftModel" and type(model).__module__.startswith("transformers_modules")
    assert model.dtype == torch.bfloat16
    _assert_same_outputs(model, source_draft())
    config = json.load(open(out / "config.json"))
    assert config["auto_map"] == {"AutoConfig": "configuration_dflash.DFlashConfig", "AutoModel": "modeling_dflash.DFlashDraftModel"}


def test_dropped_keys_are_listed_and_not_written(tmp_path):
    tensors = source_tensors()
    tensors["embed_tokens.weight"] = torch.zeros(97, 40, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = torch.zeros(97, 40, dtype=torch.bfloat16)
    plan = convert_checkpoint(write_source(tmp_path / "src", tensors=tensors), tmp_path / "out")
    assert sorted(plan.dropped) == ["embed_tokens.weight", "lm_head.weight"]
    assert "embed_tokens.weight" not in load_file(tmp_path / "out" / "model.safetensors")
    assert "dropped embed_tokens.weight" in plan.describe()


def test_hub_repo_id_source_downloads_only_config_and_weights(tmp_path, monkeypatch):
    src = write_source(tmp_path / "snapshot", "z-lab")
    calls = []

    def fake_snapshot_download(**kwargs):
        calls.append(kwargs)
        return src

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    plan = convert_checkpoint("z-lab/Tiny-DFlash", tmp_path / "out", revision="v1")
    assert calls[0]["repo_id"] == "z-lab/Tiny-DFlash" and calls[0]["revision"] == "v1"
    assert not any(p.endswith(".py") or "bin" in p for p in calls[0]["allow_patterns"])
    assert plan.source == "z-lab/Tiny-DFlash" and plan.dialect == "z-lab"
    _assert_same_outputs(_load(tmp_path / "out"), source_draft())


def test_legacy_config_without_layer_ids_gets_them_stored(tmp_path):
    config = published_config("specforge", dflash_config={"mask_token_id": 96}, num_target_layers=36)
    tensors = source_tensors()
    tensors["fc.weight"] = torch.zeros(40, 80, dtype=torch.bfloat16)  # legacy rule: 2 draft layers -> 2 features
    plan = convert_checkpoint(write_source(tmp_path / "src", "specforge", tensors=tensors, config=config), tmp_path / "out")
    assert plan.config.target_layer_ids == [1, 33]
    assert json.load(open(tmp_path / "out" / "config.json"))["dflash_config"]["target_layer_ids"] == [1, 33]
    assert any("legacy layer rule" in note for note in plan.notes)


# ----------------------------------------------------------------------------- strict keys


def test_unknown_key_fails_naming_it(tmp_path):
    tensors = source_tensors()
    tensors["layers.0.self_attn.gate.weight"] = torch.zeros(4, dtype=torch.bfloat16)
    src = write_source(tmp_path / "src", tensors=tensors)
    with pytest.raises(ConversionError, match=r"unmapped .*'layers\.0\.self_attn\.gate\.weight'"):
        convert_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_key_fails_naming_it(tmp_path):
    tensors = source_tensors()
    del tensors["layers.1.mlp.down_proj.weight"]
    src = write_source(tmp_path / "src", "specforge", tensors=tensors, sharded=True)
    with pytest.raises(ConversionError, match=r"missing .*'layers\.1\.mlp\.down_proj\.weight'"):
        convert_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_shape_mismatch_fails_naming_the_key(tmp_path):
    tensors = source_tensors()
    tensors["fc.weight"] = torch.zeros(40, 120, dtype=torch.bfloat16)  # three features, config says two
    with pytest.raises(ConversionError, match=r"^the source weights do not fit .*: tensor 'fc\.weight' has shape \[40, 120\].*\[40, 80\]"):
        convert_checkpoint(write_source(tmp_path / "src", tensors=tensors), tmp_path / "out")


def test_pickle_refused_without_allow_pickle(tmp_path):
    src = write_source(tmp_path / "src", pickle=True)
    with pytest.raises(ConversionError, match="--allow-pickle"):
        convert_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_index_listing_a_key_no_shard_has_fails(tmp_path):
    src = write_source(tmp_path / "src", "specforge", sharded=True)
    index_path = os.path.join(src, "model.safetensors.index.json")
    index = json.load(open(index_path))
    index["weight_map"]["norm.extra"] = "model-00001-of-00002.safetensors"
    json.dump(index, open(index_path, "w"))
    with pytest.raises(ConversionError, match="'norm.extra'"):
        convert_checkpoint(src, tmp_path / "out")


@pytest.mark.parametrize(
    "overrides, reason",
    [
        ({"speculators_model_type": "dflash"}, "speculators"),
        ({"architectures": ["MuseGlimmerAssistantModel"]}, "Muse Glimmer v1 assistant"),
        ({"model_type": "muse_glimmer_assistant"}, "Muse Glimmer v1 assistant"),
        ({"model_type": "llama", "architectures": ["LlamaForCausalLMEagle3"]}, "model_type='llama'"),
        ({"architectures": ["Qwen3ForCausalLM"]}, "not a DFlash draft"),
    ],
)
def test_unsupported_dialects_are_refused_with_the_reason(tmp_path, overrides, reason):
    src = write_source(tmp_path / "src", "specforge", config=published_config("specforge", **overrides))
    with pytest.raises(ConversionError, match=reason):
        convert_checkpoint(src, tmp_path / "out", dry_run=True)


# ----------------------------------------------------------------------------- dry run, overwrite, atomicity


def test_dry_run_writes_nothing_and_lists_the_files(tmp_path, capsys):
    src = write_source(tmp_path / "src")
    before = sorted(os.listdir(tmp_path))
    assert main([src, str(tmp_path / "out"), "--dry-run"]) == 0
    assert sorted(os.listdir(tmp_path)) == before
    text = capsys.readouterr().out
    assert "dry run, nothing written" in text
    assert "files:    " + ", ".join(OURS) in text
    plan = convert_checkpoint(src, tmp_path / "eng", dry_run=True, engine_only=True)
    assert plan.files == ["config.json", "model.safetensors"] and not (tmp_path / "eng").exists()


def test_existing_output_is_not_overwritten(tmp_path, capsys):
    src = write_source(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert_checkpoint(src, out)
    assert main([src, str(out)]) == 1 and "already exists" in capsys.readouterr().err
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    convert_checkpoint(src, out, overwrite=True)
    assert _files(out) == OURS and _no_leftovers(tmp_path)


def test_failure_midway_leaves_no_output_folder(tmp_path, monkeypatch):
    src = write_source(tmp_path / "src")

    def broken_forward_check(*args, **kwargs):
        raise ConversionError("simulated verification failure")

    monkeypatch.setattr(cc, "_check_forward", broken_forward_check)
    with pytest.raises(ConversionError, match="simulated"):
        convert_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _no_leftovers(tmp_path)
    # with --overwrite, a failed conversion keeps the previous output untouched
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("previous")
    with pytest.raises(ConversionError, match="simulated"):
        convert_checkpoint(src, tmp_path / "out", overwrite=True)
    assert os.listdir(tmp_path / "out") == ["old.txt"] and _no_leftovers(tmp_path)


def test_output_inside_source_is_refused(tmp_path):
    src = write_source(tmp_path / "src")
    with pytest.raises(ConversionError, match="overlap"):
        convert_checkpoint(src, os.path.join(src, "converted"))


# ----------------------------------------------------------------------------- verification


def test_verify_with_target_checks_greedy_spec_generate(tmp_path):
    tiny_target().save_pretrained(tmp_path / "target")
    plan = convert_checkpoint(write_source(tmp_path / "src"), tmp_path / "out", verify_target=str(tmp_path / "target"))
    assert plan.checks == [
        "plain AutoConfig reads a qwen3 config with dflash_config",
        "written tensors equal the source bit for bit",
        "loads with AutoModel(trust_remote_code=True)",
        "same forward output as the source on random inputs",
        "same draft logits on the target's features and same greedy spec_generate tokens and acceptance",
    ]


def test_verify_catches_a_different_draft(tmp_path):
    convert_checkpoint(write_source(tmp_path / "src"), tmp_path / "out")
    with pytest.raises(ConversionError, match="differs from the source tensor"):
        verify_conversion(str(tmp_path / "out"), source_draft(seed=7))
    with pytest.raises(ConversionError, match="output differs from the source on random inputs"):
        cc._check_forward(source_draft(seed=7), source_draft(seed=1), seed=0)
    with pytest.raises(ConversionError, match="logits on the target's features differ"):
        cc._check_generation(source_draft(seed=7), source_draft(seed=1), tiny_target(), seed=0)


# ----------------------------------------------------------------------------- round trip and engines


def _config(folder):
    config = json.load(open(os.path.join(folder, "config.json")))
    config.pop("transformers_version")
    return config


def test_round_trip_is_lossless_and_plain_autoconfig_reads_every_output(tmp_path):
    published = write_source(tmp_path / "published", "z-lab")
    ours, engine, again = tmp_path / "ours", tmp_path / "engine", tmp_path / "again"
    convert_checkpoint(published, ours)
    plan = convert_checkpoint(ours, engine, engine_only=True)
    assert plan.dialect == "dflash-hf"
    assert _files(engine) == ["config.json", "model.safetensors"] and "auto_map" not in _config(engine)
    assert convert_checkpoint(engine, again).dialect == "specforge"

    assert _config(ours) == _config(again)
    assert {k: v for k, v in _config(ours).items() if k != "auto_map"} == _config(engine)
    reference = load_file(os.path.join(published, "model.safetensors"))
    for folder in (ours, engine, again):
        written = load_file(folder / "model.safetensors")
        assert written.keys() == reference.keys()
        assert all(written[k].dtype == reference[k].dtype and torch.equal(written[k], reference[k]) for k in reference)
        plain = AutoConfig.from_pretrained(folder, trust_remote_code=False)
        assert isinstance(plain, Qwen3Config) and plain.model_type == "qwen3"
        assert plain.dflash_config == {"target_layer_ids": [0, 2], "mask_token_id": 96, "block_size": 4}
        assert plain.block_size == 4 and plain.architectures == ["DFlashDraftModel"]
    # the published dialect is kept: every published field survives with its value
    published_cfg = published_config("z-lab")
    not_carried = {"auto_map", "transformers_version", "torch_dtype", "use_cache", "dflash_config"}
    ours_cfg = _config(ours)
    assert {k: ours_cfg.get(k) for k in published_cfg if k not in not_carried} == {
        k: v for k, v in published_cfg.items() if k not in not_carried}
    assert published_cfg["dflash_config"].items() <= ours_cfg["dflash_config"].items()
    assert ours_cfg["dtype"] == "bfloat16"
    _assert_same_outputs(_load(again), source_draft())


def test_engine_flags_printed_for_this_checkpoint(tmp_path, capsys):
    src = write_source(tmp_path / "src", "specforge")
    assert main([src, str(tmp_path / "out"), "--engine-only", "--target-id", "Qwen/Qwen3-8B"]) == 0
    text = capsys.readouterr().out
    out = str(tmp_path / "out")
    assert "vllm serve Qwen/Qwen3-8B --speculative-config" in text
    assert f'"model": "{out}", "num_speculative_tokens": 3' in text  # block_size 4 - 1
    assert f"--speculative-draft-model-path {out} --speculative-num-draft-tokens 4" in text
    assert json.load(open(tmp_path / "out" / "config.json"))["target_model_id"] == "Qwen/Qwen3-8B"
    commands = engine_commands("me/draft", 16, "Qwen/Qwen3-8B")
    assert '"num_speculative_tokens": 15' in commands["vllm"] and "--speculative-num-draft-tokens 16" in commands["sglang"]


def test_every_cli_flag_has_help():
    for parser in (build_parser(), push_parser()):
        for action in parser._actions:
            assert action.help, f"{parser.prog}: {action.option_strings or action.dest} has no help"


# ----------------------------------------------------------------------------- push


class FakeApi:
    """Records the Hub calls instead of making them."""

    def __init__(self):
        self.calls = []

    def create_repo(self, **kwargs):
        self.calls.append(("create_repo", kwargs))

    def create_branch(self, **kwargs):
        self.calls.append(("create_branch", kwargs))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))

        class Info:
            commit_url, pr_url = "https://huggingface.co/me/draft/commit/abc", "https://huggingface.co/me/draft/discussions/1"

        return Info()


@pytest.fixture
def converted(tmp_path):
    out = tmp_path / "out"
    convert_checkpoint(write_source(tmp_path / "src"), out, target_id="Qwen/Qwen3-8B", verify=False)
    (out / "__pycache__").mkdir()
    (out / "__pycache__" / "modeling_dflash.cpython-312.pyc").write_bytes(b"junk")
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref")
    return out


def test_push_dry_run_lists_exactly_the_files(converted, capsys):
    before = sorted(os.listdir(converted))
    assert push_main([str(converted), "--repo-id", "me/draft", "--license", "mit", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert sorted(os.listdir(converted)) == before  # no README written
    listing, card = text.split("\n----- README.md (generated model card), exactly as it would be uploaded -----\n")
    listed = [line.strip() for line in listing.splitlines()[1:] if line.strip()]
    assert listed == ["README.md (generated model card)"] + OURS
    assert text.splitlines()[0].startswith(f"Would upload {len(OURS) + 1} file(s)")
    from model_cards.render import render_model_card

    assert card.removesuffix("\n") == str(render_model_card(str(converted), "me/draft", license="mit"))  # the exact card


def test_push_dry_run_writes_the_card_where_asked(converted, tmp_path, capsys):
    path = tmp_path / "card.md"
    assert push_main([str(converted), "--repo-id", "me/draft", "--license", "mit", "--dry-run", "--card-out", str(path)]) == 0
    assert "----- README.md" not in capsys.readouterr().out
    assert path.read_text().startswith("---\n") and "me/draft" in path.read_text()


def test_push_uploads_with_the_hub_calls(converted):
    api = FakeApi()
    plan = push_to_hub(str(converted), "me/draft", license="mit", private=True, revision="v2", create_pr=True, api=api)
    names = [name for name, _ in api.calls]
    assert names == ["create_repo", "create_branch", "upload_folder"]
    assert api.calls[0][1]["private"] is True and api.calls[0][1]["exist_ok"] is True
    assert api.calls[1][1]["branch"] == "v2"
    upload = api.calls[2][1]
    assert upload["revision"] == "v2" and upload["create_pr"] is True and upload["repo_id"] == "me/draft"
    assert "*.pyc" in upload["ignore_patterns"]
    assert plan.url.endswith("/discussions/1") and plan.card == "generated"
    assert (converted / "README.md").read_text().startswith("---\n")


def test_push_refuses_unconverted_or_pickled_folders(tmp_path, converted):
    src = write_source(tmp_path / "zlab", "z-lab")
    with pytest.raises(ConversionError, match="convert_checkpoint"):
        push_to_hub(src, "me/draft", license="mit", dry_run=True)
    torch.save({}, converted / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="pytorch_model.bin"):
        push_to_hub(str(converted), "me/draft", license="mit", dry_run=True)
    os.remove(converted / "pytorch_model.bin")
    with pytest.raises(ValueError, match="--license"):
        push_to_hub(str(converted), "me/draft", dry_run=True)
