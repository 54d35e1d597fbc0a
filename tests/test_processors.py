"""Processors on both sides, sampled distributions, scores/logits, the result class, per-thread capture.

Distribution tests reuse the chi-square harness of tests/test_sampling.py, with the exact target
distribution enumerated through the processors generate builds (prefix-dependent ones included).
"""

import json
import pathlib
import pydoc
import threading

import pytest
import torch
import transformers
from transformers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TypicalLogitsWarper,
)
from transformers.generation import GenerateDecoderOnlyOutput

import proposers
import speculative_sampling
from patching import patch_called
from test_generate_parity import PROMPTS, _check_parity, _generate, _left_pad, oracle  # noqa: F401 (fixture)
from test_sampling import _chi_square, _peaky_pair
from tiny import tiny_draft, tiny_target

PAIR = pathlib.Path(__file__).resolve().parents[1] / "pair"
TOP_H = getattr(transformers, "TopHLogitsWarper", None)


# ----------------------------------------------------------------------------- distributions


def _exact_joint(target, prompt, procs, n_tokens):
    """Exact probabilities of the first n tokens; processors see each enumerated prefix."""
    vocab = target.config.vocab_size
    joint, prefixes = torch.ones(1, dtype=torch.float64), prompt
    with torch.no_grad():
        for _ in range(n_tokens):
            logits = target(prefixes).logits[:, -1].float()
            probs = torch.softmax(procs(prefixes, logits), dim=-1).double()
            joint = (joint[:, None] * probs).reshape(-1)
            prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0),
                                  torch.arange(vocab).repeat(prefixes.shape[0])[:, None]], dim=1)
    return joint


DIST_CASES = {
    "typical_p": (dict(typical_p=0.7), [TypicalLogitsWarper(0.7)]),
    "epsilon": (dict(epsilon_cutoff=0.08), [EpsilonLogitsWarper(0.08)]),
    "eta": (dict(eta_cutoff=0.08), [EtaLogitsWarper(0.08)]),
    "repetition_penalty": (dict(repetition_penalty=3.0), [RepetitionPenaltyLogitsProcessor(3.0)]),
}
if TOP_H is not None:  # transformers 5.x
    DIST_CASES["top_h"] = (dict(top_h=0.4), [TOP_H(0.4)])


def _distribution(case, n=6000, n_tokens=3, seed=0, **options):
    kwargs, procs = DIST_CASES[case]
    target, draft = _peaky_pair(8, seed=11)
    prompt = torch.tensor([[1, 4, 2, 5]])
    exact = _exact_joint(target, prompt, LogitsProcessorList(procs), n_tokens)
    out = draft.spec_generate(target, prompt.repeat(n, 1), max_new_tokens=n_tokens + 1, block_size=2,
                              stop_token_ids=[], do_sample=True, generator=torch.Generator().manual_seed(seed),
                              **kwargs, **options)
    index = torch.zeros(n, dtype=torch.long)
    for t in range(n_tokens):
        index = index * 8 + out[:, prompt.shape[1] + t]
    return _chi_square(torch.bincount(index, minlength=8**n_tokens), exact)


@pytest.mark.parametrize("case", list(DIST_CASES))
def test_sampled_distribution_with_processors_is_the_targets(case):
    stat, crit = _distribution(case)
    assert stat < crit, (stat, crit)


def _shifted_prefix(monkeypatch, user=False):
    """Planted bug: processors see each prefix without its last token (shifted by one). The caller's own
    processors go through ``process_rows`` (whole batch, rows in lockstep), transformers' through ``_process_at``."""
    name = "process_rows" if user else "_process_at"
    real = getattr(speculative_sampling, name)
    patch_called(monkeypatch, speculative_sampling, name,
                 lambda procs, history, ids, lengths, ext, scores: real(procs, history, ids, lengths - 1, ext, scores))


def test_negative_control_shifted_prefix_under_repetition_penalty(monkeypatch):
    _shifted_prefix(monkeypatch)
    with pytest.raises(AssertionError):
        stat, crit = _distribution("repetition_penalty")
        assert stat < crit


