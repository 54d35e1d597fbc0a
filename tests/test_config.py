import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel

from configuration_dflash import DFlashConfig, legacy_target_layer_ids
from modeling_dflash import DFlashDraftModel
from tiny import tiny_draft, tiny_draft_config, tiny_target

pytestmark = pytest.mark.quick  # the first-check subset (README "Run the tests")

# z-lab/Qwen3-8B-DFlash-b16 config.json, every key as published, sizes shrunk (vocab 97, hidden 40,
# 2 draft layers, 3 target layers, mask id 96, block 4).
PUBLISHED_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 4,
    "bos_token_id": 95,
    "dflash_config": {"mask_token_id": 96, "target_layer_ids": [0, 2]},
    "dtype": "bfloat16",
    "eos_token_id": 94,
    "head_dim": 10,
    "hidden_act": "silu",
    "hidden_size": 40,
    "initializer_range": 0.02,
    "intermediate_size": 56,
    "layer_types": ["full_attention", "full_attention"],
    "max_position_embeddings": 512,
    "max_window_layers": 2,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_target_layers": 3,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 97,
}


def write_published(folder, config=PUBLISHED_CONFIG, seed=3):
    """A z-lab style folder: published config, published weight names, foreign auto_map and code."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "dflash.py").write_text("raise RuntimeError('the published remote code must not be imported')\n")
    torch.manual_seed(seed)
    weights = {k: torch.randn_like(v) * 0.1 for k, v in DFlashDraftModel(DFlashConfig(**config)).state_dict().items()}
    save_file(weights, str(folder / "model.safetensors"))
    return weights


def test_published_folder_loads_strictly_with_no_renaming(tmp_path):
    weights = write_published(tmp_path / "zlab")
    model, info = DFlashDraftModel.from_pretrained(str(tmp_path / "zlab"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, weights[name].to(tensor.dtype), rtol=0, atol=0)
    cfg = model.config
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (4, 96, [0, 2])
    assert model.block_size == 4 and model.mask_token_id == 96 and model.target_layer_ids == [0, 2]
    out = model.float().spec_generate(tiny_target(), torch.tensor([[5, 6, 7]]), max_new_tokens=5, temperature=0.0)
    assert out.shape == (1, 8)


def test_resaved_published_folder_is_ours_and_still_the_published_dialect(tmp_path):
    write_published(tmp_path / "zlab")
    DFlashDraftModel.from_pretrained(str(tmp_path / "zlab")).save_pretrained(tmp_path / "ours")
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["auto_map"] == {
        "AutoConfig": "configuration_dflash.DFlashConfig", "AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert saved["model_type"] == "qwen3" and saved["architectures"] == ["DFlashDraftModel"]
    assert saved["block_size"] == 4 and saved["num_target_layers"] == 3
    assert saved["dflash_config"]["target_layer_ids"] == [0, 2] and saved["dflash_config"]["mask_token_id"] == 96
    assert saved["rope_theta"] == 1e6 and saved["rope_scaling"] is None
    assert saved["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    assert not (tmp_path / "ours" / "dflash.py").exists()
    plain = AutoConfig.from_pretrained(str(tmp_path / "ours"))
    assert type(plain).__name__ == "Qwen3Config" and plain.dflash_config["target_layer_ids"] == [0, 2]
    assert plain.hidden_size == 40 and plain.num_hidden_layers == 2 and plain.block_size == 4
    remote = AutoModel.from_pretrained(str(tmp_path / "ours"), trust_remote_code=True)
    assert type(remote.config).__name__ == "DFlashConfig"


def test_block_size_nested_wins_and_causal_spellings():
    cfg = dict(PUBLISHED_CONFIG, dflash_config={"mask_token_id": 96, "target_layer_ids": [0, 2], "block_size": 8})
    assert DFlashConfig(**cfg).block_size == 8
    assert DFlashConfig(**dict(PUBLISHED_CONFIG, is_causal=True)).layer_is_causal(0) is True
    nested_causal = dict(PUBLISHED_CONFIG, dflash_config={"mask_token_id": 96, "target_layer_ids": [0], "causal": True})
    assert DFlashConfig(**nested_causal).layer_is_causal(1) is True
    sliding = tiny_draft_config(layer_types=["sliding_attention", "full_attention"], sliding_window=7)
    assert [sliding.layer_is_causal(i) for i in range(2)] == [True, False]
    assert [sliding.layer_window(i) for i in range(2)] == [7, None]


def test_rope_in_either_spelling_reads_the_same():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    old = tiny_draft_config(rope_theta=5e5, rope_scaling={"type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 128})
    new = tiny_draft_config(rope_parameters=dict(yarn, rope_theta=5e5))
    assert old.rope_parameters == new.rope_parameters == dict(yarn, rope_theta=5e5)
    out = old.to_dict()
    assert out["rope_theta"] == 5e5 and out["rope_scaling"] == yarn and out["rope_parameters"]["factor"] == 4.0
    with pytest.raises(ValueError, match="dynamic"):
        tiny_draft_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0})


def test_legacy_layer_rule_only_with_num_target_layers(caplog):
    assert legacy_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert legacy_target_layer_ids(36, 1) == [18]
    with caplog.at_level(logging.WARNING):
        cfg = tiny_draft_config(target_layer_ids=None, num_target_layers=36, num_hidden_layers=5,
                                layer_types=None)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] and "legacy rule" in caplog.text


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"target_layer_ids": None, "num_target_layers": None}, "needs target_layer_ids"),
        ({"target_layer_ids": [1, 1]}, r"distinct non-negative .*\[1, 1\]"),
        ({"target_layer_ids": [-1, 2]}, r"\[-1, 2\]"),
        ({"target_layer_ids": [0, 3]}, "num_target_layers=3"),
        ({"mask_token_id": 97}, r"mask_token_id=97 must be in \[0, vocab_size=97\)"),
        ({"mask_token_id": None}, "needs mask_token_id"),
        ({"block_size": 0}, "block_size must be an integer >= 1, got 0"),
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries but num_hidden_layers=2"),
        ({"layer_types": ["full_attention", "linear_attention"]}, "unknown layer type 'linear_attention'"),
        ({"layer_types": ["sliding_attention"] * 2, "sliding_window": None}, "sliding_window"),
    ],
)
def test_config_validation_names_the_bad_value(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_draft_config(**overrides)


def test_published_weights_of_wrong_shape_are_refused(tmp_path):
    write_published(tmp_path / "zlab")
    cfg = dict(PUBLISHED_CONFIG, dflash_config={"mask_token_id": 96, "target_layer_ids": [0, 1, 2]})
    (tmp_path / "zlab" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RuntimeError, match="mismatch"):
        DFlashDraftModel.from_pretrained(str(tmp_path / "zlab"))


def test_draft_rope_comes_from_the_draft_config_only():
    """A draft whose rope_theta differs from the target's drafts differently (notes section 6)."""
    a, b = tiny_draft(rope_theta=1e6), tiny_draft(rope_theta=1e4)
    assert a.rotary_emb.inv_freq != b.rotary_emb.inv_freq


