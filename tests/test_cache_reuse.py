"""Continuing from a cache (issue 25, ``cache_reuse.py``): multi-turn chat without re-prefilling the history.

Dense (Qwen3), sliding-window (Mistral, window 6: every conversation here runs past it) and hybrid
(Qwen3.5, 5.x) tiny peaked targets. An oracle draft (right for a scripted number of slots, so blocks are
fully, partly and not accepted) checks at every draft call that the draft has context for every position
before the anchor. Planted bugs, each failing here (checked by hand): turn 1's draft context dropped
(``Resume._draft_context`` returning an empty context) fails ``test_turn_2_from_turn_1_cache_equals_generate``
on the draft-context assertion; the cache advanced past the output (``Resume.kept`` returning the
uncut counts) fails ``test_stop_inside_an_accepted_block_leaves_generates_cache``; the turn-2 prefill
starting one token late (``input_ids[:, n + 1:]``) fails the prefill-token count and the equality; the
draft's position shift removed (``_ShiftedDraft`` passing positions unshifted, or ``Resume.draft`` not
wrapping) fails ``test_draft_without_context_for_the_cache_sees_the_suffix_from_position_0``. Issue 34:
``_ShiftedDraft`` forwarding ``config`` only fails both ``test_dflash2_drafter_*`` tests (AttributeError on ``selector_inputs``);
``Resume.finish`` not calling ``leave_inference_mode`` fails
``test_a_cache_returned_under_inference_mode_is_continued_outside_it`` (inference tensors in the returned
cache; the hybrid case, without that check, on generate's RuntimeError).
"""

import copy
import logging

import pytest
import torch
from transformers import DynamicCache

import cache_reuse
import generation_utils
import proposers
from cache_reuse import CACHE_FIELD, DRAFT_CONTEXT
from decode_step import _Context
from family_targets import family_target
from patching import patch_called
from test_hybrid import V5, hybrid_draft, tiny_hybrid
from tiny import VOCAB, tiny_draft, tiny_target

KINDS = ["dense", "sliding", pytest.param("hybrid", marks=pytest.mark.skipif(
    not V5, reason="Qwen3.5 and the linear-attention DynamicCache exist from transformers 5"))]
_PAIRS = {}


def _pair(kind):
    """(target, draft) of ``kind``, built once per session (read-only in these tests)."""
    if kind not in _PAIRS:
        if kind == "dense":
            _PAIRS[kind] = tiny_target("qwen3", peaked=True), tiny_draft(block_size=8)
        elif kind == "sliding":
            _PAIRS[kind] = family_target("mistral"), tiny_draft(block_size=8)
        else:
            _PAIRS[kind] = tiny_hybrid("qwen3_5"), hybrid_draft()
    return _PAIRS[kind]


def _ids(seed, n):
    return torch.randint(0, VOCAB - 1, (1, n), generator=torch.Generator().manual_seed(seed))


def _greedy(target, ids, n, **kwargs):
    return target.generate(ids, max_new_tokens=n, do_sample=False, **kwargs)


def _fresh_cache(target):
    """A cache generate continues from exactly on both versions (4.57's sliding layers cannot be rolled back)."""
    return DynamicCache(config=target.config) if target.config.model_type == "qwen3_5_text" else DynamicCache()


@pytest.fixture
def oracle(monkeypatch):
    """Draft logits right for a scripted number of slots per call (real draft pass kept, for its cache);
    ``oracle(ref, script)`` sets the reference of the next call and returns the list of
    ``(context positions the draft has, anchor position)`` per draft call."""
    seen, state = [], {}
    real = proposers._draft_logits

    def fake(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id):
        has = draft_cache.get_seq_length() + (0 if ctx is None else ctx.features.shape[1])
        seen.append((has, int(start[0])))
        real(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id)
        script = state["script"]
        s, right = int(start[0]), min(script[len(seen) % len(script)], b - 1)
        want = state["ref"][0, s + 1: s + b].clone()
        want[right:] = (want[right:] + 1) % VOCAB
        return torch.nn.functional.one_hot(want, VOCAB).float()[None] * 30

    patch_called(monkeypatch, proposers, "_draft_logits", fake)

    def install(ref, script=(7, 2, 0, 4)):
        state.update(ref=ref, script=script)
        seen.clear()
        return seen

    return install


