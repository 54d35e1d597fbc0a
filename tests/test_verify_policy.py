"""The verify-length policy (the default, ``adaptive_block_size=True``, ``verify_policy.py``): driven by fake costs
(``verify_cost=StepCost(...)``), never by timings. Exactness with the policy on (greedy == generate on
dense, sliding-window and hybrid targets in ragged batches; the sampled joint against the target's exact
one); the three regimes (verify nothing: zero draft forwards; verify everything: the fixed block's steps;
in between: widths that follow the planted draft probabilities); the draft context kept exact across
plain steps; a chain cut per row (``Proposal.lengths``) drawing its bonus token from the target.

Planted bugs each test was shown to catch are listed in its docstring.
"""

import json

import pytest
import torch
import transformers

import generation_utils
import proposers
import speculative_sampling
import verify_cost
import verify_policy
from family_targets import family_target
from patching import patch_called
from test_families import _left_pad
from test_trees import _chi2_crit, _exact_joint, N_NEW, PENALTY, TOP_K
from tiny import VOCAB, tiny_draft, tiny_target

pytestmark = pytest.mark.quick  # the first-check subset (README "Run the tests")

StepCost = verify_policy.StepCost
CHEAP = StepCost((1, 2), (1.0, 1.0), 0.0)  # verifying more is free: the whole block every step
DEAR = StepCost((1, 2), (1.0, 50.0), 5.0)  # nothing pays, not even a fully accepted block
MIDDLE = StepCost((1, 9), (1.0, 3.0), 0.3)  # a verified position costs a quarter of a plain step
BLOCK, NEW = 8, 30
PROMPTS = [torch.randint(0, 90, (1, n), generator=torch.Generator().manual_seed(40 + n)) for n in (4, 13, 9)]


def _generate(target, ids, n):
    return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)


def install_oracle(monkeypatch, refs, seen=None, must_run=True):
    """Draft logits per row following ``refs``: the reference token at every slot, certain (logit 30) for the
    first ``(step + row) % 4 + 1`` slots and uncertain after (logit 1 against one decoy at 0.9: probability
    about 0.5, and the decoy wins at the slot after the certain ones, so acceptance stops there). Returns the
    list of the certain counts of each step's rows; ``seen`` collects ``(draft cache length, ctx positions)``."""
    real = proposers._draft_logits
    steps = []

    def fake(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id, **kw):
        if seen is not None:
            seen.append((draft_cache.get_seq_length(), ctx.positions.clone(), start.clone()))
        real(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id, **kw)
        rows, certain = [], []
        for r, (s, a) in enumerate(zip(start.tolist(), anchor[:, 0].tolist())):
            ref = next(ref for ref in refs if ref.shape[1] > s and ref[0, s] == a)
            want = torch.cat([ref[0, s + 1: s + b], torch.zeros(b, dtype=torch.long)])[: b - 1]
            k = (len(steps) + r) % 4 + 1
            logits = torch.zeros(b - 1, VOCAB)
            logits[torch.arange(b - 1), want] = 1.0
            logits[:k, :][torch.arange(min(k, b - 1)), want[:k]] = 30.0
            decoy = (want + 1) % VOCAB
            logits[torch.arange(b - 1), decoy] = torch.where(torch.arange(b - 1) == k, 2.0, 0.9)
            rows.append(logits)
            certain.append(k)
        steps.append(certain)
        return torch.stack(rows)

    if must_run:
        patch_called(monkeypatch, proposers, "_draft_logits", fake)
    else:
        monkeypatch.setattr(proposers, "_draft_logits", fake)
    return steps


def _ragged_equals_generate(target, draft, monkeypatch, cost=MIDDLE):
    refs = [_generate(target, p, NEW) for p in PROMPTS]
    steps = install_oracle(monkeypatch, refs)
    ids, mask = _left_pad(PROMPTS)
    out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=NEW, temperature=0.0,
                              block_size=BLOCK, adaptive_block_size=True, verify_cost=cost, return_dict_in_generate=True)
    assert steps, "the oracle was never consulted"
    for r, p in enumerate(PROMPTS):
        assert torch.equal(out.sequences[r, ids.shape[1]:], refs[r][0, p.shape[1]:]), ("ragged row", r)
    return out


