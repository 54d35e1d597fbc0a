import contextlib
import itertools

import pytest
import torch

import generation_utils
import proposers
from patching import patch_called
from tiny import VOCAB, tiny_draft, tiny_target

TARGETS = {kind: tiny_target(kind, peaked=True) for kind in ("qwen3", "llama")}
PROMPTS = {n: torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(n)) for n in (1, 3, 15, 50)}
_REFS = {}


def generate(target, ids, **kwargs):
    """Plain greedy ``target.generate`` (explicit all-ones mask: prompts may contain any id)."""
    return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **kwargs)


def reference(kind, prompt_len, max_new_tokens=64):
    """target.generate greedy continuation (greedy is prefix-closed, so one long run serves all lengths)."""
    key = (kind, prompt_len)
    if key not in _REFS:
        _REFS[key] = generate(TARGETS[kind], PROMPTS[prompt_len], max_new_tokens=64)
    return _REFS[key][:, : prompt_len + max_new_tokens]


@pytest.fixture
def oracle(monkeypatch):
    """Draft logits replaced by an oracle right for a scripted number of slots per step; checks caches."""

    def install(ref, script, target, required=True):
        """``required=False``: the loop may run without drafting (the default policy, when its cost says a
        drafted position never pays), so the oracle is patched without the never-called check."""
        calls = []
        real = proposers._draft_logits

        def fake(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id):
            real(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id)
            start = int(start[0])
            assert draft_cache.get_seq_length() == start  # context K/V of positions < anchor only
            right = script[len(calls) % len(script)]
            calls.append((start, b))
            want = ref[0, start + 1 : start + b].clone()
            want[right:] = (want[right:] + 1) % VOCAB  # wrong from slot right+1 on
            return torch.nn.functional.one_hot(want, VOCAB).float()[None] * 30

        if required:
            patch_called(monkeypatch, proposers, "_draft_logits", fake)
        else:
            monkeypatch.setattr(proposers, "_draft_logits", fake)
        target_cache_lengths = []

        def pre_hook(module, args, kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            target_cache_lengths.append((cache.get_seq_length(), int(kwargs["position_ids"][0, 0])))

        handle = target.register_forward_pre_hook(pre_hook, with_kwargs=True)
        return calls, target_cache_lengths, handle

    return install


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_greedy_equals_target_generate_random_draft(kind, block_size):
    target, draft = TARGETS[kind], tiny_draft(block_size=16)
    for prompt_len, max_new in itertools.product(PROMPTS, (0, 1, 2, 17, 64)):
        out = draft.spec_generate(target, PROMPTS[prompt_len], max_new_tokens=max_new, temperature=0.0,
                                  block_size=block_size, return_dict_in_generate=True)
        assert torch.equal(out.sequences, reference(kind, prompt_len, max_new)), (prompt_len, max_new)
        if max_new > 1:
            assert sum(out.acceptance_lengths) == max_new - 1  # the prefill made the first token


@pytest.mark.parametrize("adaptive", [None, False], ids=["default", "fixed"])
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_greedy_equals_target_generate_oracle_draft(kind, block_size, adaptive, oracle):
    """Oracle right for 0, some, all slots: acceptance = script + 1 (the script's count capped by the drafted
    positions the step verified), caches cut to the committed length. Fixed blocks: every step drafts the whole
    block (capped by the budget), so the steps are the oracle's calls in order. The default policy (cost as
    users run it, modelled on this device): plain steps (no draft pass, acceptance 1) between drafting steps,
    and drafting steps verifying a cut of their block; its drafting steps are the oracle's calls in order."""
    target, draft = TARGETS[kind], tiny_draft(block_size=16)
    script = [0, block_size - 1, 1, 3, block_size - 1, 2]
    drafted_any = False
    for prompt_len, max_new in itertools.product((1, 15, 50), (2, 17, 64)):
        ref = reference(kind, prompt_len, max_new)
        calls, target_lengths, handle = oracle(reference(kind, prompt_len), script, target,
                                               required=adaptive is False)
        try:
            out = draft.spec_generate(target, PROMPTS[prompt_len], max_new_tokens=max_new, temperature=0.0,
                                      block_size=block_size, return_dict_in_generate=True,
                                      adaptive_block_size=adaptive)
        finally:
            handle.remove()
        assert torch.equal(out.sequences, ref)
        (verified,) = out.row_draft_lengths  # drafted positions each step verified (0: a plain step)
        drafting = [i for i, d in enumerate(verified) if d > 0]
        assert len(drafting) == len(calls), (verified, calls)
        expected = [1] * len(verified)  # plain steps commit the target's token alone
        for j, (i, (_, b)) in enumerate(zip(drafting, calls)):
            assert 1 <= verified[i] <= b - 1, (verified, calls)
            expected[i] = min(script[j % len(script)], verified[i]) + 1
        assert out.acceptance_lengths == expected, (verified, calls)
        if adaptive is False:  # the whole block (capped by the budget) every step, then steps with b == 1
            assert drafting == list(range(len(calls))), (verified, calls)
            assert [verified[i] for i in drafting] == [b - 1 for _, b in calls], (verified, calls)
        drafted_any |= bool(calls)
        assert all(length == pos for length, pos in target_lengths)  # target cache == committed, each step
        assert target_lengths[0] == (0, 0) and out.num_target_forwards == len(target_lengths)
    # a fully accepted block of 4 or more pays on any device, so the default drafts at least its first step
    assert drafted_any or (adaptive is None and block_size == 2)


def test_stop_token_inside_an_accepted_block(oracle):
    target, draft = TARGETS["qwen3"], tiny_draft(block_size=8)
    full = reference("qwen3", 3)
    stop = int(full[0, 3 + 5])  # the 6th new token, in the middle of the first fully accepted block
    first = next(i for i in range(3, full.shape[1]) if full[0, i] == stop)
    calls, _, handle = oracle(full, [7], target)
    try:
        out = draft.spec_generate(target, PROMPTS[3], max_new_tokens=40, stop_token_ids=[stop], temperature=0.0)
    finally:
        handle.remove()
    assert torch.equal(out, full[:, : first + 1])
    expected = generate(target, PROMPTS[3], max_new_tokens=40, eos_token_id=stop, pad_token_id=0)
    assert torch.equal(out, expected)


def test_stop_defaults_to_generation_config_eos_list():
    target, draft = tiny_target(peaked=True), tiny_draft()
    full = reference("qwen3", 15)
    stop = int(full[0, 15 + 4])
    target.generation_config.eos_token_id = [VOCAB - 1, stop]
    out = draft.spec_generate(target, PROMPTS[15], max_new_tokens=30, temperature=0.0)
    assert out[0, -1] == stop and stop not in out[0, 15:-1].tolist()
    assert torch.equal(out, generate(target, PROMPTS[15], max_new_tokens=30, pad_token_id=0))


def test_tokens_equal_to_mask_id_are_kept():
    target = TARGETS["qwen3"]
    full = reference("qwen3", 3, 20)
    mask_like = int(full[0, 3 + 2])  # a token the target really generates
    draft = tiny_draft(mask_token_id=mask_like)
    out = draft.spec_generate(target, PROMPTS[3], max_new_tokens=20, temperature=0.0)
    assert torch.equal(out, full) and (out[0, 3:] == mask_like).any()


def test_two_calls_on_the_same_objects_are_independent():
    target, draft = TARGETS["llama"], tiny_draft()
    a = draft.spec_generate(target, PROMPTS[15], max_new_tokens=17, temperature=0.0)
    b = draft.spec_generate(target, PROMPTS[3], max_new_tokens=17, temperature=0.0)
    c = draft.spec_generate(target, PROMPTS[15], max_new_tokens=17, temperature=0.0)
    assert torch.equal(a, c) and torch.equal(b, reference("llama", 3, 17))


def test_prompt_near_max_position_embeddings_runs_on_like_generate():
    """generate() goes past max_position_embeddings (RoPE needs no table): so does spec_generate."""
    target, draft = tiny_target(max_position_embeddings=56), tiny_draft()
    ids = PROMPTS[50]
    out = draft.spec_generate(target, ids, max_new_tokens=30, temperature=0.0)
    assert torch.equal(out, generate(target, ids, max_new_tokens=30))


def test_mixed_dtypes_run_and_fp32_target_stays_exact():
    target = TARGETS["qwen3"]
    draft = tiny_draft().to(torch.bfloat16)
    out = draft.spec_generate(target, PROMPTS[15], max_new_tokens=17, temperature=0.0)
    assert torch.equal(out, reference("qwen3", 15, 17))
    half_target = tiny_target().to(torch.float16)
    out = tiny_draft().spec_generate(half_target, PROMPTS[3], max_new_tokens=9, temperature=0.0)
    assert out.shape == (1, 12)


def test_generation_config_defaults_and_explicit_arguments():
    target, draft = tiny_target(peaked=True), tiny_draft()
    target.generation_config.max_new_tokens = 5
    target.generation_config.do_sample = False
    assert draft.spec_generate(target, PROMPTS[3]).shape == (1, 8)
    assert draft.spec_generate(target, PROMPTS[3], max_new_tokens=2).shape == (1, 5)
    out = draft.spec_generate(target, PROMPTS[3], max_new_tokens=0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, PROMPTS[3]) and out.num_target_forwards == 0
    timed = draft.spec_generate(target, PROMPTS[3], max_new_tokens=9, output_timings=True,
                                return_dict_in_generate=True)
    assert timed.timings["new_tokens"] == 9 and timed.timings["total_s"] > 0


def test_sampling_is_reproducible_with_a_generator():
    target, draft = TARGETS["qwen3"], tiny_draft()

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return draft.spec_generate(target, PROMPTS[3], max_new_tokens=20, do_sample=True, top_k=0,
                                   generator=g)

    assert torch.equal(run(0), run(0))
    assert not torch.equal(run(0), run(1))


def test_left_padding_with_attention_mask_is_stripped():
    target, draft = TARGETS["qwen3"], tiny_draft()
    ids = torch.cat([torch.zeros(1, 4, dtype=torch.long), PROMPTS[3]], 1)
    mask = torch.cat([torch.zeros(1, 4), torch.ones(1, 3)], 1).long()
    out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=9, temperature=0.0)
    assert torch.equal(out[:, :4], ids[:, :4]) and torch.equal(out[:, 4:], reference("qwen3", 3, 9))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, ValueError, "empty"),
        ({"input_ids": torch.zeros(3, dtype=torch.long)}, ValueError, "LongTensor"),
        ({"block_size": 5}, ValueError, r"block_size must be in \[1, 4\]"),
        ({"block_size": 0}, ValueError, "block_size"),
        ({"max_new_tokens": -1}, ValueError, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, ValueError, "max_new_tokens must be an integer"),
        ({"mask_token_id": 500}, ValueError, "mask_token_id=500"),
        ({"input_ids": PROMPTS[3] + 200}, ValueError, "outside the target vocabulary"),
        ({"temperature": -0.5}, ValueError, "temperature"),
        ({"top_p": 1.5, "temperature": 1.0}, ValueError, "top_p"),
        ({"top_k": -1, "temperature": 1.0}, ValueError, "top_k"),
        ({"attention_mask": torch.ones(1, 4)}, ValueError, "attention_mask shape"),
        ({"attention_mask": torch.tensor([[1, 0, 1]])}, ValueError, "left padding"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "streamer": object()}, ValueError, "batch size 1"),
        ({"attention_mask": torch.tensor([[1, 1, 2]])}, ValueError, "only 0 and 1"),
    ],
)
def test_bad_input_is_rejected(kwargs, error, match):
    target, draft = TARGETS["qwen3"], tiny_draft()
    call = {"input_ids": PROMPTS[3], "max_new_tokens": 4, "temperature": 0.0, **kwargs}
    with pytest.raises(error, match=match):
        draft.spec_generate(target, **call)


