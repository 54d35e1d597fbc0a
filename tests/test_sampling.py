"""Exact speculative sampling: the acceptance rule alone, then the output distribution.

Distribution tests: the exact target distribution of the first generated tokens is enumerated
(every prefix through the target, with transformers' own warpers), spec_generate draws many
samples in one batched call (block size 2, so later tokens cross a verify step and a rollback), and
a chi-square test compares. Cells expecting fewer than 5 samples are pooled; any sample in a
zero-probability cell fails outright. Each test rejects at alpha = 1e-6 (z = 4.753, Wilson-Hilferty
quantile), so the chance that any of the ~10 tests here fails on a correct implementation is
about 1e-5. Negative controls plant known bugs and require the same test to reject them.
"""

import math

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import speculative_sampling
from generation_utils import speculative_verify
from patching import patch_called
from tiny import tiny_draft, tiny_target

pytestmark = pytest.mark.quick  # the first-check subset (README "Run the tests")

Z_ALPHA = 4.753  # one-sided normal quantile for alpha = 1e-6


# ----------------------------------------------------------------------------- the rule alone


def _probs(logits):
    return torch.softmax(torch.tensor(logits, dtype=torch.float32), dim=-1)


NEG = float("-inf")


def test_certain_accept_and_certain_reject():
    # vocab 8; draft proposes token 2 then 5. p puts all mass on 2, then all mass on 6.
    q = _probs([[NEG, NEG, 10, NEG, NEG, NEG, NEG, NEG], [NEG, NEG, NEG, NEG, NEG, 10, NEG, NEG]])[None]
    p = _probs([[NEG, NEG, 10, NEG, NEG, NEG, NEG, NEG], [NEG] * 6 + [10, NEG], [10] + [NEG] * 7])[None]
    drafts = torch.tensor([[2, 5]])
    for seed in range(20):
        accepted, nxt = speculative_verify(drafts, q, p, torch.Generator().manual_seed(seed))
        assert accepted.tolist() == [1] and nxt.tolist() == [6]  # residual max(p - q, 0) is all on 6


def test_all_accepted_gives_bonus_from_last_target_distribution():
    q = _probs([[10, NEG, NEG, NEG, NEG, NEG, NEG, NEG]] * 2)[None]
    p = _probs([[10, NEG, NEG, NEG, NEG, NEG, NEG, NEG]] * 2 + [[NEG, NEG, NEG, 10, NEG, NEG, NEG, NEG]])[None]
    accepted, nxt = speculative_verify(torch.tensor([[0, 0]]), q, p, torch.Generator().manual_seed(0))
    assert accepted.tolist() == [2] and nxt.tolist() == [3]


def test_q_equal_p_is_always_accepted():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(64, 4, 8, generator=g), -1)
    drafts = torch.multinomial(p[:, :3].reshape(-1, 8), 1, generator=g).view(64, 3)
    accepted, _ = speculative_verify(drafts, p[:, :3], p, g)
    assert (accepted == 3).all()


def test_rejection_rate_is_total_variation():
    """P(accept) = sum_x min(p, q) = 1 - TV(p, q) for a single draft slot."""
    g = torch.Generator().manual_seed(1)
    p, q = _probs([0.0, 1.0, 2.0, 0.5]), _probs([2.0, 0.0, 0.0, 1.0])
    n = 20000
    drafts = torch.multinomial(q.expand(n, 4), 1, generator=g)
    accepted, nxt = speculative_verify(drafts, q.expand(n, 1, 4), torch.stack([p, p])[None].expand(n, 2, 4), g)
    rate = torch.minimum(p, q).sum().item()
    assert abs(accepted.float().mean().item() - rate) < 5 * math.sqrt(rate * (1 - rate) / n)
    # and the committed token (draft if accepted, else residual) is distributed as p
    first = torch.where(accepted == 1, drafts[:, 0], nxt)
    counts = torch.bincount(first, minlength=4).float()
    stat, crit = _chi_square(counts, p)
    assert stat < crit


# ----------------------------------------------------------------------------- distributions


