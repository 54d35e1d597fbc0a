"""``spec_generate(draft_window=N)``: every draft layer sees at most the last N context positions before the
anchor, plus the block; a layer's own sliding window applies too. The drafts change, never the output.

The key test perturbs the target features (the draft's context) one position outside the window (the draft's
output is bit-for-bit unchanged) and one position inside it (changed), on every path that builds the draft's
masks: no cache, a cropped ``DynamicCache`` as in the loop, a key-validity mask (ragged batches, the static
loop), sliding-window layers, and a DFlash 2 drafter. Attention is peaked (``tiny.peak``) so that one key
moves the output visibly. Planted bugs caught (each made the test fail, then was reverted): the window off by
one either way (``context_from = anchor - N + 1`` / ``- N - 1`` in ``DFlashDraftModel._layer_masks``), the
window ignored (``context_from = None``), and the key cut one short (``min(N, ...) + q_len - 1``).
"""

import pytest
import torch
from transformers import AutoModel, DynamicCache

import generation_utils
from decode_step import crop_cache
from test_dflash2_generate import dflash2_draft
from tiny import HIDDEN, peak, tiny_draft, tiny_target

CTX, N, B = 20, 6, 4  # context positions 0..19, the anchor at 20, the block at 20..23


def features(seed=3):
    return torch.randn(1, CTX, 2 * HIDDEN, generator=torch.Generator().manual_seed(seed))  # (1, CTX, n_feat * H)


@torch.no_grad()
def draft_out(draft, feats, window, path):
    """The draft's block states ``(1, B, H)`` for context ``feats`` and a fixed block at positions CTX.."""
    noise = torch.randn(1, B, HIDDEN, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(CTX + B)[None]
    kw = {} if window is None else {"draft_window": window}
    if path == "cache":  # as the loop does: the first 13 positions drafted earlier, the block cropped off
        cache, first = DynamicCache(), 13
        draft(position_ids=torch.arange(first + B)[None], noise_embedding=noise, target_hidden=feats[:, :first],
              past_key_values=cache, **kw)
        crop_cache(cache, first)
        return draft(position_ids=positions[:, first:], noise_embedding=noise, target_hidden=feats[:, first:],
                     past_key_values=cache, **kw)
    mask = torch.ones(1, CTX + B, dtype=torch.long) if path == "key_mask" else None
    return draft(position_ids=positions, noise_embedding=noise, target_hidden=feats, attention_mask=mask, **kw)


def perturbed(at):
    feats = features()
    feats[:, at] += 3.0 * torch.randn(feats.shape[-1], generator=torch.Generator().manual_seed(at))
    return feats


def first_visible(draft, path, window, first_seen):
    """Perturbing position ``first_seen - 1`` leaves the output bit-identical; ``first_seen`` changes it."""
    base = draft_out(draft, features(), window, path)
    assert torch.equal(draft_out(draft, perturbed(first_seen - 1), window, path), base), "a key outside is seen"
    changed = (draft_out(draft, perturbed(first_seen), window, path) - base).abs().max()
    assert changed > 1e-3, f"a key inside the window changes nothing ({changed})"


@pytest.mark.parametrize("path", ["plain", "cache", "key_mask"])
@pytest.mark.parametrize("kind", ["dflash1", "dflash2"])
def test_features_outside_the_window_change_nothing_inside_they_do(path, kind):
    draft = peak(tiny_draft(block_size=B) if kind == "dflash1" else dflash2_draft())
    first_visible(draft, path, N, CTX - N)
    base = draft_out(draft, features(), None, path)  # without a window the whole context is seen
    assert (draft_out(draft, perturbed(0), None, path) - base).abs().max() > 1e-3


@pytest.mark.parametrize("layer_window, first_seen", [(4, CTX - 3), (12, CTX - N)])
def test_a_sliding_layer_keeps_its_own_window_and_the_smaller_one_rules(layer_window, first_seen):
    """Sliding layers (causal, window W: W - 1 context positions before the anchor) with N = 6."""
    draft = peak(tiny_draft(block_size=B, layer_types=["sliding_attention"] * 2, sliding_window=layer_window))
    for path in ("plain", "cache", "key_mask"):
        first_visible(draft, path, N, first_seen)


# ----------------------------------------------------------------------------- the loops

TARGET = tiny_target(peaked=True)
PROMPTS = [torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 17)]