def test_dense_ragged_policy_equals_generate_with_widths_that_follow_the_draft():
    """Widths vary between steps and, after the first step (verified whole: the policy observes it), stay below
    the block; greedy output is the target's.
    Planted bug caught: ``Proposal.cut`` keeping the uncut positions (shape error in the verify forward)."""
    mp = pytest.MonkeyPatch()
    try:
        out = _ragged_equals_generate(tiny_target(peaked=True), tiny_draft(block_size=BLOCK), mp)
    finally:
        mp.undo()
    assert all(row[0] == BLOCK - 1 for row in out.row_draft_lengths), out.row_draft_lengths
    widths = {d for row in out.row_draft_lengths for d in row[1:]}
    assert len(widths) > 1 and max(widths) < BLOCK - 1, widths


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_sliding_window_ragged_policy_equals_generate(name, monkeypatch):
    target = family_target(name)
    if target is None:
        pytest.skip(f"{name} is not in this transformers version")
    _ragged_equals_generate(target, tiny_draft(block_size=BLOCK), monkeypatch)


@pytest.mark.skipif(not hasattr(transformers, "Qwen3_5ForCausalLM"), reason="Qwen3.5 exists from transformers 5.x on")
def test_hybrid_ragged_policy_equals_generate(monkeypatch):
    from test_hybrid import hybrid_draft, tiny_hybrid

    _ragged_equals_generate(tiny_hybrid("qwen3_5"), hybrid_draft(block_size=BLOCK), monkeypatch)


def test_a_cost_where_nothing_pays_runs_plain_steps_only(monkeypatch):
    """Zero draft forwards, every step a plain one (counted in ``plain_steps``, not in tau)."""
    target, draft = tiny_target(peaked=True), tiny_draft(block_size=BLOCK)
    ids = PROMPTS[1]
    calls = install_oracle(monkeypatch, [_generate(target, ids, NEW)], must_run=False)
    out = draft.spec_generate(target, ids, max_new_tokens=NEW, temperature=0.0, adaptive_block_size=True,
                              verify_cost=DEAR, return_dict_in_generate=True)
    assert torch.equal(out.sequences, _generate(target, ids, NEW))
    assert out.num_draft_forwards == 0 and not calls
    assert out.plain_steps == NEW - 1 and out.tau is None


def test_a_cost_where_everything_pays_is_the_fixed_block(monkeypatch):
    target, draft = tiny_target(peaked=True), tiny_draft(block_size=BLOCK)
    ids = PROMPTS[0]
    install_oracle(monkeypatch, [_generate(target, ids, NEW)])
    fixed = draft.spec_generate(target, ids, max_new_tokens=NEW, temperature=0.0, return_dict_in_generate=True,
                                adaptive_block_size=False)
    policy = draft.spec_generate(target, ids, max_new_tokens=NEW, temperature=0.0, adaptive_block_size=True,
                                 verify_cost=CHEAP, return_dict_in_generate=True)
    assert torch.equal(policy.sequences, fixed.sequences)
    assert policy.row_draft_lengths == fixed.row_draft_lengths
    assert policy.row_acceptance_lengths == fixed.row_acceptance_lengths


def _cost_json(cost):
    return json.dumps({"widths": list(cost.widths), "verify": list(cost.verify), "draft": cost.draft})


def test_the_policy_is_the_default_and_false_gives_fixed_blocks(monkeypatch):
    """``adaptive_block_size`` not passed runs the policy: under a cost where nothing pays, passed as
    ``verify_cost`` or in ``$DFLASH_VERIFY_COST``, no draft forward runs; ``adaptive_block_size=False`` drafts
    every step, whatever the variable says. All equal ``generate``. Planted bugs caught: the default resolving
    to fixed blocks (a draft forward in the first two calls); the variable not read (the table is measured
    instead: ``device_speed`` must not run)."""
    target, draft = tiny_target(peaked=True), tiny_draft(block_size=BLOCK)
    ids = PROMPTS[1]
    ref = _generate(target, ids, NEW)
    monkeypatch.setattr(verify_cost, "device_speed", lambda *a, **k: pytest.fail("the device was measured"))
    by_arg = draft.spec_generate(target, ids, max_new_tokens=NEW, temperature=0.0, verify_cost=DEAR,
                                 return_dict_in_generate=True)
    monkeypatch.setenv(verify_policy.COST_ENV, _cost_json(DEAR))
    by_env = draft.spec_generate(target, ids, max_new_tokens=NEW, temperature=0.0, return_dict_in_generate=True)
    fixed = draft.spec_generate(target, ids, max_new_tokens=NEW, temperature=0.0, adaptive_block_size=False,
                                return_dict_in_generate=True)
    for out in (by_arg, by_env, fixed):
        assert torch.equal(out.sequences, ref)
    assert by_arg.num_draft_forwards == by_env.num_draft_forwards == 0 and by_env.plain_steps == NEW - 1
    assert fixed.num_draft_forwards >= 5 and {len(r) for r in fixed.row_draft_lengths} == {fixed.num_target_forwards - 1}
    assert max(fixed.row_draft_lengths[0]) == BLOCK - 1


