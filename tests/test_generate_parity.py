"""spec_generate decides what generate decides: arguments, processors, stopping criteria, output.

Every greedy case runs the same arguments through ``target.generate`` and ``spec_generate`` on a peaked
tiny target (so a wrong prefix changes tokens), with oracle drafts that are fully, partly and never
accepted, batch 1 and a ragged left-padded batch.
"""

import pathlib
import time

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria

import generation_utils
import proposers
from patching import patch_called
from tiny import VOCAB, tiny_draft, tiny_target

PAIR = pathlib.Path(__file__).resolve().parents[1] / "pair"

TARGET = tiny_target(peaked=True)
DRAFT = tiny_draft(block_size=6)
PROMPTS = [torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(100 + n)) for n in (5, 12, 2)]


def _left_pad(prompts, pad=0):
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1]:], mask[i, width - p.shape[1]:] = p[0], 1
    return ids, mask


def _generate(ids, mask, **kwargs):
    return TARGET.generate(ids, attention_mask=mask, **kwargs)


@pytest.fixture
def oracle(monkeypatch):
    """Draft logits replaced by generate's own continuation ``ref`` ``(B, W + new)``, right for
    ``script[step]`` slots then wrong. Rows are told apart by (anchor position, anchor token)."""

    def install(mask, ref, script):
        real = proposers._draft_logits
        pads = (mask.shape[1] - mask.sum(1)).tolist()  # ref index of row r's position 0
        steps = []

        def fake(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id):
            real(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id)
            logits = []
            for s, a in zip(start.tolist(), anchor[:, 0].tolist()):
                r = next((r for r in range(len(ref)) if pads[r] + s < ref.shape[1] and ref[r, pads[r] + s] == a), 0)
                seq = torch.cat([ref[r, pads[r] + s + 1:], torch.zeros(b, dtype=torch.long)])[: b - 1].clone()
                right = script(len(steps), r) if callable(script) else script[len(steps) % len(script)]
                seq[right:] = (seq[right:] + 1) % VOCAB
                logits.append(torch.nn.functional.one_hot(seq, VOCAB).float() * 30)
            steps.append(start.tolist())
            return torch.stack(logits)

        patch_called(monkeypatch, proposers, "_draft_logits", fake)
        return steps

    return install


class LastTokenBias(LogitsProcessor):
    """A user processor, a pure function of the prefix: favours (last token + 7) % V."""

    def __call__(self, input_ids, scores):
        bias = torch.zeros_like(scores)
        bias.scatter_(1, (input_ids[:, -1:] + 7) % scores.shape[-1], 4.0)
        return scores + bias


def _parity_cases():
    ref = _generate(PROMPTS[0], torch.ones_like(PROMPTS[0]), do_sample=False, max_new_tokens=30)[0, 5:].tolist()
    early, often = ref[2], max(set(ref), key=ref.count)
    return {
        "plain": {},
        "repetition_penalty_1.05": dict(repetition_penalty=1.05),
        "repetition_penalty_1.3": dict(repetition_penalty=1.3),
        "no_repeat_ngram_2": dict(no_repeat_ngram_size=2),
        "no_repeat_ngram_3": dict(no_repeat_ngram_size=3),
        "min_new_tokens_eos_early": dict(min_new_tokens=9, eos_token_id=early),
        "min_length": dict(min_length=14, eos_token_id=early),
        "bad_words": dict(bad_words_ids=[[often], [ref[0], ref[1]]]),
        "suppress_tokens": dict(suppress_tokens=[often, ref[4]]),
        "begin_suppress_tokens": dict(begin_suppress_tokens=[ref[0]]),
        "sequence_bias": dict(sequence_bias={(ref[3],): -20.0, (ref[0], ref[1]): 5.0}),
        "prefix_allowed_tokens_fn": dict(
            prefix_allowed_tokens_fn=lambda batch_id, ids: [t for t in range(VOCAB) if (t + int(ids[-1])) % 3]),
        "user_processor": dict(logits_processor=LogitsProcessorList([LastTokenBias()])),
        "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(4, 1.5), eos_token_id=early),
        "forced_eos": dict(forced_eos_token_id=often),
        "encoder_repetition_penalty": dict(encoder_repetition_penalty=1.5),
        "renormalize_and_invalid": dict(renormalize_logits=True, remove_invalid_values=True, repetition_penalty=1.2),
        "combined": dict(repetition_penalty=1.3, no_repeat_ngram_size=3, suppress_tokens=[often],
                         logits_processor=LogitsProcessorList([LastTokenBias()])),
        "eos_list": dict(eos_token_id=[early, often]),
    }


