"""Hybrid linear-attention targets (Qwen3.5 / Qwen3.6, Qwen3.5-MoE, Qwen3-Next): exact rollback.

Tiny targets are built from transformers' own classes (4 layers: linear, full, linear, linear, as
the published 3:1 stacks), with peaked attention (``tiny.peak``) and non-trivial gates: random init
draws A in [0.01, 16], so the gated-delta state forgets almost everything at each token and a
state bug changes nothing; here A is in [0.02, 0.4] (decay 0.6-0.97 per token). Planted bugs
(skip one layer's rollback, roll back the convolution state only, let padding reach a row's state)
must fail ``test_restored_states_equal_a_prefill_of_the_committed_tokens``; the greedy and batch
tests catch them too (checked by hand when this file was written).
"""

import importlib
import itertools

import pytest
import torch
import transformers

import generation_utils
import proposers
import target_cache
from patching import patch_called
from tiny import VOCAB, peak, tiny_draft, tiny_target

V5 = int(transformers.__version__.split(".")[0]) >= 5
needs_v5 = pytest.mark.skipif(not V5, reason="Qwen3.5 and the linear-attention DynamicCache exist from transformers 5 "
                                             "(4.57's Qwen3-Next is refused: test_qwen3_next_on_4_57_is_refused_before_any_forward)")
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
COMMON = dict(vocab_size=VOCAB, hidden_size=40, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=10, max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None,
              linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
              linear_num_value_heads=4, layer_types=LAYER_TYPES)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)


def _config_and_class(kind):
    T = transformers
    if kind == "qwen3_5":
        return T.Qwen3_5TextConfig(intermediate_size=72, **COMMON), T.Qwen3_5ForCausalLM
    if kind == "qwen3_5_moe":
        return T.Qwen3_5MoeTextConfig(**COMMON, **MOE), T.Qwen3_5MoeForCausalLM
    if kind == "qwen3_next":
        return T.Qwen3NextConfig(**COMMON, **MOE), T.Qwen3NextForCausalLM
    if kind == "qwen3_5_vl":  # the class Qwen3.5 / Qwen3.6 checkpoints are published with, text prompts only
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=40, patch_size=2,
                      temporal_patch_size=1, num_position_embeddings=16)
        config = T.Qwen3_5Config(text_config=dict(intermediate_size=72, **COMMON), vision_config=vision,
                                 image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)
        return config, T.Qwen3_5ForConditionalGeneration
    raise ValueError(kind)


@torch.no_grad()
def remember(model, out: float = 1.0, qkv: float = 1.0):
    """Gates that keep memory (A in [0.02, 0.4]); ``out``/``qkv`` scale the mixers' projections so
    that the linear-attention state weighs more in the logits."""
    for module in model.modules():
        if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
            module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.02, 0.4).log())
            module.out_proj.weight.mul_(out)
            if qkv != 1.0:  # Qwen3.5 names it in_proj_qkv (Qwen3-Next fuses z in: in_proj_qkvz)
                module.in_proj_qkv.weight.mul_(qkv)
    return model


@torch.no_grad()
def tiny_hybrid(kind="qwen3_5", seed=0):
    """A peaked fp32 hybrid target with gates that keep memory (module docstring)."""
    torch.manual_seed(seed)
    config, cls = _config_and_class(kind)
    model = cls(config).eval()
    peak(model, head=4.0)  # x10 makes these tiny stacks loop on one token
    remember(model)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def hybrid_draft(**overrides):
    return tiny_draft(**{"num_target_layers": 4, "target_layer_ids": [0, 3], "block_size": 8, **overrides})


PROMPTS = [torch.randint(0, 90, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 3, 17)]
_TARGETS, _REFS = {}, {}


def target_for(kind):
    if kind not in _TARGETS:
        _TARGETS[kind] = tiny_hybrid(kind)
    return _TARGETS[kind]


def reference(kind, p=0, max_new_tokens=48):
    """``target.generate`` greedy (prefix-closed, so one run of 48 serves every shorter length)."""
    if (kind, p) not in _REFS:
        ids = PROMPTS[p]
        _REFS[kind, p] = target_for(kind).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                    max_new_tokens=48)
    return _REFS[kind, p][:, : PROMPTS[p].shape[1] + max_new_tokens]