@torch.no_grad()
def _prefill(target, ids, cache):
    """The user's own prefill of ``ids`` into ``cache`` (a system prompt computed once)."""
    target(input_ids=ids, use_cache=True, **{generation_utils._cache_kwarg(target): cache})
    return cache


def _count_target_tokens(target):
    """Forward pre-hook recording the number of input tokens of every target forward; returns (list, handle)."""
    tokens = []
    handle = target.register_forward_pre_hook(lambda m, a, kw: tokens.append(int(kw["input_ids"].shape[1])),
                                              with_kwargs=True)
    return tokens, handle


@torch.no_grad()
def _same_next_logits(target, ours, theirs, token):
    """Both caches give the same logits for one more token: the same content, whatever their layer classes."""
    kw = generation_utils._cache_kwarg(target)
    n = ours.get_seq_length()
    assert theirs.get_seq_length() == n
    pos = torch.tensor([[n]])
    a = target(input_ids=token, position_ids=pos, use_cache=True, **{kw: copy.deepcopy(ours)}).logits
    b = target(input_ids=token, position_ids=pos, use_cache=True, **{kw: copy.deepcopy(theirs)}).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_turn_2_from_turn_1_cache_equals_generate(kind, oracle):
    """Two turns: turn 2 continues from turn 1's returned cache, computes only its new tokens, has draft
    context for every position, and equals generate on the whole turn-2 input; the returned caches hold what
    generate's hold (every token but the last)."""
    target, draft = _pair(kind)
    prompt, user = _ids(1, 9), _ids(2, 5)
    ref1 = _greedy(target, prompt, 24, return_dict_in_generate=True)
    seen = oracle(ref1.sequences)
    out1 = draft.spec_generate(target, prompt, max_new_tokens=24, temperature=0.0, return_dict_in_generate=True)
    assert torch.equal(out1.sequences, ref1.sequences)
    cache1 = getattr(out1, CACHE_FIELD)
    assert cache1.get_seq_length() == out1.sequences.shape[1] - 1
    assert getattr(cache1, DRAFT_CONTEXT).length == cache1.get_seq_length()
    if kind != "sliding":  # generate's sliding layers keep the window only; the content is compared below
        _same_next_logits(target, cache1, getattr(ref1, CACHE_FIELD), user[:, :1])
    assert all(has == start for has, start in seen) and max(a for a in out1.acceptance_lengths) > 3

    turn2 = torch.cat([out1.sequences, user], dim=1)
    ref2 = _greedy(target, turn2, 30)
    seen = oracle(ref2)
    tokens, handle = _count_target_tokens(target)
    try:
        out2 = draft.spec_generate(target, turn2, max_new_tokens=30, temperature=0.0, return_dict_in_generate=True,
                                   **{CACHE_FIELD: cache1})
    finally:
        handle.remove()
    assert torch.equal(out2.sequences, ref2)
    assert tokens[0] == user.shape[1] + 1  # the prefill: turn 1's last token and the new ones, nothing cached
    assert getattr(out2, CACHE_FIELD) is cache1  # advanced in place, as generate does
    assert cache1.get_seq_length() == ref2.shape[1] - 1
    assert seen and all(has == start for has, start in seen), seen[:3]  # turn 1's draft context kept


@pytest.mark.parametrize("kind", KINDS)
def test_copied_system_prompt_cache_serves_two_continuations(kind, oracle, caplog):
    """A cache the user prefilled on a system prompt (no draft context), deep-copied for two different
    continuations: each equals generate on its whole prompt, prefills only its own tokens, leaves the
    system cache untouched, and logs once that the draft's context starts at the first uncached token."""
    target, draft = _pair(kind)
    system = _ids(3, 11)
    cache = _prefill(target, system, _fresh_cache(target))
    for seed in (4, 5):
        prompt = torch.cat([system, _ids(seed, 4)], dim=1)
        ref = _greedy(target, prompt, 20)
        seen = oracle(ref)
        tokens, handle = _count_target_tokens(target)
        caplog.clear()
        try:
            with caplog.at_level(logging.INFO):
                out = draft.spec_generate(target, prompt, max_new_tokens=20, temperature=0.0,
                                          return_dict_in_generate=True, **{CACHE_FIELD: copy.deepcopy(cache)})
        finally:
            handle.remove()
        assert torch.equal(out.sequences, ref)
        assert tokens[0] == 4
        assert all(has == start - system.shape[1] for has, start in seen)  # context from position 11 on
        assert sum("draft context" in r.getMessage() for r in caplog.records) == 1
        assert cache.get_seq_length() == system.shape[1]