@pytest.mark.parametrize(
    "draft_kwargs, target_kwargs, match",
    [
        ({"target_hidden_size": 48}, {}, "fc expects 96 input features"),
        ({"target_layer_ids": [0, 5], "num_target_layers": None}, {}, "beyond"),
        ({"num_target_layers": 4}, {"layers": 4}, None),
        ({}, {"layers": 4}, "3-layer target"),
        ({}, {"vocab_size": 90}, "97 tokens.*90 rows"),  # another vocabulary: named before the mask id
    ],
)
def test_draft_target_mismatch_is_caught_before_work(draft_kwargs, target_kwargs, match):
    target, draft = tiny_target(**target_kwargs), tiny_draft(**draft_kwargs)
    calls = []
    target.register_forward_pre_hook(lambda *a: calls.append(1))
    if match is None:  # a matching pair passes
        draft.spec_generate(target, PROMPTS[3], max_new_tokens=3, temperature=0.0)
        return
    with pytest.raises(ValueError, match=match):
        draft.spec_generate(target, PROMPTS[3], max_new_tokens=3, temperature=0.0)
    assert calls == []


def test_a_target_that_is_not_a_causal_lm_is_named():
    draft = tiny_draft()
    with pytest.raises(ValueError, match="target must be a causal LM"):
        draft.spec_generate(draft, PROMPTS[3], max_new_tokens=3)