def _chi_square(counts, probs):
    """(statistic, critical value at alpha=1e-6) with cells expecting < 5 pooled; fails on impossible cells."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    impossible = counts[probs <= 0].sum().item()
    assert impossible == 0, f"{impossible} samples fell in zero-probability cells"
    expected = probs * counts.sum()
    big = expected >= 5
    stat = ((counts[big] - expected[big]) ** 2 / expected[big]).sum().item()
    cells = int(big.sum())
    small_e = expected[~big & (probs > 0)].sum().item()
    if small_e > 0:
        small_c = counts[~big & (probs > 0)].sum().item()
        stat += (small_c - small_e) ** 2 / small_e
        cells += 1
    df = max(cells - 1, 1)
    crit = df * (1 - 2 / (9 * df) + Z_ALPHA * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


def _peaky_pair(vocab, seed):
    """A tiny target and draft whose distributions are far from uniform (and from each other)."""
    overrides = dict(vocab_size=vocab, hidden_size=16, intermediate_size=24, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=8)
    target = tiny_target(seed=seed, **overrides)
    with torch.no_grad():
        target.lm_head.weight.mul_(12.0)
    draft = tiny_draft(seed=seed + 1, mask_token_id=vocab - 1, block_size=2, **{
        k: v for k, v in overrides.items() if k != "vocab_size"}, vocab_size=vocab)
    return target, draft


def _exact_joint(target, prompt, warpers, n_tokens):
    """Exact probabilities ``(V,) * n_tokens`` of the first n generated tokens, by enumeration."""
    vocab = target.config.vocab_size
    joint = torch.ones(1, dtype=torch.float64)
    prefixes = prompt
    with torch.no_grad():
        for _ in range(n_tokens):
            logits = target(prefixes).logits[:, -1].float()
            probs = torch.softmax(warpers(None, logits), dim=-1).double()  # (P, V)
            joint = (joint[:, None] * probs).reshape(-1)
            prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0),
                                  torch.arange(vocab).repeat(prefixes.shape[0])[:, None]], dim=1)
    return joint


def _sampled_counts(draft, target, prompt, n, n_tokens, seed, **kwargs):
    # one token more than counted, so that even the last counted token comes out of a verify step
    out = draft.spec_generate(target, prompt.repeat(n, 1), max_new_tokens=n_tokens + 1, block_size=2,
                              stop_token_ids=[], generator=torch.Generator().manual_seed(seed), do_sample=True,
                              **kwargs)
    vocab = target.config.vocab_size
    index = torch.zeros(n, dtype=torch.long)
    for t in range(n_tokens):
        index = index * vocab + out[:, prompt.shape[1] + t]
    return torch.bincount(index, minlength=vocab**n_tokens)


CASES = {
    # name: (vocab, n_tokens, spec_generate kwargs, the warpers generate() applies for them)
    "temperature": (8, 3, dict(temperature=0.8, top_k=0),
                    [TemperatureLogitsWarper(0.8)]),
    "top_k": (8, 3, dict(temperature=1.0, top_k=3), [TopKLogitsWarper(3)]),
    "top_p": (8, 3, dict(temperature=1.2, top_k=0, top_p=0.8),
              [TemperatureLogitsWarper(1.2), TopPLogitsWarper(0.8)]),
    # vocab > 50: generate's own default top_k=50 must apply when sampling with top_k unset
    "default_top_k_vocab_60": (60, 2, dict(), [TopKLogitsWarper(50)]),
}


def _distribution_test(case, sample_draft, seed=0, **options):
    vocab, n_tokens, kwargs, warpers = CASES[case]
    n = 20000 if vocab > 50 else 6000
    target, draft = _peaky_pair(vocab, seed=11)
    # the target's generation_config is left as built: generate's default top_k=50 applies (on 4.57 an
    # explicit top_k=None there would switch top-k off, in generate and so in spec_generate)
    prompt = torch.tensor([[1, 4, 2, 5]])
    exact = _exact_joint(target, prompt, LogitsProcessorList(warpers), n_tokens)
    counts = _sampled_counts(draft, target, prompt, n, n_tokens, seed, sample_draft=sample_draft, **kwargs, **options)
    return _chi_square(counts, exact)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sample_draft", [True, False])
def test_output_distribution_is_the_targets(case, sample_draft):
    stat, crit = _distribution_test(case, sample_draft)
    assert stat < crit, (stat, crit)


def test_negative_control_residual_from_p_is_detected(monkeypatch):
    real = speculative_sampling.speculative_verify

    def buggy_verify(draft_tokens, draft_probs, target_probs, generator=None):
        accepted, nxt = real(draft_tokens, draft_probs, target_probs, generator)
        rows = torch.arange(len(draft_tokens))
        from_p = torch.multinomial(target_probs[rows, accepted], 1, generator=generator)[:, 0]
        return accepted, torch.where(accepted < draft_tokens.shape[1], from_p, nxt)

    patch_called(monkeypatch, speculative_sampling, "speculative_verify", buggy_verify)
    with pytest.raises(AssertionError):  # fixed blocks: the planted residual shows only where drafts are rejected
        stat, crit = _distribution_test("temperature", sample_draft=True, adaptive_block_size=False)
        assert stat < crit


def test_negative_control_top_p_on_the_draft_only_is_detected(monkeypatch):
    real_probs = speculative_sampling._Sampling.probs
    calls = {"n": 0}

    def probs_without_top_p_for_target(self, logits):
        if logits.shape[1] == 2:  # the block-2 verify: target logits (B, 2, V); drafts are (B, 1, V)
            warpers = LogitsProcessorList(w for w in self.procs if not isinstance(w, TopPLogitsWarper))
            b, n, v = logits.shape
            return torch.softmax(warpers(None, logits.reshape(b * n, v).float()), -1).view(b, n, v)
        calls["n"] += 1
        return real_probs(self, logits)

    patch_called(monkeypatch, speculative_sampling._Sampling, "probs", probs_without_top_p_for_target)
    with pytest.raises(AssertionError):  # fixed blocks: the planted bug is in the block-2 verify, run every step
        stat, crit = _distribution_test("top_p", sample_draft=True, adaptive_block_size=False)
        assert stat < crit
    assert calls["n"] > 0


def test_sampled_and_greedy_drafts_both_draw_from_the_target_with_different_acceptance():
    target, draft = _peaky_pair(8, seed=11)
    prompt = torch.tensor([[1, 4, 2, 5]]).repeat(500, 1)
    taus = {}
    for sample_draft in (True, False):
        # fixed blocks: the two drafts' acceptance differs only where every step drafts (the policy may not draft)
        out = draft.spec_generate(target, prompt, max_new_tokens=8, block_size=2, do_sample=True, top_k=0,
                                  stop_token_ids=[], sample_draft=sample_draft, adaptive_block_size=False,
                                  generator=torch.Generator().manual_seed(0), return_dict_in_generate=True)
        taus[sample_draft] = sum(out.acceptance_lengths) / len(out.acceptance_lengths)
    assert all(1.0 <= t <= 2.0 for t in taus.values()) and taus[True] != taus[False]
