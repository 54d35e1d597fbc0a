"""The lean decode step: host synchronisations per step, the adaptive block size, inference mode.

Output exactness of the lean loop is also covered by test_spec_generate.py / test_sampling.py (greedy
equality, ragged batches, stops, the sampled distribution), which run through the same loop.
"""


import collections

import pytest
import torch

import decode_step
import generation_utils
import proposers
from patching import patch_called
from test_dflash2_generate import dflash2_draft
from tiny import HIDDEN, VOCAB, tiny_draft, tiny_target

pytestmark = pytest.mark.quick  # the first-check subset (README "Run the tests")

SYNC_METHODS = ["item", "tolist", "__bool__", "__int__", "__index__", "__float__", "cpu", "numpy"]



@pytest.fixture
def sync_counter(monkeypatch):
    """Counts every Tensor -> host conversion (each is a device synchronisation on CUDA)."""
    counts = collections.Counter()
    for name in SYNC_METHODS:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


@pytest.mark.parametrize("adaptive, per_draft", [(False, 0), (None, 1)])
def test_batch_1_unpadded_step_syncs_only_for_the_acceptance_decision(sync_counter, adaptive, per_draft):
    """Default config (greedy, eos only; no stop strings, processors or streamer): with fixed blocks every
    extra verify step costs exactly one host transfer, the one that carries the accepted count and tokens;
    the default verify-length policy adds one to each step that drafts, its cut (the draft's probabilities,
    read before the verify), and none to a plain step (no draft pass, nothing to cut)."""
    target, draft = tiny_target(peaked=True), tiny_draft(block_size=8)
    target.generation_config.eos_token_id = VOCAB - 2  # a stop token that the check on the host must see
    ids = torch.randint(0, VOCAB - 3, (1, 7), generator=torch.Generator().manual_seed(0))
    runs = []
    for max_new in (12, 40):
        sync_counter.clear()
        out = draft.spec_generate(target, ids, max_new_tokens=max_new, return_dict_in_generate=True,
                                  adaptive_block_size=adaptive)
        drafting = sum(d > 0 for d in out.row_draft_lengths[0])
        runs.append((len(out.acceptance_lengths), drafting, sum(sync_counter.values()), dict(sync_counter)))
    (steps_a, drafting_a, syncs_a, _), (steps_b, drafting_b, syncs_b, detail) = runs
    assert steps_b - steps_a >= 10, runs  # enough steps to see a per-step cost
    assert syncs_b - syncs_a == (steps_b - steps_a) + per_draft * (drafting_b - drafting_a), runs


def test_a_batch_with_holes_keeps_its_masks_and_stays_exact():
    """Rows of different lengths (left padding) still take the masked path and match their batch-1 runs."""
    target, draft = tiny_target(peaked=True), tiny_draft(block_size=8)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, VOCAB - 1, (1, 9), generator=g), torch.randint(0, VOCAB - 1, (1, 4), generator=g)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], 1)])
    mask = torch.cat([torch.ones(1, 9), torch.cat([torch.zeros(1, 5), torch.ones(1, 4)], 1)]).long()
    out = draft.spec_generate(target, batch, attention_mask=mask, max_new_tokens=20, temperature=0.0)
    for row, ids in enumerate((a, b)):
        alone = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
        assert out[row, 9:].tolist() == alone[0, ids.shape[1]:].tolist()


