"""Longrope targets across their switch: ``spec_generate`` equals Phi-3's ``generate`` token for token.

Phi-3's ``generate`` (``prepare_inputs_for_generation``, 4.57 and 5.x alike) runs short factors while
the sequence is at most ``original_max_position_embeddings`` (here 24) long, then drops its cache at
length 25 and re-prefills the whole sequence with long factors. A verify block takes the factors of
its LAST position for all of its positions, so ``spec_generate`` clamps blocks below the switch and
re-prefills once at it (``generation_utils._longrope_step``). The factors here differ a lot and the
target is peaked, so a single position computed with the wrong factors changes the output.

Oracle drafts (right for all / some / none of a block's slots) make blocks long enough to reach the
switch; the planted-bug notes on each test say what it was shown to catch.
"""

import types

import pytest
import torch
import transformers

import decode_step
import generation_utils
import proposers
import target_families
from patching import patch_called
from tiny import VOCAB, tiny_draft

ORIG, PROMPT_LEN, NEW = 24, 11, 30  # 11 + 30 = 41 > 25: 16 tokens past the re-prefill
PROMPT = torch.randint(0, 96, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(5))
SHORT, LONG = [1.0, 1.3, 1.9, 2.8, 4.0], [1.0, 3.0, 7.0, 15.0, 30.0]  # head_dim 10 -> 5 frequencies
IS_5 = int(transformers.__version__.split(".")[0]) >= 5


def _phi3(**overrides):
    """A peaked fp32 Phi-3 with longrope switching at 24 (the config spelling of the installed version)."""
    torch.manual_seed(0)
    kwargs = dict(vocab_size=VOCAB, hidden_size=40, intermediate_size=72, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=96, original_max_position_embeddings=ORIG,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if IS_5:
        kwargs["rope_parameters"] = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                                     "rope_theta": 10000.0, "original_max_position_embeddings": ORIG}
    else:
        kwargs["rope_scaling"] = {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}
    kwargs.update(overrides)
    target = transformers.Phi3ForCausalLM(transformers.Phi3Config(**kwargs)).eval()
    target.generation_config.eos_token_id = target.generation_config.pad_token_id = None
    with torch.no_grad():  # tiny.peak for the fused qkv_proj: queries and keys x25, LM head x10
        for layer in target.model.layers:
            layer.self_attn.qkv_proj.weight[: (4 + 2) * 10].mul_(25.0)
        target.lm_head.weight.mul_(10.0)
    return target


@pytest.fixture(scope="module")
def target():
    return _phi3()


@pytest.fixture(scope="module")
def reference(target):
    return target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False, max_new_tokens=NEW)


def _oracle(monkeypatch, ref, pattern):
    """Draft logits equal to ``ref``'s next tokens on the first ``pattern[step % len]`` slots (None: all),
    wrong after; records ``(start, b, draft cache length, ctx features, ctx positions)`` per draft call."""
    real, calls = proposers._draft_logits, []

    def fake(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id):
        calls.append((int(start[0]), b, draft_cache.get_seq_length(), ctx.features.clone(), ctx.positions.clone()))
        real(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id)
        s = int(start[0])
        want = torch.cat([ref[0, s + 1: s + b], torch.zeros(b, dtype=torch.long)])[: b - 1].clone()
        right = pattern[(len(calls) - 1) % len(pattern)]
        right = b - 1 if right is None else right
        want[right:] = (want[right:] + 1) % VOCAB
        return torch.nn.functional.one_hot(want, VOCAB).float()[None] * 30

    patch_called(monkeypatch, proposers, "_draft_logits", fake)
    return calls


def test_generate_reference_reprefills_and_the_factors_matter(target, reference):
    """The premise: generate re-prefills at length 25 on this version, and its output differs from a
    loop that keeps the short-factor cache (so a missing re-prefill cannot pass unnoticed)."""
    lengths = []
    handle = target.register_forward_pre_hook(lambda m, a, k: lengths.append(k["input_ids"].shape[1]), with_kwargs=True)
    try:
        target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False, max_new_tokens=NEW)
    finally:
        handle.remove()
    assert lengths[0] == PROMPT_LEN and lengths[ORIG - PROMPT_LEN + 1] == ORIG + 1
    assert sorted(set(lengths)) == [1, PROMPT_LEN, ORIG + 1]
    cache, seq = {decode_step._cache_kwarg(target): transformers.DynamicCache()}, PROMPT
    with torch.no_grad():
        logits = target(seq, use_cache=True, **cache).logits
        for _ in range(NEW - 1):
            seq = torch.cat([seq, logits[:, -1:].argmax(-1)], dim=1)
            logits = target(seq[:, -1:], use_cache=True, position_ids=torch.tensor([[seq.shape[1] - 1]]), **cache).logits
    assert not torch.equal(seq, reference[:, :-1])


