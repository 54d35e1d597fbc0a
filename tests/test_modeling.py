import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel, DynamicCache

import modeling_dflash
from generation_utils import capture_target_features, crop_cache
from modeling_dflash import DFlashDraftModel, compute_rope_inv_freq
from reference import draft_logits, reference_spec_generate, target_features
from tiny import MASK_ID, tiny_draft, tiny_draft_config, tiny_target

PUBLISHED_KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{name}"
    for i in range(2)
    for name in (
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    )
}


def _draft_call(draft, target, committed, b, cache=None):
    """Draft logits for the block anchored at committed[:, -1], as spec_generate calls the model."""
    p = committed.shape[1] - 1
    with capture_target_features(target, draft.config.target_layer_ids) as feats:
        target(committed[:, :p])
        context = feats()
    noise = torch.cat([committed[:, -1:], torch.full((1, b - 1), MASK_ID)], 1)
    pos = torch.arange(0, p + b)[None]
    hidden = draft(position_ids=pos, noise_embedding=target.get_input_embeddings()(noise), target_hidden=context,
                   past_key_values=cache, use_cache=cache is not None)
    return target.get_output_embeddings()(hidden[:, 1:])[0]


def test_state_dict_names_are_the_published_ones():
    assert set(tiny_draft().state_dict()) == PUBLISHED_KEYS


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]])
def test_forward_matches_naive_reference(layer_types):
    extra = {"layer_types": layer_types, "sliding_window": 5} if layer_types else {}
    target, draft = tiny_target(), tiny_draft(rope_theta=5000.0, **extra)
    committed = torch.randint(0, 96, (1, 13))
    sd = {k: v.float() for k, v in draft.state_dict().items()}
    with torch.no_grad():
        ours = _draft_call(draft, target, committed, 4)
        ref = draft_logits(sd, draft.config.to_dict(), target, committed, 4)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_feature_taps_are_layer_outputs_with_post_norm_last_layer():
    target = tiny_target()
    ids = torch.randint(0, 96, (1, 9))
    with torch.no_grad(), capture_target_features(target, [0, 1, 2]) as feats:
        target(ids)
        ours = feats()
        ref = target_features(target, ids, [0, 1, 2])
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"\[3\]"):
        with capture_target_features(target, [0, 3]):
            pass


@pytest.mark.parametrize("case", ["no mask", "key mask", "sliding layer", "draft window"])
def test_grouped_query_sdpa_is_bit_identical_to_repeated_keys(monkeypatch, case):
    """On CPU the draft attends over the un-repeated kv heads (``enable_gqa``) instead of copying every cached
    key ``num_kv_groups`` times per layer and step; its drafts stay bit-identical to the repeat_kv path
    (z-lab's, on the same weights). Attention is peaked (q/k scaled) so a wrong key-to-head pairing shows."""
    sliding = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5}
    draft = tiny_draft(**(sliding if case == "sliding layer" else {}))
    with torch.no_grad():
        for layer in draft.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    assert draft.layers[0].self_attn.num_kv_groups == 2
    g = torch.Generator().manual_seed(3)
    past, ctx, b = 9, 3, 4
    features = torch.randn(1, past + ctx, 2 * 40, generator=g)
    noise = torch.randn(1, b, 40, generator=g)
    kwargs = {}
    if case == "key mask":
        kwargs["attention_mask"] = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1] + [1] * b])
    if case == "draft window":
        kwargs["draft_window"] = 4

    def run():
        cache = DynamicCache()
        draft(position_ids=torch.arange(past + b)[None], noise_embedding=noise, target_hidden=features[:, :past],
              past_key_values=cache)
        crop_cache(cache, past)
        return draft(position_ids=torch.arange(past, past + ctx + b)[None], noise_embedding=noise,
                     target_hidden=features[:, past:], past_key_values=cache, **kwargs)

    grouped = [0]
    real = F.scaled_dot_product_attention

    def spy(*args, **kw):
        grouped[0] += bool(kw.get("enable_gqa"))
        return real(*args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        fast = run()
        assert grouped[0] > 0, "the CPU path did not attend over grouped kv heads"
        monkeypatch.setattr(modeling_dflash, "sdpa_groups_keys", lambda q: False)
        grouped[0] = 0
        slow = run()
        assert grouped[0] == 0
    assert torch.equal(fast, slow)


def test_incremental_cache_equals_full_recompute():
    """Context fed in three chunks through the draft cache gives the same drafts as all at once."""
    target, draft = tiny_target(), tiny_draft()
    committed = torch.randint(0, 96, (1, 12))
    with torch.no_grad(), capture_target_features(target, draft.config.target_layer_ids) as feats:
        target(committed[:, :11])
        context = feats()
        embed = target.get_input_embeddings()
        noise = embed(torch.cat([committed[:, 11:], torch.full((1, 3), MASK_ID)], 1))
        full = draft(position_ids=torch.arange(15)[None], noise_embedding=noise, target_hidden=context)
        cache = DynamicCache()
        for lo, hi in ((0, 4), (4, 9)):  # earlier steps: context chunk + a throwaway block
            junk = embed(torch.randint(0, 96, (1, 4)))
            draft(position_ids=torch.arange(lo, hi + 4)[None], noise_embedding=junk,
                  target_hidden=context[:, lo:hi], past_key_values=cache)
            crop_cache(cache, hi)
            assert cache.get_seq_length() == hi
        step = draft(position_ids=torch.arange(9, 15)[None], noise_embedding=noise,
                     target_hidden=context[:, 9:11], past_key_values=cache)
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]])
def test_eager_and_sdpa_drafts_agree(layer_types):
    """Context (30) longer than the window (6): the window must be honoured by both backends."""
    extra = {"layer_types": layer_types, "sliding_window": 6} if layer_types else {}
    target = tiny_target()
    committed = torch.randint(0, 96, (1, 31))
    outs = {}
    for impl in ("eager", "sdpa"):
        draft = tiny_draft(**extra)
        draft.config._attn_implementation = impl
        with torch.no_grad():
            outs[impl] = _draft_call(draft, target, committed, 4)
    torch.testing.assert_close(outs["eager"], outs["sdpa"], rtol=1e-5, atol=1e-5)
    if layer_types:  # and the window matters: a full-attention draft drafts differently
        full = tiny_draft()
        with torch.no_grad():
            assert not torch.allclose(_draft_call(full, target, committed, 4), outs["sdpa"], atol=1e-3)