def test_equal_length_batch_masks_from_the_first_step_rows_diverge(monkeypatch, sync_counter):
    """Two unpadded rows of one length start without masks (``_Rows.masked`` False: nothing to check on the
    device); when one row accepts its drafts and the other none, the other's rejected slots must be masked
    from then on (host bookkeeping), and each row still equals its own ``generate``. One host transfer per
    step. Planted bug: never setting ``masked`` after the prefill breaks row 1 (it attends its rejected drafts)."""
    target, draft = tiny_target(peaked=True), tiny_draft(block_size=6)
    target.generation_config.eos_token_id = None
    ids = torch.randint(0, VOCAB - 1, (2, 7), generator=torch.Generator().manual_seed(5))
    refs = [target.generate(ids[r: r + 1], attention_mask=torch.ones(1, 7, dtype=torch.long), max_new_tokens=30,
                            do_sample=False)[0] for r in range(2)]
    real, own = proposers._draft_logits, [0]

    def fake(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id):
        real(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id)
        before = sum(sync_counter.values())
        rows = [0, 1] if anchor.shape[0] == 2 else [1]  # row 0 (always right) finishes first
        want = torch.stack([refs[r][int(s) + 1: int(s) + b] for r, s in zip(rows, start)])
        if rows[-1] == 1:
            want[-1] = (want[-1] + 1) % VOCAB  # row 1: every draft wrong
        own[0] += sum(sync_counter.values()) - before  # this fake's own reads are not the loop's
        return torch.nn.functional.one_hot(want, VOCAB).float() * 30

    patch_called(monkeypatch, proposers, "_draft_logits", fake)
    runs = []
    for new in (10, 18):
        sync_counter.clear()
        own[0] = 0
        out = draft.spec_generate(target, ids, max_new_tokens=new, temperature=0.0, return_dict_in_generate=True,
                                  adaptive_block_size=False)  # the fixed step's transfers (the policy adds its cut)
        runs.append((out.num_target_forwards, sum(sync_counter.values()) - own[0]))
        for r in range(2):
            assert out.sequences[r, 7:].tolist() == refs[r][7: 7 + new].tolist(), (new, r)
    assert max(out.row_acceptance_lengths[0]) > 1 and max(out.row_acceptance_lengths[1]) == 1  # rows diverged
    (steps_a, syncs_a), (steps_b, syncs_b) = runs
    assert steps_b - steps_a >= 6 and syncs_b - syncs_a == steps_b - steps_a, runs  # one host transfer per step


# ----------------------------------------------------------------------------- adaptive block size


@pytest.fixture
def scripted_draft(monkeypatch):
    """Draft logits right for a scripted number of slots per step (batch 1), wrong after; records b."""

    def install(reference, script):
        sizes = []
        real = proposers._draft_logits

        def fake(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id):
            real(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id)
            s, right = int(start[0]), script[len(sizes) % len(script)]
            sizes.append(b)
            want = reference[0, s + 1 : s + b].clone()
            want[right:] = (want[right:] + 1) % VOCAB
            return torch.nn.functional.one_hot(want, VOCAB).float()[None] * 30

        patch_called(monkeypatch, proposers, "_draft_logits", fake)
        return sizes

    return install


def test_adaptive_block_size_follows_acceptance_and_keeps_the_output(scripted_draft):
    """The verify-length policy (``verify_policy.py``) on a fake cost: the first step drafts the block the
    prior acceptance (0.8 per slot) pays best at (7 drafts: (1 + 3.16) / (0.5 + 1 + 3 x 7 / 15) beats every
    other width), the verified widths follow the calibration of the scripted acceptance (certain drafts that
    miss are cut once calibrated), the output is generate's."""
    import verify_policy

    target, draft = tiny_target(peaked=True), tiny_draft(block_size=16)
    ids = torch.randint(0, VOCAB - 1, (1, 6), generator=torch.Generator().manual_seed(5))
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=80, do_sample=False)
    sizes = scripted_draft(ref, [15, 15, 1, 0, 0, 15, 15])
    cost = verify_policy.StepCost((1, 16), (1.0, 4.0), 0.5)
    out = draft.spec_generate(target, ids, max_new_tokens=60, temperature=0.0, adaptive_block_size=True,
                              verify_cost=cost, return_dict_in_generate=True)
    assert out.sequences.tolist() == ref[:, : 6 + 60].tolist()
    assert set(sizes) == {16} or max(sizes) == 16, sizes
    widths = [d for d in out.row_draft_lengths[0] if d]
    assert widths[:2] == [7, 15] and min(widths[2:]) < 15, widths  # over-confident drafts cut once calibrated
    fixed = draft.spec_generate(target, ids, max_new_tokens=60, temperature=0.0, return_dict_in_generate=True)
    assert fixed.sequences.tolist() == out.sequences.tolist()