@pytest.mark.parametrize("block_size, pattern", [
    (16, [None]),  # full blocks: the first one (12 + 15 > 24) is clamped
    (13, [None]),  # the first block lands exactly on the switch: committed 12 -> 25, then re-prefill
    (4, [None, 1, 0]),  # varying acceptance: the clamp shrinks blocks down to the anchor alone at 24
    (7, [2]),
])
def test_greedy_equals_generate_across_the_switch(target, reference, monkeypatch, block_size, pattern):
    """Planted bugs caught: no clamp (``longrope_block_limit`` returning ``block_size``): every case but
    block 13 (whose first block ends exactly at the switch without clamping); no re-prefill (``_longrope_step`` only clamping): every case; re-prefill including the anchor's
    slot left in the cache (no ``crop_cache(target_cache, committed - 1)``): every case."""
    calls = _oracle(monkeypatch, reference, pattern)
    out = tiny_draft(block_size=block_size).spec_generate(
        target, PROMPT, max_new_tokens=NEW, temperature=0.0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    assert out.num_target_forwards == len(out.acceptance_lengths) + 2  # prefill + verifies + one re-prefill
    assert any(start + b - 1 == ORIG - 1 for start, b, *_ in calls)  # some block ended right below the switch


def test_draft_context_is_rebuilt_from_the_long_factor_taps(target, reference, monkeypatch):
    """After the re-prefill the draft starts over: empty draft cache, context = the target's hidden
    states of positions 0..23 as the long-factor forward computes them (layer ids 0 and 2 = HF
    ``hidden_states[1]`` and the post-norm ``hidden_states[3]``).

    Planted bugs caught: the old (short-factor) context kept (no ``rows.ctx`` reset): wrong features;
    the draft cache not emptied: cache length 24 instead of 0."""
    calls = _oracle(monkeypatch, reference, [None])
    draft = tiny_draft(block_size=8)
    out = draft.spec_generate(target, PROMPT, max_new_tokens=NEW, temperature=0.0)
    assert torch.equal(out, reference)
    after = [c for c in calls if c[0] == ORIG]  # the first draft pass with the anchor at position 24
    assert len(after) == 1
    _, _, cache_len, features, positions = after[0]
    assert cache_len == 0 and torch.equal(positions, torch.arange(ORIG)[None])
    with torch.no_grad():
        hidden = target(reference[:, : ORIG + 1], output_hidden_states=True).hidden_states
    want = torch.cat([hidden[1], hidden[3]], dim=-1)[:, :ORIG]
    assert torch.allclose(features, want, atol=1e-5)
    with torch.no_grad():
        short = target(reference[:, :ORIG], output_hidden_states=True).hidden_states  # short factors
    assert not torch.allclose(features, torch.cat([short[1], short[3]], dim=-1), atol=1e-3)


def test_sampling_path_crosses_the_switch_exactly(target, monkeypatch):
    """``do_sample=True`` with ``top_k=1``: the sampled path (speculative_verify on one-hot
    distributions) must give generate's tokens whatever the seeds; wrong factors change the argmax.

    Planted bug caught: no clamp (the sampled verify of a crossing block)."""
    ref = target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=True, top_k=1, max_new_tokens=NEW)
    _oracle(monkeypatch, ref, [None, 2])
    out = tiny_draft(block_size=16).spec_generate(target, PROMPT, max_new_tokens=NEW, do_sample=True, top_k=1)
    assert torch.equal(out, ref)


def test_random_draft_and_static_request_equal_generate(target, reference):
    """The real (untrained) draft, and ``cache_implementation="static"``, which falls back to the dynamic
    loop (with an info log naming the switch). Planted bug caught: no static fallback (the static loop ran
    without re-prefill: wrong tokens)."""
    draft = tiny_draft(block_size=16)
    assert torch.equal(draft.spec_generate(target, PROMPT, max_new_tokens=NEW, temperature=0.0), reference)
    out = draft.spec_generate(target, PROMPT, max_new_tokens=NEW, temperature=0.0, cache_implementation="static")
    assert torch.equal(out, reference)