@pytest.mark.parametrize("kind", KINDS)
def test_generate_and_spec_generate_continue_from_each_others_caches(kind):
    target, draft = _pair(kind)
    prompt, user = _ids(6, 8), _ids(7, 3)
    # generate -> spec_generate (4.57's sliding-window layers cannot be cropped: generate is given a plain cache)
    extra = {CACHE_FIELD: _fresh_cache(target)} if kind == "sliding" and CACHE_FIELD == "past_key_values" else {}
    gen1 = _greedy(target, prompt, 16, return_dict_in_generate=True, **extra)
    turn2 = torch.cat([gen1.sequences, user], dim=1)
    out2 = draft.spec_generate(target, turn2, max_new_tokens=16, temperature=0.0, return_dict_in_generate=True,
                               **{CACHE_FIELD: getattr(gen1, CACHE_FIELD)})
    assert torch.equal(out2.sequences, _greedy(target, turn2, 16))
    # spec_generate -> generate
    turn3 = torch.cat([out2.sequences, user], dim=1)
    gen3 = _greedy(target, turn3, 16, **{CACHE_FIELD: getattr(out2, CACHE_FIELD)})
    assert torch.equal(gen3, _greedy(target, turn3, 16))


def test_stop_inside_an_accepted_block_leaves_generates_cache(oracle):
    """A stop token in the middle of an accepted block ends the output there: the cache must not keep the
    accepted tokens after it (they are not in the conversation the next turn sends)."""
    target, draft = _pair("dense")
    prompt = _ids(8, 7)
    ref = _greedy(target, prompt, 20)
    stop = int(ref[0, 7 + 6])  # the 7th new token, inside the second block (the first fully accepted)
    first = int((ref[0, 7:] == stop).nonzero()[0])
    oracle(ref, script=(7,))
    out = draft.spec_generate(target, prompt, max_new_tokens=20, stop_token_ids=[stop], temperature=0.0,
                              return_dict_in_generate=True)
    assert out.sequences.shape[1] == 7 + first + 1
    cache = getattr(out, CACHE_FIELD)
    assert cache.get_seq_length() == out.sequences.shape[1] - 1
    turn2 = torch.cat([out.sequences, _ids(9, 3)], dim=1)
    oracle(_greedy(target, turn2, 12))
    again = draft.spec_generate(target, turn2, max_new_tokens=12, temperature=0.0, **{CACHE_FIELD: cache})
    assert torch.equal(again, _greedy(target, turn2, 12))


def test_a_cache_another_call_advanced_is_cut_or_left():
    """The draft context is used after checking its length: a cache cropped back (regenerate the last
    reply) keeps the context cut to it; one advanced by generate keeps none (and stays exact)."""
    target, draft = _pair("dense")
    prompt = _ids(10, 9)
    out = draft.spec_generate(target, prompt, max_new_tokens=20, temperature=0.0, return_dict_in_generate=True)
    cache = getattr(out, CACHE_FIELD)
    cropped = copy.deepcopy(cache)
    cropped.crop(-10)
    resume = cache_reuse.Resume(target, draft, cropped, 1)
    pending = 0 if resume.pending is None else resume.pending.features.shape[1]
    assert resume.origin == 0 and resume.draft_cache.get_seq_length() + pending == 18
    turn = torch.cat([out.sequences[:, :19], _ids(11, 2)], dim=1)
    assert torch.equal(draft.spec_generate(target, turn, max_new_tokens=8, temperature=0.0, past_key_values=cropped)
                       if CACHE_FIELD == "past_key_values" else
                       draft.spec_generate(target, turn, max_new_tokens=8, temperature=0.0, cache=cropped),
                       _greedy(target, turn, 8))
    longer = torch.cat([out.sequences, _ids(12, 2)], dim=1)
    _greedy(target, longer, 3, **{CACHE_FIELD: cache})  # generate advances it; the draft context is now stale
    assert cache_reuse.Resume(target, draft, cache, 1).origin == cache.get_seq_length()