def test_output_is_a_model_output():
    out = tiny_draft().spec_generate(TARGETS["qwen3"], PROMPTS[3], max_new_tokens=5, temperature=0.0,
                                     return_dict_in_generate=True)
    assert torch.equal(out["sequences"], out.sequences) and "acceptance_lengths" in out.keys()


def test_unsupported_generation_config_option_is_named():
    target, draft = tiny_target(), tiny_draft()
    target.generation_config.num_beams = 2  # repetition_penalty & co. are applied now (tests/test_processors.py)
    with pytest.raises(NotImplementedError, match="num_beams=2"):
        draft.spec_generate(target, PROMPTS[3], max_new_tokens=3, temperature=0.0)


def test_streamer_gets_prompt_once_then_exactly_the_new_tokens():
    class Recorder:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    target, draft = TARGETS["qwen3"], tiny_draft()
    rec = Recorder()
    out = draft.spec_generate(target, PROMPTS[15], max_new_tokens=21, temperature=0.0, streamer=rec)
    assert rec.chunks[0] == PROMPTS[15][0].tolist() and rec.ended
    assert sum(rec.chunks[1:], []) == out[0, 15:].tolist()


def _spy_draft_calls(monkeypatch):
    """Record (start, cache length before, context features, real draft logits) for every draft call."""
    calls = []
    real = proposers._draft_logits

    def spy(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id):
        cached = draft_cache.get_seq_length()
        logits = real(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id)
        calls.append((int(start[0]), cached, ctx.features.clone(), logits.clone()))
        return logits

    patch_called(monkeypatch, proposers, "_draft_logits", spy)
    return calls