def test_below_the_switch_and_prompt_past_it_need_no_reprefill(target):
    """Below the switch (prompt + new <= 25) and with a prompt already past it (prefill in long factors,
    generate never re-prefills) nothing changes: one target forward per verify step plus the prefill.
    Planted bug caught: ``check_rope`` returning the switch for a prompt past it (an extra re-prefill)."""
    draft = tiny_draft(block_size=16)
    long_prompt = torch.randint(0, 96, (1, ORIG + 3), generator=torch.Generator().manual_seed(7))
    for prompt, new in ((PROMPT, ORIG + 1 - PROMPT_LEN), (long_prompt, 12)):
        assert target_families.check_rope(target, prompt.shape[1], new) is None
        ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=new)
        out = draft.spec_generate(target, prompt, max_new_tokens=new, temperature=0.0, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert out.num_target_forwards == len(out.acceptance_lengths) + 1
    assert target_families.check_rope(target, PROMPT_LEN, ORIG + 2 - PROMPT_LEN) == ORIG


def test_batch_or_padding_across_the_switch_refused_before_any_forward(target):
    """Planted bug caught: the batch check dropped (the call ran and diverged)."""
    calls = []
    handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
    draft = tiny_draft(block_size=4)
    try:
        with pytest.raises(NotImplementedError, match=r"'longrope' .* position 24 .* batch size 1 .*got batch 2"):
            draft.spec_generate(target, PROMPT.repeat(2, 1), max_new_tokens=NEW, temperature=0.0)
        mask = torch.ones_like(PROMPT)
        mask[0, 0] = 0
        with pytest.raises(NotImplementedError, match=r"got batch 1, padded"):
            draft.spec_generate(target, PROMPT, attention_mask=mask, max_new_tokens=NEW, temperature=0.0)
    finally:
        handle.remove()
    assert calls == []


def test_longrope_on_a_family_without_the_reprefill_is_refused():
    """Only families whose generate re-prefills at the switch are followed across it; any other
    longrope target (its generate keeps the short-factor cache) is refused, naming the family."""
    cfg = types.SimpleNamespace(model_type="llama", max_position_embeddings=96, original_max_position_embeddings=ORIG,
                                rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG})
    stub = types.SimpleNamespace(config=cfg)
    assert target_families.check_rope(stub, PROMPT_LEN, ORIG + 1 - PROMPT_LEN) is None
    with pytest.raises(NotImplementedError, match=r"re-prefills there \(phi3, .*not 'llama'"):
        target_families.check_rope(stub, PROMPT_LEN, NEW)


@pytest.mark.parametrize("overrides", [{"attn_implementation": "eager"}, {"sliding_window": 7}])
def test_eager_or_short_window_exact_on_5_refused_on_4(overrides, monkeypatch):
    """transformers 4.x's Phi-3 generate re-prefills with a stale ``cache_position`` (an explicit mask
    then covers one query: eager, or sdpa under a window <= 25), so its output is not the model's; the
    call is refused there before any forward. On 5.x generate is exact and so is ``spec_generate``
    (window 7: the re-prefill crops sliding-window cache layers).

    Planted bugs caught: on 4.57, ``_stale_reprefill_mask`` returning None (not refused; the test also
    shows the call would then differ from generate); on 5.24, the 4.x check applied there (refused)."""
    target = _phi3(**overrides)
    draft = tiny_draft(block_size=8)
    if IS_5:
        ref = target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False, max_new_tokens=NEW)
        _oracle(monkeypatch, ref, [None, 1])
        assert torch.equal(draft.spec_generate(target, PROMPT, max_new_tokens=NEW, temperature=0.0), ref)
        return
    calls = []
    handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(NotImplementedError, match=r"'longrope' .*stale cache_position"):
            draft.spec_generate(target, PROMPT, max_new_tokens=NEW, temperature=0.0)
    finally:
        handle.remove()
    assert calls == []
    monkeypatch.setattr(target_families, "_stale_reprefill_mask", lambda *a: None)  # the refusal is needed:
    ref = target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False, max_new_tokens=NEW)
    assert not torch.equal(draft.spec_generate(target, PROMPT, max_new_tokens=NEW, temperature=0.0), ref)
