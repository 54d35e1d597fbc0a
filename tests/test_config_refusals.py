"""Drafter configs: published fixtures per family load; keys that cannot be honoured are refused at
load time naming the key; unknown keys warn once; the engine keys change the math exactly as stated
(block embedding = raw table row x input_embedding_scale, sqrt(hidden) on Gemma 3/4 when unset; logits x output_multiplier, soft-capped)."""

import json
import logging
from pathlib import Path

import pytest
import torch
import transformers

import generation_utils
import proposers
from configuration_dflash import REFUSED_KEYS, DFlashConfig
from modeling_dflash import DFlash2DraftModel, DFlashDraftModel
from target_families import draft_block_embedding, draft_logits
from tiny import tiny_draft, tiny_draft_config, tiny_target

FIXTURES = Path(__file__).parent / "fixtures" / "drafters"
PUBLISHED = sorted(p.name for p in FIXTURES.glob("*.json") if not p.name.endswith("-header.json"))


def _load(name):
    return json.loads((FIXTURES / name).read_text())


def _save(folder, config):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    cfg = DFlashConfig(**{k: v for k, v in config.items()})
    (DFlash2DraftModel if cfg.is_dflash2 else DFlashDraftModel)(cfg).save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(config))  # the published file, not our re-save


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_family_configs_load_without_unknown_keys(name, tmp_path, caplog):
    config = _load(name)
    _save(tmp_path / "d", config)
    with caplog.at_level(logging.WARNING):
        model = DFlashDraftModel.from_pretrained(str(tmp_path / "d"))
    assert "not read by this implementation" not in caplog.text, caplog.text
    cfg = model.config
    assert cfg.target_layer_ids == [0, 1, 2] and cfg.mask_token_id == config["dflash_config"]["mask_token_id"]
    assert cfg.layer_types == config["layer_types"] and cfg.block_size == config.get("block_size", 16)
    if name.startswith("gemma-4"):
        assert cfg.final_logit_softcapping == 30.0 and cfg.input_embedding_scale is None
        saved = json.loads(json.dumps(cfg.to_dict()))
        assert saved["dflash_config"]["final_logit_softcapping"] == 30.0  # engines read it there


def test_muse_glimmer_v1_assistant_is_refused_at_load_naming_the_dialect(tmp_path):
    """z-lab tests/fixtures/assistant-config.json: architectures MuseGlimmerAssistantModel, model_type
    muse_glimmer_assistant, weights encoder.fc / encoder.output_norm_enc (DFlash 2 loads: test_dflash2.py)."""
    config = dict(_load("dflash2-config.json"), architectures=["MuseGlimmerAssistantModel"])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"MuseGlimmerAssistantModel.*Muse Glimmer v1 assistant dialect"):
        DFlashDraftModel.from_pretrained(str(tmp_path / "d"))
    with pytest.raises(ValueError, match=r"model_type='muse_glimmer_assistant'.*Muse Glimmer v1"):
        DFlashConfig(**dict(config, architectures=None, model_type="muse_glimmer_assistant"))