def test_draft_context_is_exactly_the_target_features_before_the_anchor(monkeypatch, oracle):
    """After accepts and rollbacks, each draft call sees HF hidden_states[k + 1] of positions < anchor."""
    target, draft = TARGETS["qwen3"], tiny_draft(block_size=8)
    calls = _spy_draft_calls(monkeypatch)
    _, _, handle = oracle(reference("qwen3", 3), [0, 7, 2, 5, 1], target)
    try:
        out = draft.spec_generate(target, PROMPTS[3], max_new_tokens=40, temperature=0.0)
    finally:
        handle.remove()
    hidden = target(out, output_hidden_states=True).hidden_states
    full = torch.cat([hidden[k + 1] for k in draft.config.target_layer_ids], dim=-1)
    assert len(calls) > 5
    for start, cached, context, _ in calls:
        assert cached + context.shape[1] == start
        torch.testing.assert_close(context, full[:, cached:start], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("offset, changes", [(0, False), (-1, True), (-3, True)])
def test_feature_at_the_anchor_is_invisible_the_one_before_is_seen(monkeypatch, oracle, offset, changes):
    """Perturb only the captured feature of position anchor+offset; compare the draft at that anchor."""
    target, draft = TARGETS["qwen3"], tiny_draft(block_size=4)
    anchor = 9
    real_capture, real_draft_logits = generation_utils.capture_target_features, proposers._draft_logits

    def run(perturb_at):
        positions = []
        handle = target.register_forward_pre_hook(
            lambda m, a, kw: positions.append(kw["position_ids"][0]), with_kwargs=True)

        @contextlib.contextmanager
        def capture(model, layer_ids, *args, **kwargs):
            with real_capture(model, layer_ids, *args, **kwargs) as get:
                def perturbed():
                    feats = get().clone()
                    feats[:, positions[-1] == perturb_at] += 5.0
                    return feats
                yield perturbed

        patch_called(monkeypatch, generation_utils, "capture_target_features", capture)
        calls = _spy_draft_calls(monkeypatch)
        o_handle = oracle(reference("qwen3", 3), [0], target)[2]  # always rejected: every position anchors
        try:  # fixed blocks: every position anchors a draft only if every step drafts (the policy runs plain)
            draft.spec_generate(target, PROMPTS[3], max_new_tokens=12, temperature=0.0, adaptive_block_size=False)
        finally:
            handle.remove()
            o_handle.remove()
        monkeypatch.setattr(generation_utils, "capture_target_features", real_capture)
        monkeypatch.setattr(proposers, "_draft_logits", real_draft_logits)
        return {start: logits for start, _, _, logits in calls}

    base, perturbed = run(perturb_at=-100), run(perturb_at=anchor + offset)
    assert anchor in base and anchor in perturbed
    assert (not torch.allclose(base[anchor], perturbed[anchor])) == changes
    for start in base:  # drafts anchored at or before the perturbed position never see it
        if start <= anchor + offset:
            torch.testing.assert_close(base[start], perturbed[start], rtol=0, atol=0)


def _left_pad(prompts, pad=0):
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1]:], mask[i, width - p.shape[1]:] = p[0], 1
    return ids, mask