# ----------------------------------------------------------------------------- issue 34: strict DFlash 1 loading


def _rewrite_weights(folder, drop=(), add=()):
    """Rewrite ``folder/model.safetensors`` without the tensors ``drop`` and with zero tensors ``add`` (name, shape)."""
    path = str(folder / "model.safetensors")
    weights = {k: v for k, v in load_file(path).items() if k not in drop}
    weights.update({name: torch.zeros(shape) for name, shape in add})
    save_file(weights, path)


@pytest.mark.parametrize("drop, add, named", [
    (["fc.weight"], [], r"missing_keys \['fc.weight'\]"),
    ([], [("layers.0.self_attn.sink_bias", (4,))], r"unexpected_keys \['layers.0.self_attn.sink_bias'\]"),
])
def test_published_folder_with_a_missing_or_unexpected_tensor_is_refused_by_name(tmp_path, drop, add, named):
    """Issue 34: a copy without ``fc.weight`` loaded with a random ``fc`` (acceptance collapsed, silently)."""
    write_published(tmp_path / "zlab")
    _rewrite_weights(tmp_path / "zlab", drop, add)
    with pytest.raises(ValueError, match=f"{tmp_path / 'zlab'}.*{named}"):
        DFlashDraftModel.from_pretrained(str(tmp_path / "zlab"))


def test_unused_published_tensors_are_dropped_by_name_with_one_note(tmp_path, caplog):
    """Copies of the target's embedding / head (some training exports) are not the draft's: named once, dropped;
    every draft tensor still loads exactly."""
    weights = write_published(tmp_path / "zlab")
    _rewrite_weights(tmp_path / "zlab", add=[("embed_tokens.weight", (97, 40)), ("lm_head.weight", (97, 40))])
    with caplog.at_level(logging.WARNING):
        model = DFlashDraftModel.from_pretrained(str(tmp_path / "zlab"))
    notes = [r.getMessage() for r in caplog.records if "does not use" in r.getMessage()]
    assert len(notes) == 1 and "embed_tokens.weight, lm_head.weight" in notes[0], caplog.text
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, weights[name].to(tensor.dtype), rtol=0, atol=0)