def _oracle(monkeypatch, refs, script):
    """Draft logits right for ``script[step] (+ 2 * row)`` slots per row, wrong after (row r follows refs[r])."""
    real, steps = proposers._draft_logits, []

    def fake(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id):
        real(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id)
        logits = []
        for s, a in zip(start.tolist(), anchor[:, 0].tolist()):
            r = next(r for r, ref in enumerate(refs) if ref.shape[1] > s and ref[0, s] == a)
            want = torch.cat([refs[r][0, s + 1 : s + b], torch.zeros(b, dtype=torch.long)])[: b - 1].clone()
            right = (script[len(steps) % len(script)] + 2 * r) % b
            want[right:] = (want[right:] + 1) % VOCAB
            logits.append(torch.nn.functional.one_hot(want, VOCAB).float() * 30)
        steps.append(start.tolist())
        return torch.stack(logits)

    patch_called(monkeypatch, proposers, "_draft_logits", fake)
    return steps


# ----------------------------------------------------------------------------- the cache itself


def _verify_then_restore(target, prompts, block, committed):
    """Prefill ``prompts`` (B, L), verify ``block`` (B, b) with recording, roll back to ``committed``."""
    cache = target_cache.new_target_cache(target)
    assert isinstance(cache, target_cache.HybridCache)
    with torch.no_grad():
        target(input_ids=prompts, cache=cache, use_cache=True)
        with target_cache.recording(cache):
            target(input_ids=block, cache=cache, use_cache=True)
        cache.crop(-(block.shape[1] - int(committed.max())))
        cache.restore_linear_states(committed)
    return cache


def _prefilled(target, ids):
    cache = target_cache.new_target_cache(target)
    with torch.no_grad():
        target(input_ids=ids, cache=cache, use_cache=True)
    return cache


def _assert_states_equal_prefill(kind):
    target = target_for(kind)
    prompts = torch.randint(0, 90, (3, 7), generator=torch.Generator().manual_seed(1))
    block = torch.randint(0, 90, (3, 6), generator=torch.Generator().manual_seed(2))
    committed = torch.tensor([1, 4, 6])  # none, some, all of the drafts accepted
    cache = _verify_then_restore(target, prompts, block, committed)
    assert cache.get_seq_length() == 7 + 6  # attention layers keep the widest row; holes are masked
    for r, c in enumerate(committed.tolist()):
        alone = _prefilled(target, torch.cat([prompts[r : r + 1], block[r : r + 1, :c]], dim=1))
        for i in target_cache.linear_layer_ids(target):
            for got, want in zip(target_cache._states(cache.layers[i]), target_cache._states(alone.layers[i])):
                torch.testing.assert_close(got[r : r + 1], want, rtol=1e-4, atol=1e-5, msg=f"row {r} layer {i}")


@needs_v5
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_restored_states_equal_a_prefill_of_the_committed_tokens(kind):
    _assert_states_equal_prefill(kind)


@needs_v5
def test_every_layer_counts_the_tokens_the_cache_holds_after_a_rollback():
    """transformers 5.25 counts a linear layer's tokens (``cumulative_length_linear``) and answers
    ``Cache.get_seq_length()`` with layer 0's count, a linear layer here: generate's ``_prefill`` slices a
    continued prompt by it and the model's default positions start there. After a verify and a rollback the
    cache as a user gets it (a plain ``DynamicCache`` on the same layers) says 13, and so does every layer
    that counts (issue 48: the count drifted by the rejected drafts and again by the replay, 18)."""
    target = target_for("qwen3_5")
    prompts = torch.randint(0, 90, (3, 7), generator=torch.Generator().manual_seed(1))
    block = torch.randint(0, 90, (3, 6), generator=torch.Generator().manual_seed(2))
    cache = _verify_then_restore(target, prompts, block, torch.tensor([1, 4, 5]))
    plain = transformers.DynamicCache(config=target.config)
    plain.layers = cache.layers
    assert cache.get_seq_length() == int(plain.get_seq_length()) == 7 + 5
    counts = [int(layer.cumulative_length_linear) for layer in cache.layers if hasattr(layer, "cumulative_length_linear")]
    assert counts == [7 + 5] * len(counts)
    assert isinstance(cache.get_seq_length(), int)  # a 0-dim counter would move with the next forward