@pytest.fixture
def batch_oracle(monkeypatch):
    """Row-aware oracle: row r is right for (step + 2 r) % b slots, so rows accept different counts."""

    def install(refs):
        real = proposers._draft_logits
        steps = []

        def fake(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id):
            real(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id)
            logits = []
            for s, a in zip(start.tolist(), anchor[:, 0].tolist()):
                rows = [r for r, ref in enumerate(refs) if ref.shape[1] > s and ref[0, s] == a]
                assert len(rows) >= 1
                r = rows[0]
                want = torch.cat([refs[r][0, s + 1 : s + b], torch.zeros(b, dtype=torch.long)])[: b - 1].clone()
                right = (len(steps) + 2 * r) % b
                want[right:] = (want[right:] + 1) % VOCAB
                logits.append(torch.nn.functional.one_hot(want, VOCAB).float() * 30)
            steps.append(start.tolist())
            return torch.stack(logits)

        patch_called(monkeypatch, proposers, "_draft_logits", fake)
        return steps

    return install


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_ragged_batch_rows_equal_their_batch_1_runs(kind, batch_oracle):
    target, draft = TARGETS[kind], tiny_draft(block_size=8)
    lens = (3, 15, 50)
    refs = [reference(kind, n, 40) for n in lens]
    steps = batch_oracle(refs)
    ids, mask = _left_pad([PROMPTS[n] for n in lens])
    out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=40, temperature=0.0,
                              return_dict_in_generate=True)
    assert len(steps) > 3 and out.num_new_tokens == [40, 40, 40]
    rows = out.row_acceptance_lengths
    assert rows[0] != rows[1] and rows[1] != rows[2]  # rows really accepted different counts
    for r, n in enumerate(lens):
        assert torch.equal(out.sequences[r, ids.shape[1]:], refs[r][0, n:]), r
        alone = draft.spec_generate(target, PROMPTS[n], max_new_tokens=40, temperature=0.0)
        assert torch.equal(alone[0, n:], refs[r][0, n:])
    assert out.acceptance_lengths == rows[0] + rows[1] + rows[2]