def test_passed_cache_refusals():
    target, draft = _pair("dense")
    cache = _prefill(target, _ids(13, 5), _fresh_cache(target))
    kw = {CACHE_FIELD: cache}
    with pytest.raises(ValueError, match="batch size 1, got batch 2"):
        draft.spec_generate(target, torch.cat([_ids(14, 8)] * 2), max_new_tokens=4, **kw)
    with pytest.raises(ValueError, match="batch size 1, got batch 2"):
        draft.spec_generate(target, _ids(14, 8), max_new_tokens=4, num_return_sequences=2, do_sample=True, **kw)
    with pytest.raises(ValueError, match="holds 5 tokens but input_ids only 5"):
        draft.spec_generate(target, _ids(14, 5), max_new_tokens=4, **kw)
    with pytest.raises(ValueError, match="static"):
        draft.spec_generate(target, _ids(14, 8), max_new_tokens=4, cache_implementation="static", **kw)
    with pytest.raises(TypeError, match="DynamicCache.*got tuple"):
        draft.spec_generate(target, _ids(14, 8), max_new_tokens=4, **{CACHE_FIELD: ((1, 2),)})
    if CACHE_FIELD == "cache":
        with pytest.raises(ValueError, match="got both"):
            draft.spec_generate(target, _ids(14, 8), max_new_tokens=4, cache=cache, past_key_values=cache)
    else:
        with pytest.raises(TypeError, match="past_key_values="):
            draft.spec_generate(target, _ids(14, 8), max_new_tokens=4, cache=cache)
        sliding = family_target("mistral")
        window_cache = _greedy(sliding, _ids(15, 8), 4, return_dict_in_generate=True).past_key_values
        with pytest.raises(NotImplementedError, match="sliding-window cache layers"):
            draft.spec_generate(sliding, _ids(15, 14), max_new_tokens=4, past_key_values=window_cache)
    assert cache.get_seq_length() == 5  # nothing ran


def test_batches_return_no_cache():
    target, draft = _pair("dense")
    out = draft.spec_generate(target, torch.cat([_ids(16, 6), _ids(17, 6)]), max_new_tokens=5, temperature=0.0,
                              return_dict_in_generate=True)
    assert getattr(out, CACHE_FIELD) is None