def _skip_last_layer(real):
    def restore(cache, i, committed):
        if i != max(cache._mixers):
            real(cache, i, committed)
    return restore


def _conv_only(real):
    def restore(cache, i, committed):
        recurrent_after_verify = target_cache._states(cache.layers[i])[1].clone()
        real(cache, i, committed)
        target_cache._set_states(cache.layers[i], target_cache._states(cache.layers[i])[0], recurrent_after_verify)
    return restore


def _padded_replay(real):
    """Replay all short rows together, zero-padded at the end to the longest (the bug the grouping prevents)."""
    def restore(cache, i, committed):
        layer, inputs = cache.layers[i], cache._inputs[i]
        rows = (committed < inputs.shape[1]).nonzero()[:, 0]
        if len(rows) == 0:
            return
        conv_now, recurrent_now = target_cache._states(layer)
        width = int(committed[rows].max())
        x = inputs[rows, :width] * (torch.arange(width)[None] < committed[rows, None])[..., None]
        target_cache._set_states(layer, *(s[rows].clone() for s in cache._snapshots[i]))
        cache._mixers[i](hidden_states=x, cache=cache)
        conv_now[rows], recurrent_now[rows] = target_cache._states(layer)
        target_cache._set_states(layer, conv_now, recurrent_now)
    return restore


PLANTED = {"skip_one_layer": _skip_last_layer, "conv_not_recurrent": _conv_only, "padding_reaches_state": _padded_replay}


@needs_v5
@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_rollback_bugs_are_caught(bug, monkeypatch):
    monkeypatch.setattr(target_cache, "_restore_layer", PLANTED[bug](target_cache._restore_layer))
    with pytest.raises(AssertionError):
        _assert_states_equal_prefill("qwen3_5")


@needs_v5
def test_every_snapshot_maps_to_its_layer():
    target = target_for("qwen3_5")
    cache = _prefilled(target, PROMPTS[0])
    with target_cache.recording(cache):
        target(input_ids=PROMPTS[1], cache=cache, use_cache=True)
    del cache._snapshots[2]
    with pytest.raises(AssertionError, match="snapshots of"):
        cache.restore_linear_states(torch.tensor([1]))
    decoder = target.get_decoder()
    decoder.layers[2].linear_attn.layer_idx = 3  # a mixer that is not its layer's
    try:
        with pytest.raises(NotImplementedError, match="layer_idx=2"):
            target_cache.check_target_cache(target)
    finally:
        decoder.layers[2].linear_attn.layer_idx = 2


# ----------------------------------------------------------------------------- spec_generate == generate