def test_bad_policy_arguments_are_refused_before_any_forward(monkeypatch):
    """``adaptive_block_size`` other than None / True / False, ``verify_cost`` with the policy turned off, and a
    ``$DFLASH_VERIFY_COST`` that is no StepCost's JSON are refused by name; an integer ``tree_budget`` under the
    default runs its fixed tree (asked for with ``adaptive_block_size=True`` it is refused: test_trees.py)."""
    target, draft = tiny_target(), tiny_draft(block_size=BLOCK)
    ids = PROMPTS[0]
    monkeypatch.setattr(target, "forward", lambda *a, **k: pytest.fail("a forward ran"))
    with pytest.raises(ValueError, match="adaptive_block_size='yes' must be None"):
        draft.spec_generate(target, ids, max_new_tokens=4, adaptive_block_size="yes")
    with pytest.raises(ValueError, match="verify_cost.*adaptive_block_size=False"):
        draft.spec_generate(target, ids, max_new_tokens=4, adaptive_block_size=False, verify_cost=DEAR)
    for bad in ("{not json", '{"widths": [2], "verify": [1.0]}', '{"verify": [1.0]}', "[1, 2]",
                '{"widths": [1, 2], "verify": [1.0, 1.5], "darft": 1.0}'):
        monkeypatch.setenv(verify_policy.COST_ENV, bad)
        with pytest.raises(ValueError, match="DFLASH_VERIFY_COST="):
            draft.spec_generate(target, ids, max_new_tokens=4)
    monkeypatch.delenv(verify_policy.COST_ENV)
    with pytest.raises(ValueError, match="tree_budget='auto'.*adaptive_block_size=False"):
        draft.spec_generate(target, ids, max_new_tokens=4, adaptive_block_size=False, tree_budget="auto")
    with pytest.raises(ValueError, match="2 widths but 1 verify costs"):
        StepCost((1, 16), (1.0,), 0.0)
    monkeypatch.undo()
    tree = draft.spec_generate(target, ids, max_new_tokens=NEW, temperature=0.0, tree_budget=4,
                               return_dict_in_generate=True)
    assert torch.equal(tree.sequences, _generate(target, ids, NEW)) and tree.num_draft_forwards > 0


def _proposal(probs):
    probs = torch.tensor(probs)
    a, n = probs.shape
    return proposers.Proposal(torch.zeros(a, n, dtype=torch.long), torch.arange(n + 1).expand(a, -1), probs)


def _past_first(cost, block, **kw):
    """A policy past its first drafting step (which is verified whole: ``test_first_step_and_probes_are_verified_whole``),
    with nothing observed yet: its estimates are the raw confidences."""
    policy = verify_policy.VerifyPolicy(cost, block, **kw)
    policy.observe = False
    return policy


def test_the_cut_follows_the_planted_probabilities():
    """With a verified position at 0.25 of a plain step and a draft pass at 0.3: four near-certain slots
    then near-zero ones are cut after the fourth; a curve that halves from the first slot is cut early;
    the confidence head's estimates (``acceptance``) win over ``token_probs``; a batch takes its critical row
    (most remaining tokens per expected token).
    Independent check: the rate written here for every width."""
    cost = MIDDLE

    def best(curve):  # mean expected accepted drafts per width -> best width, by the formula
        rates = [(1 + e) / (cost.draft + cost.verify_cost(k + 1)) for k, e in enumerate(curve, start=1)]
        return 1 + max(range(len(rates)), key=rates.__getitem__)

    sure = [[0.99] * 4 + [0.01] * 3]
    assert _past_first(cost, 8).cut(_proposal(sure)).tokens.shape[1] == 4
    halving = [[0.5 ** (k + 1) for k in range(7)]]
    cut = _past_first(cost, 8).cut(_proposal(halving)).tokens.shape[1]
    curve = torch.tensor(halving[0]).cumprod(0).cumsum(0).tolist()
    assert cut == best(curve) < 4
    p = _proposal([[0.01] * 7])
    p.acceptance = torch.tensor([[0.99] * 6 + [0.01]])
    assert _past_first(cost, 8).cut(p).tokens.shape[1] == 6
    mixed = [[0.99] * 7, [0.6] * 7]  # equal remaining tokens: the width is the critical (slower) row's
    assert _past_first(cost, 8).cut(_proposal(mixed)).tokens.shape[1] == best(
        torch.tensor(mixed[1]).cumprod(0).cumsum(0).tolist()) < 7
    policy = _past_first(cost, 8)
    policy.plan([10, 40])  # row 0 nearly done: row 1 (40 tokens left) is the critical one even at 0.99
    mixed = [[0.6] * 7, [0.99] * 7]
    assert policy.cut(_proposal(mixed)).tokens.shape[1] == 7