def test_adaptive_block_size_ragged_batch_with_stop_matches_plain_run():
    target, draft = tiny_target(peaked=True), tiny_draft(block_size=8)
    g = torch.Generator().manual_seed(9)
    batch = torch.randint(0, VOCAB - 1, (3, 6), generator=g)
    mask = torch.ones_like(batch)
    mask[1, :2] = 0
    plain = draft.spec_generate(target, batch, attention_mask=mask, max_new_tokens=30, temperature=0.0)
    stop = int(plain[0, 6 + 10])  # a token row 0 emits: that row stops early
    kw = dict(attention_mask=mask, max_new_tokens=30, temperature=0.0, stop_token_ids=[stop])
    assert torch.equal(draft.spec_generate(target, batch, adaptive_block_size=True, **kw),
                       draft.spec_generate(target, batch, **kw))


# ----------------------------------------------------------------------------- inference mode


def test_inference_mode_default_and_opt_out_give_the_same_ordinary_tensors():
    target, draft = tiny_target(peaked=True), tiny_draft(block_size=4)
    ids = torch.randint(0, VOCAB - 1, (1, 5), generator=torch.Generator().manual_seed(1))
    lean = draft.spec_generate(target, ids, max_new_tokens=16, temperature=0.0)
    plain = draft.spec_generate(target, ids, max_new_tokens=16, temperature=0.0, inference_mode=False)
    assert torch.equal(lean, plain)
    assert not lean.is_inference()  # usable with autograd afterwards, like generate()'s output
    target(lean).logits.sum().backward()  # would raise on an inference tensor


def test_forward_runs_under_inference_mode_unless_opted_out():
    target, draft = tiny_target(), tiny_draft(block_size=4)
    seen = []
    handle = target.register_forward_hook(lambda m, a, o: seen.append(torch.is_inference_mode_enabled()))
    try:
        ids = torch.tensor([[1, 2, 3]])
        draft.spec_generate(target, ids, max_new_tokens=4, temperature=0.0)
        draft.spec_generate(target, ids, max_new_tokens=4, temperature=0.0, inference_mode=False)
    finally:
        handle.remove()
    n = len(seen) // 2
    assert seen[:n] == [True] * n and seen[n:] == [False] * n


# ----------------------------------------------------------------------------- adaptive block size at block_size=1 (issue 34, item 2)


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "static"])
def test_adaptive_block_size_with_block_size_1_equals_generate(kind, monkeypatch):
    """Planted bug caught (issue 34, item 2): with the lower bound 2 winning over ``block_size=1``, the
    second step drafted a 2-token block verified with one position offset; with oracle drafts (always
    accepted) 4+ new tokens raised (here ``AssertionError: draft context covers 2 positions, the target
    cache 17``; ``RuntimeError: The size of tensor a ...`` on the shipped pair). Now every block stays at
    1: no draft pass runs at all, and the output is generate's. Also for a DFlash 2 drafter (zero slot
    states: the walk takes the oracle's argmax) and with ``cache_implementation="static"`` (adaptive falls
    back to the dynamic loop)."""
    target, draft = tiny_target(peaked=True), (dflash2_draft if kind == "dflash2" else tiny_draft)(block_size=4)
    extra = {"cache_implementation": "static"} if kind == "static" else {}
    ids = torch.randint(0, VOCAB - 1, (1, 6), generator=torch.Generator().manual_seed(5))
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    sizes = []

    def oracle(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id, **kwargs):
        s = int(start[0])
        sizes.append(b)
        want = torch.cat([ref[0, s + 1: s + b], torch.zeros(b, dtype=torch.long)])[: b - 1]
        logits = torch.nn.functional.one_hot(want, VOCAB).float()[None] * 30
        return (logits, torch.zeros(1, b - 1, HIDDEN)) if kwargs.get("slot_states") else logits

    monkeypatch.setattr(proposers, "_draft_logits", oracle)  # plain setattr: it must NOT be called
    out = draft.spec_generate(target, ids, max_new_tokens=12, temperature=0.0, block_size=1,
                              adaptive_block_size=True, return_dict_in_generate=True, **extra)
    assert out.sequences.tolist() == ref.tolist()
    assert sizes == [] and set(out.acceptance_lengths) == {1}, (sizes, out.acceptance_lengths)