CASES = _parity_cases()
SCRIPTS = {"full": [5], "partly": [1, 3, 0, 2], "never": [0]}


def _check_parity(oracle, prompts, case, script, max_new_tokens=20):
    ids, mask = _left_pad(prompts)
    kwargs = dict(CASES[case])
    ref = _generate(ids, mask, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0, **kwargs)
    steps = oracle(mask, ref, SCRIPTS[script])
    out = DRAFT.spec_generate(TARGET, ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                              pad_token_id=0, **kwargs)
    assert len(steps) > 0
    assert torch.equal(out, ref), (case, script, out[:, ids.shape[1]:].tolist(), ref[:, ids.shape[1]:].tolist())


# every case with drafts partly accepted; the prefix-heavy ones also fully and never accepted
BATCH_1 = [(case, "partly") for case in CASES] + [
    (case, script) for case in ("plain", "repetition_penalty_1.3", "no_repeat_ngram_3", "min_new_tokens_eos_early",
                                "combined") for script in ("full", "never")]


@pytest.mark.parametrize("case, script", BATCH_1)
def test_greedy_parity_batch_1(oracle, case, script):
    _check_parity(oracle, PROMPTS[:1], case, script)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_parity_ragged_batch(oracle, case):
    _check_parity(oracle, PROMPTS, case, "partly")


def test_forced_bos_on_a_one_token_prompt(oracle):
    ids = PROMPTS[0][:, :1]
    ref = _generate(ids, torch.ones_like(ids), do_sample=False, max_new_tokens=10, forced_bos_token_id=3)
    oracle(torch.ones_like(ids), ref, [2])
    out = DRAFT.spec_generate(TARGET, ids, max_new_tokens=10, forced_bos_token_id=3)
    assert torch.equal(out, ref) and out[0, 1] == 3


def test_stop_strings_with_tokenizer_like_generate():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(PAIR / "target")  # byte-level BPE; ids < 97 are short strings
    ids = PROMPTS[1]
    full = _generate(ids, torch.ones_like(ids), do_sample=False, max_new_tokens=30)[0, ids.shape[1]:]
    stop = tok.convert_tokens_to_string(tok.convert_ids_to_tokens(full[5:7].tolist()))
    ref = _generate(ids, torch.ones_like(ids), do_sample=False, max_new_tokens=30, stop_strings=[stop],
                    tokenizer=tok)
    out = DRAFT.spec_generate(TARGET, ids, max_new_tokens=30, stop_strings=[stop], tokenizer=tok)
    assert torch.equal(out, ref) and out.shape[1] < ids.shape[1] + 30
    with pytest.raises(ValueError, match="tokenizer"):
        DRAFT.spec_generate(TARGET, ids, max_new_tokens=30, stop_strings=[stop])


def test_user_stopping_criteria_is_called_per_committed_token(oracle):
    ids = PROMPTS[0]
    full = _generate(ids, torch.ones_like(ids), do_sample=False, max_new_tokens=30)
    seen = []

    class AtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append(input_ids.shape[1])
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= ids.shape[1] + 9, dtype=torch.bool)

    oracle(torch.ones_like(ids), full, [5])  # fully accepted blocks: the stop falls inside one
    out = DRAFT.spec_generate(TARGET, ids, max_new_tokens=30, stopping_criteria=[AtLength()])
    assert torch.equal(out, full[:, : ids.shape[1] + 9])
    assert seen == list(range(ids.shape[1] + 1, ids.shape[1] + 10))  # once per token, in order