def reference(prompt, n):
    return TARGET.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n)


class Windows:
    """Records the ``draft_window`` of every draft forward (None when not passed)."""

    def __init__(self, draft):
        self.seen = []
        self.handle = draft.register_forward_pre_hook(
            lambda module, args, kwargs: self.seen.append(kwargs.get("draft_window")), with_kwargs=True)


@pytest.mark.parametrize("static", [False, True])
def test_greedy_with_a_small_window_equals_generate(static):
    draft = peak(tiny_draft(block_size=6))
    calls = Windows(draft)
    kw = {"cache_implementation": "static"} if static else {}
    for prompt in PROMPTS:
        out = draft.spec_generate(TARGET, prompt, max_new_tokens=30, temperature=0.0, draft_window=3, **kw)
        assert torch.equal(out, reference(prompt, 30))
    assert calls.seen and set(calls.seen) == {3}, calls.seen


def test_static_loop_drafts_what_the_dynamic_loop_drafts_with_the_window():
    """The draft's block states at every step are the dynamic loop's (the static loop masks the keys that
    the dynamic loop cuts), and differ from those drafted without a window (so the comparison sees it)."""
    draft, prompt = peak(tiny_draft(block_size=6)), PROMPTS[1]

    def states(window, n=20, **kw):  # the dynamic loop shortens its last blocks: given a larger budget
        seen = []
        handle = draft.register_forward_hook(lambda module, args, output: seen.append(output.clone()))
        try:
            draft.spec_generate(TARGET, prompt, max_new_tokens=n, temperature=0.0, draft_window=window, **kw)
        finally:
            handle.remove()
        return seen

    # fixed blocks: the static loop drafts the whole block every step; the policy's plain steps and cut blocks
    # would pair its steps with other steps of the dynamic loop
    static, dynamic = states(2, cache_implementation="static"), states(2, n=32, adaptive_block_size=False)
    assert len(static) >= 5
    for got, want in zip(static, dynamic):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(states(None, n=32, adaptive_block_size=False), dynamic))


def test_ragged_batch_with_a_window_equals_generate_per_row():
    draft = peak(tiny_draft(block_size=6))
    short, long_ = PROMPTS
    pad = long_.shape[1] - short.shape[1]
    batch = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1), long_])
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    out = draft.spec_generate(TARGET, batch, attention_mask=mask, max_new_tokens=25, temperature=0.0,
                              draft_window=4)
    for row, prompt in enumerate(PROMPTS):
        new = out[row, long_.shape[1]:]
        assert torch.equal(new, reference(prompt, 25)[0, prompt.shape[1]:]), row


def test_custom_generate_passes_draft_window_through(tmp_path):
    tiny_draft(block_size=6).save_pretrained(tmp_path)
    draft = AutoModel.from_pretrained(str(tmp_path), trust_remote_code=True).eval()
    calls = Windows(draft)
    prompt = PROMPTS[0]
    out = TARGET.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                          custom_generate=str(tmp_path), trust_remote_code=True, assistant_model=draft,
                          draft_window=5)
    assert torch.equal(out, reference(prompt, 12)) and calls.seen and set(calls.seen) == {5}


def test_pipeline_passes_draft_window_through(tmp_path):
    from transformers import pipeline

    from tiny import tiny_tokenizer

    tiny_draft(block_size=6).save_pretrained(tmp_path)
    draft = AutoModel.from_pretrained(str(tmp_path), trust_remote_code=True).eval()
    calls = Windows(draft)
    pipe = pipeline("text-generation", model=TARGET, tokenizer=tiny_tokenizer())
    text = " ".join(f"w{i}" for i in (5, 17, 3, 40, 8, 22, 9))
    plain = pipe(text, max_new_tokens=10, do_sample=False)
    fast = pipe(text, max_new_tokens=10, do_sample=False, custom_generate=str(tmp_path), trust_remote_code=True,
                assistant_model=draft, draft_window=2)
    assert fast == plain and calls.seen and set(calls.seen) == {2}


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_draft_window_is_named_before_any_work(bad, monkeypatch):
    monkeypatch.setattr(generation_utils, "_through_generate", lambda *a, **k: pytest.fail("work started"))
    with pytest.raises(ValueError, match=f"draft_window must be an integer >= 1, got {bad!r}"):
        tiny_draft().spec_generate(TARGET, PROMPTS[0], max_new_tokens=4, draft_window=bad)