def test_a_policy_that_stops_drafting_probes_again_and_resumes():
    """After a step whose curve does not pay, the next steps are plain, then a probe drafts a block of
    PROBE_BLOCK: in a call that never drafted with profit, after PROBE_PATIENCE x the probe's waste (MIDDLE:
    a probe costs 0.3 + 1 + 3 x 0.25 = 2.05 plain steps, so 4 x 1.05 -> 4), then 16 ... plain steps; once a
    step paid, after 1, 2, 4 ... (a drafter that paid once is likely to again: ``"def add(a, b):"``). A step that pays resumes drafting at once, with the block sized from the width
    it verified; no probe runs when fewer tokens are left than the wait it ends. Planted bugs caught: the
    first wait kept at 1 (plans [1, 4, ...]); the remaining tokens ignored."""
    policy = verify_policy.VerifyPolicy(MIDDLE, 8)
    assert policy.plan() == 8  # prior 0.8 per slot: best at 5 verified positions -> a block of 8
    policy.cut(_proposal([[0.01] * 7]))
    policy.record([0])
    plans = [policy.plan() for _ in range(10)]
    assert plans == [1, 1, 1, 1, 4, 1, 1, 1, 1, 1], plans  # the first probe after 4 plain steps
    assert policy.cut(_proposal([[0.99] * 3])).tokens.shape[1] == 3  # the probe's whole block pays
    policy.record([3])
    assert policy.plan() == 8  # 2 x (3 + 1): the block doubles past the cut that hit its end
    failing = 0
    while policy.plan() > 1:  # steps that accept nothing until the learned estimate no longer pays
        policy.cut(_proposal([[0.01] * 7]))
        policy.record([0])
        failing += 1
    assert 1 <= failing <= 3, failing  # a few failed steps outweigh the one that paid (Observed.fade)
    plans = [policy.plan() for _ in range(7)]
    assert plans == [4, 1, 1, 4, 1, 1, 1], plans  # drafting paid once in this call: probes after 1, then 2, 4
    policy.cut(_proposal([[0.01] * 3]))
    policy.record([0])
    wait = policy.wait  # 4 after the probes that came after 1 and 2 plain steps
    assert wait == 4 and [policy.plan(remaining=[wait]) for _ in range(12)] == [1] * 12  # too few tokens left
    assert policy.plan(remaining=[wait + 1]) == 4


def test_the_drafted_block_follows_the_width_verified():
    """A chain drafts 2 (w + 1) rounded up to a power of two after verifying w drafted positions (at least
    PROBE_BLOCK, at most the call's block); trees always draft the call's block. Planted bug caught: the
    block kept at block_size after a narrow cut (plans 16, 16, ...)."""
    blocks = []
    for width in (1, 2, 3, 4, 15):
        policy = verify_policy.VerifyPolicy(StepCost((1, 16), (1.0, 2.0)), 16)  # each position costs: cut at w
        assert policy.plan() == 8  # first step, prior 0.8: (1 + 3.16) / (1 + 7 / 15) beats every other width
        policy.observe = False  # the first step's cut as any other's (it is verified whole: a test below)
        p = _proposal([[0.99] * width + [0.001] * (15 - width)])
        policy.cut(p)
        policy.record([width])
        blocks.append(policy.plan())
    assert blocks == [4, 8, 8, 16, 16], blocks
    # the first block under other costs: free positions -> the whole block; dear ones -> PROBE_BLOCK
    assert verify_policy.VerifyPolicy(CHEAP, 16).plan() == 16
    assert verify_policy.VerifyPolicy(StepCost((1, 2, 16), (1.0, 2.0, 9.0)), 16).plan() == verify_policy.PROBE_BLOCK
    trees = _past_first(StepCost((1, 16), (1.0, 2.0)), 16, trees=True)
    trees.cut(_proposal([[0.99] + [0.001] * 14]))
    assert trees.plan() == 16