def test_sliding_layer_is_causal_inside_block_full_layer_is_not():
    target = tiny_target()
    committed = torch.randint(0, 96, (1, 6))
    for layer_types, expect_causal in ((["sliding_attention"] * 2, True), (["full_attention"] * 2, False)):
        draft = tiny_draft(layer_types=layer_types, sliding_window=64)
        p = committed.shape[1] - 1
        with torch.no_grad(), capture_target_features(target, [0, 2]) as feats:
            target(committed[:, :p])
            context = feats()
            noise = target.get_input_embeddings()(torch.cat([committed[:, -1:], torch.full((1, 3), MASK_ID)], 1))
            a = draft(position_ids=torch.arange(p + 4)[None], noise_embedding=noise, target_hidden=context)
            noise[:, -1] += 1.0  # perturb the last slot
            b = draft(position_ids=torch.arange(p + 4)[None], noise_embedding=noise, target_hidden=context)
        assert torch.allclose(a[:, :-1], b[:, :-1]) == expect_causal


def test_yarn_and_llama3_rope_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for rope in (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        {"rope_type": "yarn", "factor": 2.0, "beta_fast": 16, "beta_slow": 2},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "linear", "factor": 3.0},
    ):
        cfg = tiny_draft_config(rope_scaling=dict(rope), rope_theta=10000.0, max_position_embeddings=512)
        ours, ours_scale = compute_rope_inv_freq(cfg)
        hf_cfg = AutoConfig.for_model("qwen3", head_dim=10, hidden_size=40, num_attention_heads=4,
                                      max_position_embeddings=512, rope_theta=10000.0, rope_scaling=dict(rope))
        theirs, their_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu")
        torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
        assert ours_scale == pytest.approx(their_scale)


def test_save_and_load_through_automodel_from_another_directory(tmp_path, monkeypatch):
    target, draft = tiny_target(), tiny_draft()
    draft.save_pretrained(tmp_path / "draft")
    assert {"configuration_dflash.py", "modeling_dflash.py", "generation_utils.py", "target_cache.py",
            "target_families.py", "static_generate.py", "config.json",
            "model.safetensors"} <= set(os.listdir(tmp_path / "draft"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = AutoModel.from_pretrained(str(tmp_path / "draft"), trust_remote_code=True).eval()
    assert type(loaded).__module__ != DFlashDraftModel.__module__  # the copied remote code, not ours
    assert type(AutoConfig.from_pretrained(str(tmp_path / "draft"), trust_remote_code=True)).__name__ == "DFlashConfig"
    plain = AutoConfig.from_pretrained(str(tmp_path / "draft"))
    assert type(plain).__name__ == "Qwen3Config"
    assert plain.dflash_config == {"target_layer_ids": [0, 2], "mask_token_id": MASK_ID, "block_size": 4}
    committed = torch.randint(0, 96, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(_draft_call(loaded, target, committed, 4), _draft_call(draft, target, committed, 4),
                                   rtol=0, atol=0)
    ids = torch.randint(0, 96, (1, 5))
    assert torch.equal(loaded.spec_generate(target, ids, max_new_tokens=12, temperature=0.0),
                       draft.spec_generate(target, ids, max_new_tokens=12, temperature=0.0))


def test_reference_loop_agrees_with_spec_generate():
    target, draft = tiny_target(), tiny_draft()
    ids = torch.randint(0, 96, (1, 6))
    ref, ref_acc = reference_spec_generate(draft, target, ids, max_new_tokens=20, block_size=4)
    # fixed blocks: the reference loop drafts and verifies the whole block every step (its acceptance lengths)
    out = draft.spec_generate(target, ids, max_new_tokens=20, temperature=0.0, return_dict_in_generate=True,
                              adaptive_block_size=False)
    assert torch.equal(out.sequences, ref)
    assert out.acceptance_lengths == ref_acc
    assert torch.equal(draft.spec_generate(target, ids, max_new_tokens=20, temperature=0.0), ref)  # the default too