@pytest.mark.parametrize("key, value, match", [
    ("d2t", [0, 1], "reduced draft vocabulary"),
    ("t2d", [True], "reduced draft vocabulary"),
    ("draft_vocab_size", 32, r"draft_vocab_size=32 != vocab_size=97"),
    ("attention_sink_bias", True, "attention sink biases"),
    ("partial_rotary_factor", 0.5, "partial rotary"),
    ("use_swa", True, "use_swa"),
])
@pytest.mark.parametrize("nested", [False, True])
def test_unhonourable_keys_are_refused_naming_the_key(key, value, match, nested):
    kwargs = {"dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 96, key: value}} if nested else {key: value}
    with pytest.raises(ValueError, match=rf"{key}.*{match}|{match}"):
        tiny_draft_config(**kwargs)
    if key not in ("draft_vocab_size",):
        assert key in REFUSED_KEYS  # the one list


def test_harmless_values_of_refusable_keys_load():
    assert tiny_draft_config(partial_rotary_factor=1.0, attention_sink_bias=False, draft_vocab_size=97)


def test_per_layer_type_rope_with_differing_values_is_refused():
    same = {"rope_type": "default", "rope_theta": 1e6}
    assert tiny_draft_config(rope_parameters={"full_attention": same, "sliding_attention": same}).rope_theta == 1e6
    with pytest.raises(ValueError, match="per layer type with differing values"):
        tiny_draft_config(rope_parameters={"full_attention": same,
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


def test_unknown_key_logs_one_warning_naming_it(caplog):
    with caplog.at_level(logging.WARNING):
        tiny_draft_config(fancy_new_knob=3, dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 96,
                                                            "other_knob": 1})
    lines = [r for r in caplog.records if "not read by this implementation" in r.getMessage()]
    assert len(lines) == 1 and "fancy_new_knob" in lines[0].getMessage()
    assert "dflash_config.other_knob" in lines[0].getMessage()


@pytest.mark.parametrize("key", ["input_embedding_scale", "output_multiplier", "final_logit_softcapping"])
def test_engine_keys_are_validated(key):
    with pytest.raises(ValueError, match=key):
        tiny_draft_config(**{key: -1.0})


# ----------------------------------------------------------------------------- the math of the keys


def _gemma3_target():
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(vocab_size=97, hidden_size=40, intermediate_size=72, num_hidden_layers=3,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=10,
                                           query_pre_attn_scalar=10, sliding_window=6)
    return transformers.Gemma3ForCausalLM(config).eval()


@pytest.mark.parametrize("scale", [None, 2.5])
def test_block_embedding_is_the_raw_row_times_input_embedding_scale(scale):
    """Hand-computed: the draft gets the raw table row x ``input_embedding_scale``; unset, x sqrt(40) on
    a Gemma 3 target (Gemma's own scale, issue 26) and x 1 on a target whose embedding does not scale.
    Planted bug caught: ``embed(ids) * scale`` (scaled twice)."""
    target = _gemma3_target()
    embed = target.get_input_embeddings()
    ids = torch.tensor([[5, 96, 96, 96]])
    by_hand = embed.weight[ids] * (40 ** 0.5 if scale is None else scale)
    assert not torch.allclose(embed(ids), embed.weight[ids])  # the module scales: the convention matters
    config = tiny_draft_config(input_embedding_scale=scale)
    torch.testing.assert_close(draft_block_embedding(config, embed, ids), by_hand, rtol=0, atol=0)
    plain = tiny_target().get_input_embeddings()
    assert torch.equal(draft_block_embedding(tiny_draft_config(), plain, ids), plain.weight[ids])


def test_spec_generate_feeds_the_draft_that_embedding(monkeypatch):
    target, draft = _gemma3_target(), tiny_draft(input_embedding_scale=3.0, block_size=4)
    seen = []
    handle = draft.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["noise_embedding"]), with_kwargs=True)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    try:
        out = draft.spec_generate(target, ids, max_new_tokens=5, temperature=0.0)
    finally:
        handle.remove()
    anchor = out[0, 5]
    block = torch.tensor([[int(anchor), 96, 96, 96]])
    torch.testing.assert_close(seen[0], target.get_input_embeddings().weight[block] * 3.0, rtol=0, atol=0)


def test_draft_logits_multiplier_then_softcap():
    head = torch.nn.Linear(40, 97, bias=False)
    hidden = torch.randn(2, 3, 40) * 5
    config = tiny_draft_config(output_multiplier=0.5, final_logit_softcapping=4.0)
    by_hand = torch.tanh(head(hidden) * 0.5 / 4.0) * 4.0
    torch.testing.assert_close(draft_logits(config, head, hidden), by_hand)
    assert torch.equal(draft_logits(tiny_draft_config(), head, hidden), head(hidden))
    assert draft_logits(config, head, hidden).abs().max() < 4.0


def test_spec_generate_applies_the_drafter_logit_keys(monkeypatch):
    """The logits sampling sees are the capped ones (greedy output is the target's either way)."""
    target, draft = tiny_target(), tiny_draft(final_logit_softcapping=0.01, block_size=4)
    got = []
    real = proposers._draft_logits

    def spy(*args):
        logits = real(*args)
        got.append(logits)
        return logits

    monkeypatch.setattr(proposers, "_draft_logits", spy)
    draft.spec_generate(target, torch.tensor([[3, 1, 4]]), max_new_tokens=6, temperature=0.0)
    assert got and all(g.abs().max() <= 0.01 for g in got)