def test_the_draft_context_stays_exact_across_plain_steps(monkeypatch):
    """Every draft pass sees, in its cache and pending context, every position before its anchor exactly
    once, also after plain steps (probes between them).
    Planted bug caught: the features of plain steps dropped (``rows.ctx = None`` after a step of block 1)."""
    target, draft = tiny_target(peaked=True), tiny_draft(block_size=BLOCK)
    ids = PROMPTS[1]
    seen = []
    install_oracle(monkeypatch, [_generate(target, ids, 200)], seen)
    poor = StepCost((1, 9), (1.0, 6.0), 1.0)  # the oracle's curve rarely pays: many plain steps
    out = draft.spec_generate(target, ids, max_new_tokens=200, temperature=0.0, adaptive_block_size=True,
                              verify_cost=poor, return_dict_in_generate=True)
    assert out.plain_steps > 3 and len(seen) > 2, (out.plain_steps, len(seen))
    for cached, positions, start in seen:
        assert positions[0].tolist() == list(range(cached, int(start[0]))), (cached, positions, start)


def test_a_row_cut_short_draws_its_bonus_token_from_the_target():
    """``speculative_verify`` with ``lengths``: a row that proposes 1 of 3 drafts commits (draft, bonus) with
    the bonus drawn from ``p_1``, never from the residual; the joint of the two committed tokens is
    ``P(draft accepted) p_1`` plus the residual path: checked by chi-square against the formula.
    Planted bug caught: the residual ``max(p_1 - q_1, 0)`` used at the row's end."""
    v, n_rows = 4, 40000
    gen = torch.Generator().manual_seed(3)
    q = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1], [0.25] * 4])
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.3, 0.3, 0.3, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25] * 4])
    drafts = torch.multinomial(q, n_rows, replacement=True, generator=gen).T  # (n_rows, 3)
    accepted, nxt = speculative_sampling.speculative_verify(
        drafts, q.expand(n_rows, -1, -1), p.expand(n_rows, -1, -1), gen, lengths=torch.ones(n_rows, dtype=torch.long))
    assert int(accepted.max()) <= 1
    first = torch.where(accepted == 1, drafts[:, 0], nxt)
    second = torch.where(accepted == 1, nxt, -1)
    counts = {}
    for a, b in zip(first.tolist(), second.tolist()):
        counts[a, b] = counts.get((a, b), 0) + 1
    expect = {}
    for x in range(v):
        keep = q[0, x] * min(1.0, float(p[0, x] / q[0, x]))
        for y in range(v):
            expect[x, y] = float(keep * p[1, y])  # accepted, then the bonus from p_1
    residual = (p[0] - q[0]).clamp_min(0)
    residual = residual / residual.sum()
    rejected = 1 - sum(float(q[0, x] * min(1.0, float(p[0, x] / q[0, x]))) for x in range(v))
    for x in range(v):
        expect[x, -1] = rejected * float(residual[x])
    cells = [c for c in expect if expect[c] * n_rows >= 5]
    stat = sum((counts.get(c, 0) - n_rows * expect[c]) ** 2 / (n_rows * expect[c]) for c in cells)
    assert stat < _chi2_crit(len(cells) - 1), stat