def test_negative_control_typical_p_missing_on_the_target(monkeypatch):
    real = speculative_sampling._Sampling.probs

    def probs(self, logits):
        if logits.shape[1] == 2:  # block-2 verify: the target's (B, 2, V); drafts are (B, 1, V)
            self = speculative_sampling._Sampling(LogitsProcessorList(
                p for p in self.procs if not isinstance(p, TypicalLogitsWarper)), True, None)
        return real(self, logits)

    patch_called(monkeypatch, speculative_sampling._Sampling, "probs", probs)
    with pytest.raises(AssertionError):  # fixed blocks: the planted bug is in the block-2 verify, run every step
        stat, crit = _distribution("typical_p", adaptive_block_size=False)
        assert stat < crit


@pytest.mark.parametrize("case", ["user_processor", "prefix_allowed_tokens_fn"])
def test_planted_shifted_prefix_fails_greedy_parity(oracle, monkeypatch, case):
    _shifted_prefix(monkeypatch, user=True)
    with pytest.raises(AssertionError):
        _check_parity(oracle, PROMPTS[:1], case, "partly")


# ----------------------------------------------------------------------------- the draft side


def _spy_proposals(monkeypatch):
    proposals = []
    real = proposers.choose_tokens

    def spy(sampling, logits, rows):
        tokens, q, probs = real(sampling, logits, rows)
        proposals.extend(tokens.flatten().tolist())
        return tokens, q, probs

    patch_called(monkeypatch, proposers, "choose_tokens", spy)
    return proposals


def test_draft_never_proposes_a_suppressed_token(monkeypatch):
    target, draft, ids = tiny_target(peaked=True), tiny_draft(block_size=6), PROMPTS[1]
    proposals = _spy_proposals(monkeypatch)
    draft.spec_generate(target, ids, max_new_tokens=40)
    x = max(set(proposals), key=proposals.count)
    proposals.clear()
    out = draft.spec_generate(target, ids, max_new_tokens=40, suppress_tokens=[x])
    assert proposals and x not in proposals
    assert torch.equal(out, _generate(ids, torch.ones_like(ids), do_sample=False, max_new_tokens=40,
                                      suppress_tokens=[x]))


def test_repetition_penalty_oracle_of_generates_output_is_fully_accepted(oracle):
    ids = PROMPTS[0]
    ref = _generate(ids, torch.ones_like(ids), do_sample=False, max_new_tokens=31, repetition_penalty=1.3)
    oracle(torch.ones_like(ids), ref, [5])
    from test_generate_parity import DRAFT, TARGET

    out = DRAFT.spec_generate(TARGET, ids, max_new_tokens=31, repetition_penalty=1.3, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.row_acceptance_lengths[0] == [6] * 5  # every block fully accepted: 1 + 5 * 6 = 31


# ----------------------------------------------------------------------------- scores, logits, result


@pytest.mark.parametrize("kwargs", [{}, {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3}])
def test_scores_and_logits_equal_generates(kwargs):
    from test_generate_parity import DRAFT, TARGET

    ids, mask = _left_pad(PROMPTS)
    common = dict(do_sample=False, max_new_tokens=12, output_scores=True, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=0, **kwargs)
    ref = _generate(ids, mask, **common)
    out = DRAFT.spec_generate(TARGET, ids, attention_mask=mask, **common)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 12 and len(out.logits) == 12
    for mine, theirs in ((out.scores, ref.scores), (out.logits, ref.logits)):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b.float(), rtol=1e-4, atol=1e-4)


def test_scores_after_a_rows_last_token_are_nan():
    from test_generate_parity import DRAFT, TARGET

    ids, mask = _left_pad(PROMPTS[:2])
    stop = int(_generate(PROMPTS[0], torch.ones_like(PROMPTS[0]), do_sample=False, max_new_tokens=4)[0, -2])
    out = DRAFT.spec_generate(TARGET, ids, attention_mask=mask, max_new_tokens=10, stop_token_ids=[stop],
                              output_scores=True, return_dict_in_generate=True)
    n = out.num_new_tokens
    assert n[0] < n[1] == 10
    assert not torch.isnan(out.scores[n[0] - 1][0]).any() and torch.isnan(out.scores[n[0]][0]).all()
    assert not torch.isnan(out.scores[-1][1]).any()