# ----------------------------------------------------------------------------- serving flags per family


@pytest.mark.parametrize("name, v2_runner", [
    ("gemma-4-26B-A4B-it-DFlash.json", True), ("Qwen3.6-27B-DFlash.json", True), ("gpt-oss-20b-DFlash.json", False),
    ("Qwen3-Coder-30B-A3B-DFlash.json", False), ("LLaMA3.1-8B-Instruct-DFlash-UltraChat.json", False),
])
def test_engine_flags_per_family(name, v2_runner):
    from convert.engines import engine_commands

    cfg = DFlashConfig(**_load(name))
    cmds = engine_commands("org/draft", cfg.block_size, "org/target", draft_layer_types=cfg.layer_types)
    assert cmds["vllm"].startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve") == v2_runner
    assert f'"num_speculative_tokens": {cfg.block_size - 1}' in cmds["vllm"]
    assert f"--speculative-num-draft-tokens {cfg.block_size}" in cmds["sglang"]
    assert "--mamba-radix-cache-strategy" not in cmds["sglang"]
    hybrid = engine_commands("org/draft", 16, "Qwen/Qwen3.5-35B-A3B", target_model_type="qwen3_5_moe")
    assert hybrid["sglang"].endswith("--mamba-radix-cache-strategy extra_buffer")


# ----------------------------------------------------------------------------- issue 34: DSpark and other architectures


def _dspark_folder(folder, architecture):
    """A DeepSpec DSpark drafter, shrunk: a Qwen3Config plus the top-level DSpark keys (no dflash_config, no
    auto_map), the DFlash backbone's tensors plus the Markov head and its own embedding and head."""
    config = {k: v for k, v in _load("Qwen3-Coder-30B-A3B-DFlash.json").items() if k not in ("dflash_config", "auto_map")}
    config.update(architectures=[architecture], block_size=7, mask_token_id=96, target_layer_ids=[0, 1, 2],
                  num_target_layers=3, num_anchors=1, markov_rank=8, markov_head_type="vanilla",
                  enable_confidence_head=True, confidence_head_with_markov=False)
    backbone = dict(config, architectures=["DFlashDraftModel"])
    weights = DFlashDraftModel(DFlashConfig(**backbone)).state_dict()
    weights.update({"markov_w1.weight": torch.zeros(97, 8), "markov_w2.weight": torch.zeros(97, 8),
                    "embed_tokens.weight": torch.zeros(97, 40), "lm_head.weight": torch.zeros(97, 40)})
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    return config


def test_dspark_folders_the_loader_cannot_run_are_refused_by_name(tmp_path):
    """Issue 34: a DSpark folder loaded as a DFlash 1 drafter (its extra tensors and keys ignored) and drafted
    one position off. Issue 38: ``Qwen3DSparkModel`` loads as ``DSparkDraftModel`` (tests/test_dspark.py);
    ``Gemma4DSparkModel`` is refused by name before loading and by the converter (the same rule,
    ``architecture_refusal``), which reads ``Qwen3DSparkModel`` folders as the ``deepspec`` dialect."""
    from convert import ConversionError
    from convert.sources import detect_dialect

    config = _dspark_folder(tmp_path / "d", "Gemma4DSparkModel")
    want = rf"{tmp_path / 'd'}.*'Gemma4DSparkModel'.*not implemented"
    with pytest.raises(ValueError, match=want):
        DFlashDraftModel.from_pretrained(str(tmp_path / "d"))
    with pytest.raises(ValueError, match=want):
        DFlashConfig.from_pretrained(str(tmp_path / "d"))
    with pytest.raises(ConversionError, match="'Gemma4DSparkModel'"):
        detect_dialect(dict(config, model_type="qwen3", architectures=["Gemma4DSparkModel"]))
    assert detect_dialect(dict(config, model_type="qwen3", architectures=["Qwen3DSparkModel"])) == "deepspec"


def test_an_architecture_this_package_does_not_implement_is_refused_by_name():
    with pytest.raises(ValueError, match=r"'Qwen3ForCausalLM' is not a DFlash draft architecture .*'DFlashDraftModel'"):
        DFlashConfig(**dict(_load("Qwen3-Coder-30B-A3B-DFlash.json"), architectures=["Qwen3ForCausalLM"]))