def test_custom_generate_route_continues_from_the_returned_cache():
    """The shipped pair through ``generate(custom_generate=<drafter folder>)``: turn 2 takes turn 1's cache
    under generate's own name and equals generate on the whole conversation; ``past_key_values=`` (the
    deprecated 5.x name) is accepted too."""
    from pathlib import Path

    from transformers import AutoModel, AutoModelForCausalLM

    pair = Path(__file__).resolve().parents[1] / "pair"
    draft = AutoModel.from_pretrained(pair / "drafter", trust_remote_code=True, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(pair / "target", dtype=torch.float32).eval()
    route = dict(custom_generate=str(pair / "drafter"), trust_remote_code=True, assistant_model=draft,
                 do_sample=False, return_dict_in_generate=True)
    prompt = _ids(20, 12)
    turn1 = target.generate(prompt, max_new_tokens=24, **route)
    cache = getattr(turn1, CACHE_FIELD)
    assert cache.get_seq_length() == turn1.sequences.shape[1] - 1 and hasattr(cache, DRAFT_CONTEXT)
    turn2 = torch.cat([turn1.sequences, _ids(21, 6)], dim=1)
    tokens, handle = _count_target_tokens(target)
    try:
        out = target.generate(turn2, max_new_tokens=24, past_key_values=cache, **route)
    finally:
        handle.remove()
    assert tokens[0] == 7 and getattr(out, CACHE_FIELD) is cache
    assert torch.equal(out.sequences, _greedy(target, turn2, 24))


def test_draft_without_context_for_the_cache_sees_the_suffix_from_position_0(monkeypatch):
    """What the position shift (``cache_reuse._ShiftedDraft``) is for: the draft's masks take the keys in
    its cache to sit at positions ``0..past_len-1``, but a passed cache without draft context (here a
    user-prefilled system prompt of ``n`` tokens) gives the draft context from position ``n`` on. Shifted
    by ``n``, every draft call must equal the draft run directly on the uncached suffix alone: a fresh
    draft cache, the target features of positions ``n..`` placed at ``0..``, the block right after them.
    A drafter with a causal sliding layer (window 3 < context) is needed to see it: the tiny drafters are
    bidirectional, and RoPE alone depends on distances only. Greedy output stays generate's.
    Planted: ``_ShiftedDraft`` passing ``position_ids`` unshifted fails the logits comparison here (its
    sliding layer then masks every cached context key as out of the window)."""
    target = _pair("dense")[0]
    draft = tiny_draft(block_size=8, layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    system = _ids(30, 11)
    n = system.shape[1]
    cache = _prefill(target, system, _fresh_cache(target))
    real = proposers._draft_logits
    feats, compared = [], []

    def checked(loop_draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id, **kw):
        feats.append(ctx.features)
        seen = torch.cat(feats, dim=1)  # (1, start - n, F): every context feature the draft has, from position n
        assert seen.shape[1] == int(start[0]) - n == draft_cache.get_seq_length() + ctx.features.shape[1]
        positions = torch.arange(seen.shape[1])[None]  # (1, start - n)
        want = real(draft, embed, head, anchor, _Context(seen, positions, None), DynamicCache(), None,
                    start - n, b, mask_token_id, **kw)
        got = real(loop_draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id, **kw)
        compared.append(draft_cache.get_seq_length())
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        return got

    patch_called(monkeypatch, proposers, "_draft_logits", checked)
    prompt = torch.cat([system, _ids(31, 4)], dim=1)
    out = draft.spec_generate(target, prompt, max_new_tokens=24, temperature=0.0, **{CACHE_FIELD: cache})
    assert torch.equal(out, _greedy(target, prompt, 24))
    assert max(compared) > 3  # calls with more cached context keys than the window were compared


# ----------------------------------------------------------------------------- issue 34 items 3 and 4

def _without_draft_context(source, target, prompt):
    """``(cache, conversation)`` after ``prompt``, the cache carrying no context for a DFlash 2 drafter: built
    by ``target.generate``, by the user's own prefill, or returned by ``spec_generate`` with another drafter."""
    if source == "generate":
        out = _greedy(target, prompt, 8, return_dict_in_generate=True)
        return getattr(out, CACHE_FIELD), out.sequences
    if source == "prefill":
        return _prefill(target, prompt, _fresh_cache(target)), prompt
    out = _pair("dense")[1].spec_generate(target, prompt, max_new_tokens=8, temperature=0.0,
                                          return_dict_in_generate=True)
    return getattr(out, CACHE_FIELD), out.sequences


SOURCES = ["generate", "prefill", "another_drafter"]


def _walks(draft):
    """Counts the DFlash 2 selector walks (one hidden projection each); returns (list, handle)."""
    calls = []
    return calls, draft.candidate_selector.hidden_projection.register_forward_hook(lambda *a: calls.append(1))


@pytest.mark.parametrize("source", SOURCES)
def test_dflash2_drafter_continues_from_a_cache_without_its_draft_context(source):
    """Issue 34 item 3: a DFlash 2 drafter given a cache without its draft context runs through the position
    shift (``cache_reuse._ShiftedDraft``), which must forward the drafter's whole interface (it forwarded
    ``config`` only: AttributeError on ``selector_inputs``). Greedy equals generate on the whole conversation,
    the walk ran, the passed cache advanced in place."""
    from test_dflash2_generate import dflash2_draft

    target, draft = _pair("dense")[0], dflash2_draft()
    cache, conversation = _without_draft_context(source, target, _ids(40, 9))
    turn = torch.cat([conversation, _ids(41, 4)], dim=1)
    walks, handle = _walks(draft)
    try:
        out = draft.spec_generate(target, turn, max_new_tokens=12, temperature=0.0, return_dict_in_generate=True,
                                  **{CACHE_FIELD: cache})
    finally:
        handle.remove()
    assert torch.equal(out.sequences, _greedy(target, turn, 12))
    assert walks and getattr(out, CACHE_FIELD) is cache and cache.get_seq_length() == out.sequences.shape[1] - 1


def test_dflash2_drafter_continues_from_such_caches_through_custom_generate(tmp_path):
    """Issue 34 item 3 on ``target.generate(custom_generate=<folder>, assistant_model=draft)``: the folder's own
    modules (remote code) continue from each kind of cache without draft context, equal to generate."""
    from test_dflash2_generate import dflash2_draft, loaded

    target = _pair("dense")[0]
    draft = loaded(dflash2_draft(), tmp_path, remote=True)
    route = dict(custom_generate=str(tmp_path / "drafter"), trust_remote_code=True, assistant_model=draft,
                 do_sample=False, max_new_tokens=12)
    walks, handle = _walks(draft)
    try:
        for seed, source in enumerate(SOURCES):
            cache, conversation = _without_draft_context(source, target, _ids(42 + seed, 9))
            turn = torch.cat([conversation, _ids(45 + seed, 4)], dim=1)
            out = target.generate(turn, **route, **{CACHE_FIELD: cache})
            assert torch.equal(out, _greedy(target, turn, 12)), source
            assert cache.get_seq_length() == out.shape[1] - 1, source
    finally:
        handle.remove()
    assert walks


def _inference_tensors(cache) -> list:
    """Names of the inference tensors (made under ``torch.inference_mode``) in ``cache``, its layers and the
    draft context attached to it: what cannot be updated in place outside inference mode."""
    context = getattr(cache, DRAFT_CONTEXT, None)
    holders = {"cache": cache, **{f"layer {i}": layer for i, layer in enumerate(cache.layers)}}
    if context is not None:
        holders.update({"draft cache": context.draft_cache, "pending": context.pending,
                        **{f"draft layer {i}": layer for i, layer in enumerate(context.draft_cache.layers)}})
    found = []
    for where, holder in holders.items():
        for name, value in (vars(holder).items() if holder is not None else ()):
            values = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
            found += [f"{where}.{name}" for v in values if isinstance(v, torch.Tensor) and v.is_inference()]
    return found


INFERENCE_KINDS = ["dense", pytest.param("sliding", marks=pytest.mark.skipif(
    CACHE_FIELD == "past_key_values", reason="4.57's sliding-window cache layers are refused (cannot be rolled back)")),
    KINDS[-1]]


@pytest.mark.parametrize("kind", INFERENCE_KINDS)
def test_a_cache_returned_under_inference_mode_is_continued_outside_it(kind):
    """Issue 34 item 4: spec_generate's default ``inference_mode=True`` made the returned cache (and its draft
    context) of inference tensors, which generate and ``spec_generate(inference_mode=False)`` cannot update in
    place (a hybrid target's linear-attention states: RuntimeError). spec_generate first, then each of those
    continuing; every turn equals generate on the whole conversation, a passed cache still advances in place,
    and no returned cache holds an inference tensor. The sliding kind starts from a prefilled
    ``DynamicCache(config=...)`` (5.x sliding layers; the loop's own cache has full layers)."""
    target, draft = _pair(kind)
    prompt, user = _ids(50, 9), _ids(51, 3)
    cache = _prefill(target, prompt[:, :4], DynamicCache(config=target.config)) if kind == "sliding" else None
    out = draft.spec_generate(target, prompt, max_new_tokens=10, temperature=0.0, return_dict_in_generate=True,
                              **({} if cache is None else {CACHE_FIELD: cache}))
    assert torch.equal(out.sequences, _greedy(target, prompt, 10))
    cache = getattr(out, CACHE_FIELD)
    assert not _inference_tensors(cache), _inference_tensors(cache)
    turn = torch.cat([out.sequences, user], dim=1)  # turn 2: spec_generate outside inference mode
    again = draft.spec_generate(target, turn, max_new_tokens=10, temperature=0.0, inference_mode=False,
                                **{CACHE_FIELD: cache})
    assert torch.equal(again, _greedy(target, turn, 10))
    turn = torch.cat([again, user], dim=1)  # turn 3: spec_generate under inference mode, in place
    out = draft.spec_generate(target, turn, max_new_tokens=10, temperature=0.0, return_dict_in_generate=True,
                              **{CACHE_FIELD: cache})
    assert torch.equal(out.sequences, _greedy(target, turn, 10)) and getattr(out, CACHE_FIELD) is cache
    assert cache.get_seq_length() == out.sequences.shape[1] - 1 and not _inference_tensors(cache)
    turn = torch.cat([out.sequences, user], dim=1)  # turn 4: generate
    assert torch.equal(_greedy(target, turn, 10, **{CACHE_FIELD: cache}), _greedy(target, turn, 10))