def test_generation_config_is_merged_with_the_targets_like_generate():
    target = tiny_target(peaked=True)
    ids = PROMPTS[1]
    eos = int(_generate(ids, torch.ones_like(ids), do_sample=False, max_new_tokens=10)[0, ids.shape[1] + 2])
    target.generation_config.eos_token_id = eos
    cfg = GenerationConfig(max_new_tokens=30)
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    out = DRAFT.spec_generate(target, ids, generation_config=cfg)
    assert torch.equal(out, ref) and out.shape[1] == ids.shape[1] + 3  # the target's eos still stops
    target.generation_config.do_sample = True  # a checkpoint that samples by default: so does the merge
    runs = {DRAFT.spec_generate(target, ids, generation_config=cfg, stop_token_ids=[], temperature=1.5,
                                generator=torch.Generator().manual_seed(s))[0, -20:].tolist().__repr__()
            for s in range(3)}
    assert len(runs) > 1


def test_default_length_is_20_new_tokens_like_generate():
    import warnings

    ids = torch.randint(0, 96, (1, 25), generator=torch.Generator().manual_seed(3))
    target = tiny_target(peaked=True)
    with warnings.catch_warnings(record=True) as theirs:
        warnings.simplefilter("always")
        ref = target.generate(ids, attention_mask=torch.ones_like(ids))
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        out = DRAFT.spec_generate(target, ids)
    assert torch.equal(out, ref) and out.shape[1] == 45
    assert [str(w.message) for w in ours] == [str(w.message) for w in theirs]  # generate's own warnings


def test_explicit_none_means_none():
    target = tiny_target(peaked=True)
    target.generation_config.max_new_tokens = 5
    ids = PROMPTS[0]
    assert DRAFT.spec_generate(target, ids).shape[1] == ids.shape[1] + 5
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=None)
    out = DRAFT.spec_generate(target, ids, max_new_tokens=None)
    assert torch.equal(out, ref) and out.shape[1] == ids.shape[1] + 20
    flat = tiny_target()  # near-uniform logits: at temperature 3 nearly every token appears in 1500 draws
    batch = PROMPTS[0].repeat(1500, 1)
    kw = dict(max_new_tokens=1, do_sample=True, temperature=3.0, generator=torch.Generator().manual_seed(0))
    assert len(set(DRAFT.spec_generate(flat, batch, **kw)[:, -1].tolist())) <= 50  # generate's default top_k
    assert len(set(DRAFT.spec_generate(flat, batch, top_k=None, **kw)[:, -1].tolist())) > 90


def test_temperature_alone_does_not_sample_and_temperature_0_is_greedy():
    target = tiny_target(peaked=True)
    ids = PROMPTS[1]
    greedy = _generate(ids, torch.ones_like(ids), do_sample=False, max_new_tokens=12)
    assert torch.equal(DRAFT.spec_generate(target, ids, max_new_tokens=12, temperature=1.7), greedy)
    target.generation_config.do_sample = True
    assert torch.equal(DRAFT.spec_generate(target, ids, max_new_tokens=12, temperature=0.0), greedy)


def test_max_time_returns_a_prefix_within_one_step():
    target = tiny_target(peaked=True)
    ids = PROMPTS[1]
    full = DRAFT.spec_generate(target, ids, max_new_tokens=60, stop_token_ids=[])
    handle = target.register_forward_pre_hook(lambda *a: time.sleep(0.03))
    try:
        t0 = time.perf_counter()
        out = DRAFT.spec_generate(target, ids, max_new_tokens=60, stop_token_ids=[], max_time=0.15)
        elapsed = time.perf_counter() - t0
    finally:
        handle.remove()
    n = out.shape[1]
    assert ids.shape[1] < n < full.shape[1] and torch.equal(out, full[:, :n])
    assert elapsed < 0.15 + 0.5  # max_time plus one step (and slack for a loaded machine)