def test_ragged_batch_random_draft_and_early_stop():
    """One row stops early on its stop token (then is padded), the others run to max_new_tokens."""
    target, draft = TARGETS["qwen3"], tiny_draft()
    lens = (15, 3, 50)
    refs = [reference("qwen3", n, 30) for n in lens]
    stop = int(refs[1][0, 3 + 4])
    ids, mask = _left_pad([PROMPTS[n] for n in lens], pad=7)
    out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=30, temperature=0.0,
                              stop_token_ids=[stop], return_dict_in_generate=True)
    width = ids.shape[1]
    for r, n in enumerate(lens):
        ref = refs[r][0, n:].tolist()
        if stop in ref:
            ref = ref[: ref.index(stop) + 1]
        assert out.num_new_tokens[r] == len(ref)
        assert out.sequences[r, width : width + len(ref)].tolist() == ref
        assert (out.sequences[r, width + len(ref) :] == stop).all()  # padded with the (only) stop id
    assert out.num_new_tokens[1] <= 5
    assert max(out.num_new_tokens) == 30 == out.sequences.shape[1] - width


def test_batch_drops_finished_rows_from_forward_passes():
    target, draft = TARGETS["qwen3"], tiny_draft()
    sizes = []
    handle = target.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape[0]),
                                              with_kwargs=True)
    ids, mask = _left_pad([PROMPTS[3], PROMPTS[15]])
    stop = int(reference("qwen3", 3, 5)[0, 3 + 1])
    try:
        draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=12, stop_token_ids=[stop],
                            temperature=0.0)
    finally:
        handle.remove()
    assert sizes[0] == 2 and sizes[-1] == 1


def test_batch_with_sliding_window_target_equals_batch_1():
    """Cache holes no longer shift a sliding window: the mask counts it in true positions (test_families)."""
    target = tiny_target(use_sliding_window=True, sliding_window=8, max_window_layers=1, peaked=True,
                         layer_types=["full_attention", "sliding_attention", "sliding_attention"])
    ids, mask = _left_pad([PROMPTS[3], PROMPTS[15]])
    out = tiny_draft().spec_generate(target, ids, attention_mask=mask, max_new_tokens=20, temperature=0.0)
    for r, n in enumerate((3, 15)):
        assert torch.equal(out[r, ids.shape[1]:], generate(target, PROMPTS[n], max_new_tokens=20)[0, n:]), r


def test_text_iterator_streamer_receives_exactly_the_new_tokens():
    import threading

    from transformers import TextIteratorStreamer

    from tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    target, draft = TARGETS["qwen3"], tiny_draft(block_size=8)
    full = reference("qwen3", 15, 30)
    stop = int(full[0, 15 + 12])
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=draft.spec_generate(
        target, PROMPTS[15], max_new_tokens=30, temperature=0.0, stop_token_ids=[stop], streamer=streamer)))
    thread.start()
    text = "".join(streamer)
    thread.join()
    out = result["out"]
    assert out[0, -1] == stop and out.shape[1] <= 15 + 13
    assert text.split() == tokenizer.decode(out[0, 15:]).split()