def test_sampled_output_with_the_policy_on_has_the_targets_distribution(monkeypatch):
    """Chi-square of the joint of 4 new tokens (repetition penalty and top-k: every slot's distribution
    depends on its prefix) with the policy cutting the chain at varying widths."""
    target = tiny_target(peaked=True, seed=4)
    prompt = [3, 17, 42, 8, 61]
    joint, reach = _exact_joint(target, prompt)

    def fake(draft, embed, head, anchor, ctx, draft_cache, draft_valid, start, b, mask_token_id, **kw):
        logits = torch.zeros(anchor.shape[0], b - 1, VOCAB)
        for j in range(b - 1):
            logits[:, j, sorted(reach[j + 1]) if j + 1 < N_NEW else []] = 10.0
        return logits

    patch_called(monkeypatch, proposers, "_draft_logits", fake)
    draft = tiny_draft(block_size=4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([prompt] * 600)
    counts, widths = {}, set()
    for _ in range(5):
        out = draft.spec_generate(target, ids, max_new_tokens=N_NEW, do_sample=True, temperature=1.0, top_k=TOP_K,
                                  repetition_penalty=PENALTY, adaptive_block_size=True, verify_cost=MIDDLE,
                                  generator=gen, return_dict_in_generate=True)
        widths |= {d for row in out.row_draft_lengths for d in row}
        for row in out.sequences[:, len(prompt):].tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert widths - {0}, widths
    n = 3000
    assert not set(counts) - set(joint)
    big = [c for c in joint if joint[c] * n >= 5]
    stat = sum((counts.get(c, 0) - n * joint[c]) ** 2 / (n * joint[c]) for c in big)
    assert stat < _chi2_crit(len(big)), stat


def test_seeded_sampling_with_the_policy_is_reproducible(monkeypatch):
    target, draft = tiny_target(peaked=True), tiny_draft(block_size=BLOCK)
    ids = PROMPTS[2]
    outs = [draft.spec_generate(target, ids, max_new_tokens=20, do_sample=True, temperature=0.8,
                                adaptive_block_size=True, generator=torch.Generator().manual_seed(7))
            for _ in range(2)]
    assert torch.equal(*outs)


def test_the_default_cost_is_modelled_and_a_bad_verify_cost_is_refused_before_any_forward(tmp_path, monkeypatch):
    """Without ``verify_cost`` the default prices steps with the cost model on this device's constants
    (``verify_cost.py``; its own rules: tests/test_verify_cost.py): the constants land in ``device_speed.json``,
    no table file is written, the output equals ``generate``; a ``verify_cost`` that is no StepCost, mapping or
    object with its fields is refused by name before any forward. Planted bugs caught: call_cost measuring
    nothing (no file); as_step_cost not called by the argument checks (the forward runs first)."""
    monkeypatch.setenv("DFLASH_HF_CACHE", str(tmp_path))
    monkeypatch.delenv(verify_policy.COST_ENV, raising=False)  # conftest pins none; a value from the shell would hide the model
    monkeypatch.setattr(verify_cost, "_SPEEDS", {})
    target, draft = tiny_target(), tiny_draft(block_size=BLOCK)
    ids = PROMPTS[0]
    out = draft.spec_generate(target, ids, max_new_tokens=12, temperature=0.0, adaptive_block_size=True)
    assert torch.equal(out, _generate(target, ids, 12))
    assert (tmp_path / "device_speed.json").exists() and not (tmp_path / "verify_costs.json").exists()
    monkeypatch.setattr(target, "forward", lambda *a, **k: pytest.fail("a forward ran"))
    with pytest.raises(ValueError, match="verify_cost=.*missing keys"):
        draft.spec_generate(target, ids, max_new_tokens=4, adaptive_block_size=True, verify_cost={"draft": 1})
    with pytest.raises(TypeError, match="verify_cost=3"):
        draft.spec_generate(target, ids, max_new_tokens=4, verify_cost=3)
    with pytest.raises(ValueError, match="StepCost"):
        StepCost((2, 4), (1.0, 2.0), 0.1)


def test_auto_tree_budget_sizes_trees_and_keeps_the_output(monkeypatch):
    """``tree_budget="auto"``: best-first trees of up to ``AUTO_TREE_BUDGET`` nodes cut by the policy to the
    node count its cost and the nodes' path probabilities choose; greedy output equal to generate (batch 1
    and ragged)."""
    import test_trees

    target, draft = tiny_target(peaked=True), tiny_draft(block_size=test_trees.BLOCK)
    prompts = [test_trees.PROMPTS[n] for n in test_trees.LENS]
    refs = [test_trees._generate(target, p, test_trees.NEW) for p in prompts]
    sizes = []
    real = verify_policy.VerifyPolicy.cut_trees
    def cut_trees(self, trees):
        out = real(self, trees)
        sizes.append(max(t.size for t in out))
        return out

    monkeypatch.setattr(verify_policy.VerifyPolicy, "cut_trees", cut_trees)
    cost = StepCost((1, 33), (1.0, 3.0), 0.3)
    for p, ref in zip(prompts, refs):
        with pytest.MonkeyPatch.context() as mp:
            test_trees.install_oracle(mp, [ref])  # ranks the target's token below the top at some depth
            out = draft.spec_generate(target, p, max_new_tokens=test_trees.NEW, temperature=0.0, tree_budget="auto",
                                      verify_cost=cost, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
    assert sizes and 1 < max(sizes) < proposers.AUTO_TREE_BUDGET and len(set(sizes)) > 1, sizes
    with pytest.raises(ValueError, match="tree_budget"):
        draft.spec_generate(target, prompts[0], tree_budget="big")