def test_int32_ids_and_non_integer_sizes():
    ids = PROMPTS[1]
    ref = DRAFT.spec_generate(TARGET, ids, max_new_tokens=8)
    assert torch.equal(DRAFT.spec_generate(TARGET, ids.int(), max_new_tokens=8), ref)
    with pytest.raises(ValueError, match="block_size"):
        DRAFT.spec_generate(TARGET, ids, max_new_tokens=8, block_size=2.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        DRAFT.spec_generate(TARGET, ids, max_new_tokens=8.0)
    with pytest.raises(TypeError, match="not_an_option"):
        DRAFT.spec_generate(TARGET, ids, max_new_tokens=8, not_an_option=1)


# ----------------------------------------------------------------------------- the GenerationConfig keys


def test_every_generation_config_key_is_classified_once():
    groups = [set(generation_utils.APPLIED_KEYS), set(generation_utils.REFUSED_KEYS),
              set(generation_utils.NO_EFFECT_KEYS)]
    for key in GenerationConfig().to_dict():
        assert sum(key in g for g in groups) == 1, key
    assert all(isinstance(r, str) and r for r in generation_utils.NO_EFFECT_KEYS.values())
    installed = set(GenerationConfig().to_dict())
    tested = set(CASES_BY_KEY) | {"forced_bos_token_id", "stop_strings", "max_time", "max_new_tokens",
                                   "max_length", "do_sample", "temperature", "top_k", "top_p", "min_p",
                                   "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff", "output_scores",
                                   "output_logits", "return_dict_in_generate", "pad_token_id",
                                   "num_return_sequences"}
    assert (generation_utils.APPLIED_KEYS & installed) <= tested


CASES_BY_KEY = {k for case in CASES.values() for k in case if k not in ("logits_processor",
                                                                       "prefix_allowed_tokens_fn")}

REFUSED_VALUES = {
    "num_beams": 2, "num_beam_groups": 2, "diversity_penalty": 0.5, "constraints": ["c"],
    "force_words_ids": [[1]], "penalty_alpha": 0.6, "dola_layers": "low", "guidance_scale": 1.5,
    "watermarking_config": {"greenlist_ratio": 0.25}, "token_healing": True, "output_attentions": True,
    "output_hidden_states": True, "prompt_lookup_num_tokens": 3, "assistant_early_exit": 2,
    "assistant_ensemble_weight": 0.5, "use_mtp": True, "speculation_type": "dflash", "is_assistant": True,
    "encoder_no_repeat_ngram_size": 2,
}


@pytest.mark.parametrize("key", sorted(generation_utils.REFUSED_KEYS))
def test_refused_keys_are_named(key):
    calls = []
    handle = TARGET.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(NotImplementedError, match=key):
            DRAFT.spec_generate(TARGET, PROMPTS[0], max_new_tokens=4, **{key: REFUSED_VALUES[key]})
        if key in GenerationConfig().to_dict():  # also when it comes from a generation_config
            cfg = GenerationConfig()
            setattr(cfg, key, REFUSED_VALUES[key])
            with pytest.raises(NotImplementedError, match=key):
                DRAFT.spec_generate(TARGET, PROMPTS[0], max_new_tokens=4, generation_config=cfg)
    finally:
        handle.remove()
    assert calls == []


NO_EFFECT_VALUES = {"use_cache": False, "cache_implementation": "static", "early_stopping": True,
                    "length_penalty": 2.0, "num_assistant_tokens": 3, "low_memory": True, "bos_token_id": 1,
                    "prefill_chunk_size": 4, "assistant_lookbehind": 3}


@pytest.mark.parametrize("key", sorted(NO_EFFECT_VALUES))
def test_no_effect_keys_change_nothing(key):
    base = DRAFT.spec_generate(TARGET, PROMPTS[0], max_new_tokens=9)
    assert torch.equal(DRAFT.spec_generate(TARGET, PROMPTS[0], max_new_tokens=9, **{key: NO_EFFECT_VALUES[key]}),
                       base)


def test_num_return_sequences_expands_rows_like_generate():
    ids = PROMPTS[1]
    kw = dict(do_sample=True, num_return_sequences=3, max_new_tokens=6)
    out = DRAFT.spec_generate(TARGET, ids, generator=torch.Generator().manual_seed(0), **kw)
    assert out.shape == (3, ids.shape[1] + 6) and (out[:, : ids.shape[1]] == ids).all()
    with pytest.raises(ValueError):  # generate refuses it under greedy, so does spec_generate
        DRAFT.spec_generate(TARGET, ids, max_new_tokens=6, num_return_sequences=2)