@needs_v5
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_vl"])
def test_greedy_equals_target_generate(kind, monkeypatch):
    """Oracle drafts accepted never, fully and partly (rollback on most steps), then a random draft."""
    target, draft, ref = target_for(kind), hybrid_draft(), reference(kind)
    out = draft.spec_generate(target, PROMPTS[0], max_new_tokens=48, temperature=0.0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    steps = _oracle(monkeypatch, [ref], script=[0, 7, 2, 5, 1, 3, 6])
    out = draft.spec_generate(target, PROMPTS[0], max_new_tokens=48, temperature=0.0, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    partial = [a for a in out.acceptance_lengths if 1 < a < 8]
    assert len(steps) >= 8 and len(partial) >= 5 and 8 in out.acceptance_lengths and 1 in out.acceptance_lengths


@needs_v5
def test_ragged_batch_rows_equal_their_batch_1_generate(monkeypatch):
    """Left padding (3 prompt lengths), per-row acceptance, one row stopping early (rows leave the cache)."""
    kind = "qwen3_5"
    target, draft = target_for(kind), hybrid_draft()
    refs = [reference(kind, p) for p in range(3)]
    stop = int(refs[1][0, 3 + 9])  # row 1 stops at its 10th new token (or at an earlier copy of it)
    steps = _oracle(monkeypatch, refs, script=[0, 3, 5, 1, 6])
    width = max(p.shape[1] for p in PROMPTS)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(PROMPTS):
        ids[r, width - p.shape[1] :], mask[r, width - p.shape[1] :] = p[0], 1
    out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=40, temperature=0.0,
                              stop_token_ids=[stop], return_dict_in_generate=True)
    rows = out.row_acceptance_lengths
    assert len(steps) > 5 and rows[0] != rows[2]
    for r, p in enumerate(PROMPTS):
        want = refs[r][0, p.shape[1] : p.shape[1] + 40].tolist()
        if stop in want:
            want = want[: want.index(stop) + 1]
        assert out.sequences[r, width : width + len(want)].tolist() == want, r
        assert out.num_new_tokens[r] == len(want)
    assert out.num_new_tokens[1] <= 10 < max(out.num_new_tokens)


@needs_v5
def test_save_pretrained_ships_target_cache_and_the_loaded_draft_runs_a_hybrid(tmp_path):
    from transformers import AutoModel

    draft = hybrid_draft()
    draft.save_pretrained(tmp_path)
    assert (tmp_path / "target_cache.py").read_bytes() == importlib.util.find_spec("target_cache").loader.get_data(
        importlib.util.find_spec("target_cache").origin)
    loaded = AutoModel.from_pretrained(str(tmp_path), trust_remote_code=True).eval()
    assert type(loaded).__module__ != type(draft).__module__
    out = loaded.spec_generate(target_for("qwen3_5"), PROMPTS[0], max_new_tokens=12, temperature=0.0)
    assert torch.equal(out, reference("qwen3_5", 0, 12))


# ----------------------------------------------------------------------------- sampling


@needs_v5
def test_sampled_output_distribution_is_the_hybrid_targets():
    """Chi-square against the enumerated joint of 3 tokens (tests/test_sampling.py's harness), block 2."""
    from test_sampling import _chi_square, _exact_joint, _sampled_counts
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    vocab = 8
    torch.manual_seed(11)
    config = transformers.Qwen3_5TextConfig(intermediate_size=24, **{**COMMON, "vocab_size": vocab})
    target = transformers.Qwen3_5ForCausalLM(config).eval()
    remember(peak(target, head=12.0), out=10.0, qkv=5.0)  # without rollback: stat ~2000 vs critical ~90
    draft = hybrid_draft(vocab_size=vocab, mask_token_id=vocab - 1, block_size=2, seed=12)
    prompt = torch.tensor([[1, 4, 2, 5]])
    exact = _exact_joint(target, prompt, LogitsProcessorList([TemperatureLogitsWarper(0.8)]), 3)
    counts = _sampled_counts(draft, target, prompt, 1500, 3, 0, temperature=0.8, top_k=0)
    stat, crit = _chi_square(counts, exact)
    assert stat < crit, (stat, crit)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.skipif(V5, reason="transformers 4.57 only: 5.x runs Qwen3-Next (test_greedy_equals_target_generate)")
def test_qwen3_next_on_4_57_is_refused_before_any_forward():
    torch.manual_seed(0)
    cfg = transformers.Qwen3NextConfig(**COMMON, **MOE)
    target = transformers.Qwen3NextForCausalLM(cfg).eval()
    target.generation_config.eos_token_id = None
    calls = []
    target.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(NotImplementedError, match=r"transformers 4\.57\.1 .*transformers >= 5\.24 serves it"):
        hybrid_draft().spec_generate(target, PROMPTS[0], max_new_tokens=4, temperature=0.0)
    assert calls == []


def test_an_unsupported_recurrent_family_is_refused_with_the_real_reason():
    """Layer types outside attention / linear_attention, and linear_attention of an untested family."""
    target, draft = tiny_target(), tiny_draft()
    calls = []
    target.register_forward_pre_hook(lambda *a: calls.append(1))
    target.config.layer_types = ["full_attention", "mamba", "full_attention"]
    with pytest.raises(NotImplementedError, match=r"layer types \['mamba'\] \(qwen3\) keep state"):
        draft.spec_generate(target, PROMPTS[1], max_new_tokens=4, temperature=0.0)
    target.config.layer_types = ["full_attention", "linear_attention", "full_attention"]
    with pytest.raises(NotImplementedError, match="hybrid target model_type 'qwen3'"):
        draft.spec_generate(target, PROMPTS[1], max_new_tokens=4, temperature=0.0)
    assert calls == []


# ----------------------------------------------------------------------------- threads


@needs_v5
def test_a_recording_sees_only_the_forwards_of_its_own_cache():
    """Deterministic interleaving: call A's verify forward runs while call B's recording is open (another
    thread's forward on the same mixers); B's snapshots and inputs stay B's, A's run is not recorded."""
    import threading

    target = target_for("qwen3_5")
    mine, other = _prefilled(target, PROMPTS[0]), _prefilled(target, PROMPTS[2])
    with target_cache.recording(mine):
        target(input_ids=PROMPTS[1], cache=mine, use_cache=True)
        recorded = {i: x.clone() for i, x in mine._inputs.items()}
        thread = threading.Thread(target=lambda: target(input_ids=PROMPTS[2][:, :5], cache=other, use_cache=True))
        thread.start()
        thread.join()
    assert all(torch.equal(mine._inputs[i], recorded[i]) for i in recorded)
    assert other._snapshots == {} and other._inputs == {}


@needs_v5
def test_threads_on_one_hybrid_target_each_equal_generate():
    """Three threads, two calls each, on one target; every call equals ``target.generate``.
    A tiny switch interval makes the threads interleave inside forwards (the bug: hooks on the shared
    mixers recorded every thread's forward into whichever call had registered them)."""
    import sys
    import threading

    kind = "qwen3_5"
    target, draft = target_for(kind), hybrid_draft()
    refs = [reference(kind, p, 24) for p in range(3)]
    results, errors = {}, []

    def worker(t):
        try:
            for k in range(2):
                p = (t + k) % 3
                results[t, k] = (p, draft.spec_generate(target, PROMPTS[p], max_new_tokens=24, temperature=0.0))
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    wrong = [key for key, (p, out) in results.items() if not torch.equal(out, refs[p])]
    assert len(results) == 6 and not wrong, wrong


def _native_oracle(monkeypatch, ref, script):
    """transformers' native DFlash generator drafts (the drafter still runs), then its candidates are replaced by
    ``ref``'s tokens, right for ``script[step]`` slots and wrong after: the target accepts some and rejects the
    rest, so its own rollback of the linear layers is exercised (a random drafter is rejected at every slot)."""
    from transformers.generation import candidate_generator

    cls = candidate_generator.DFlashTokenCandidateGenerator
    real, steps = cls.get_candidates, []

    def fake(self, input_ids, *args, **kwargs):
        ids, logits = real(self, input_ids, *args, **kwargs)
        n, drafted = input_ids.shape[1], ids.shape[1] - input_ids.shape[1]
        if drafted <= 0 or n >= ref.shape[1]:
            return ids, logits
        want = torch.cat([ref[0, n: n + drafted], torch.zeros(drafted, dtype=torch.long)])[:drafted]
        right = script[len(steps) % len(script)]
        want[right:] = (want[right:] + 1) % VOCAB
        steps.append(right)
        return torch.cat([input_ids, want[None]], dim=1), None if logits is None else torch.nn.functional.one_hot(
            want, logits.shape[-1]).float()[None] * 30

    monkeypatch.setattr(cls, "get_candidates", fake)
    return steps


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_native_route_on_a_hybrid_target_equals_generate_or_is_refused_naming_it(kind, monkeypatch):
    """``target.generate(assistant_model=draft, speculation_type="dflash")`` on a hybrid target (issue 48): on
    5.25 transformers rolls its linear layers back itself (a recurrent-state history) and the output is
    generate's, with drafts partly accepted; before 5.25 transformers refuses the stateful target by its class
    name; 4.57 has no native route."""
    import native_routes

    if not native_routes.native_dflash_available():
        pytest.skip("transformers 4.57 has no native DFlash route (speculation_type arrived in 5.x)")
    if not V5 or not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip("no hybrid class on this version")
    target, draft = tiny_hybrid(kind), hybrid_draft()
    ids = PROMPTS[0]
    ref = reference(kind, 0, 40)
    steps = _native_oracle(monkeypatch, ref, script=[0, 7, 2, 5, 1, 3, 6])
    call = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40, assistant_model=draft,
                speculation_type="dflash")
    from tested_versions import _minor
    if _minor(transformers.__version__) < (5, 25):
        with pytest.raises(ValueError, match=f"not supported with stateful models, such as {type(target).__name__}"):
            target.generate(ids, **call)
        return
    with draft.native_acceptance_stats(target) as stats:
        out = target.generate(ids, **call)
    assert torch.equal(out, ref)
    assert max(steps) > 3 and 0 in steps  # some blocks accepted far, some rejected at once
    assert max(stats(out, ids.shape[1]).acceptance_lengths) > 3