def test_result_is_a_generate_output_with_one_tau(oracle):
    from test_generate_parity import DRAFT, TARGET

    ids = PROMPTS[0]
    ref = _generate(ids, torch.ones_like(ids), do_sample=False, max_new_tokens=20)
    oracle(torch.ones_like(ids), ref, [2, 5, 0])
    out = DRAFT.spec_generate(TARGET, ids, max_new_tokens=20, return_dict_in_generate=True, output_timings=True)
    assert isinstance(out, GenerateDecoderOnlyOutput)
    cache_field = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
    assert getattr(out, cache_field).get_seq_length() == out.sequences.shape[1] - 1 and out.scores is None
    # script 2, 5, 0 -> committed 3, 6, 1, 3, 6 (19 tokens after the prefill), then the budget
    assert out.row_acceptance_lengths == [[3, 6, 1, 3, 6]]
    assert out.tau == pytest.approx(19 / 5) == sum(out.acceptance_lengths) / len(out.acceptance_lengths)
    assert out.slot_acceptance() == pytest.approx([4 / 5, 4 / 5, 2 / 5, 2 / 5, 2 / 5])
    text = repr(out)
    assert "tau" in text and "tensor(" not in text and "3.80" in text
    assert str(out.summary()) == text and "slot acceptance" in text


def test_ragged_rows_near_their_budget_are_not_overcounted(oracle):
    """Row 0 accepts everything, row 1 rejects its first block: at the last step row 0 has 1 token of
    budget left while the block is still 4 wide for row 1. Row 0 is credited 1, as when alone."""
    from test_generate_parity import DRAFT, TARGET

    ids, mask = _left_pad([PROMPTS[0], PROMPTS[1]])
    ref = _generate(ids, mask, do_sample=False, max_new_tokens=10, pad_token_id=0)
    oracle(mask, ref, lambda step, row: 0 if (row, step) == (1, 0) else 5)
    out = DRAFT.spec_generate(TARGET, ids, attention_mask=mask, max_new_tokens=10, block_size=4,
                              return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.row_acceptance_lengths == [[4, 4, 1], [1, 4, 4]]  # row 0 alone: [4, 4, 1]
    assert out.row_draft_lengths == [[3, 3, 1], [3, 3, 3]]  # row 0 could use 1 draft slot at the last step
    assert out.tau == pytest.approx(18 / 6)


# ----------------------------------------------------------------------------- the shipped pair


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32).eval()
    draft = AutoModel.from_pretrained(PAIR / "drafter", trust_remote_code=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(PAIR / "target")
    prompts = [p["prompt"] for p in json.loads((PAIR / "heldout_prompts.json").read_text())[:6]]
    return target, draft, [tok(p, return_tensors="pt", add_special_tokens=False)["input_ids"] for p in prompts]


def test_help_shows_the_full_signature_on_a_remote_code_load(pair):
    _, draft, _ = pair
    text = pydoc.render_doc(draft.spec_generate)
    for name in ("logits_processor", "stopping_criteria", "max_new_tokens", "block_size", "max_time", "Raises"):
        assert name in text, name


def test_two_threads_on_one_target_each_see_only_their_forwards(pair):
    target, draft, prompts = pair
    calls = {0: prompts[:3], 1: prompts[3:]}

    def run(ids):
        return draft.spec_generate(target, ids, max_new_tokens=24, do_sample=False, return_dict_in_generate=True)

    alone = {i: [run(ids) for ids in calls[i]] for i in calls}
    results, errors = {}, []

    def worker(i):
        try:
            results[i] = [run(ids) for ids in calls[i]]
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in calls:
        for ids, got, ref in zip(calls[i], results[i], alone[i]):
            expected = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24)
            assert torch.equal(got.sequences, expected)
            assert got.row_acceptance_lengths == ref.row_acceptance_lengths
