"""Verify what pays: how many drafted positions each step verifies, from the draft's own confidence and the
measured cost of a verified position (``spec_generate``'s default; ``adaptive_block_size=False`` turns it off).

A verify step of ``w`` drafted positions at batch width ``A`` costs ``draft + verify(w + 1)`` plain target
steps ([`StepCost`]) and commits, per row, ``1 + E_r(w)`` tokens on average, where
``E_r(w) = sum_{k<=w} prod_{j<=k} a_rj`` and ``a_rj`` is the chance that slot ``j`` is accepted once the slots
before it were: the drafter's own estimate where it has one (DSpark's confidence head,
``Proposal.acceptance``), else the draft's probability of its own token (``Proposal.token_probs``),
scaled by how each row's verified steps compare with what was predicted for it (one factor per row, from
the accept decisions only). [`VerifyPolicy`] picks the ``w`` of largest tokens per unit cost; when even the
last drafted step's curve does not beat a plain step (``w = 0``: one position, no draft pass), the next
steps run plain, with a draft step (a probe) after 1, 4, 16, 64, 64 ... plain steps to re-measure (the
draft's context keeps every committed position's features meanwhile, so drafting resumes without loss). A
call none of whose drafting steps has paid starts that series at ``PROBE_PATIENCE`` times what a probe that
fails wastes (at batch 32 on the shipped pair about 7 plain steps, not 1), and no probe runs when fewer
tokens are left than the wait it ends: what it could find would not pay back. The first step drafts the
block that would pay best if each slot were accepted with ``PRIOR_ACCEPTANCE`` (0.8), not always the whole
block. Only what is proposed changes: every committed token is still the target's own (greedy) or exactly
its distribution.

Where the cost comes from: ``verify_cost.py`` ([`verify_cost.call_cost`]): the caller's ``verify_cost``, else
``$DFLASH_VERIFY_COST``, else a cost model from the models' shapes priced by this device's constants, measured
once per device by a few raw matmuls (never a forward or a nested generation inside the call).

Sources: issue "Verify what pays"; vLLM's adaptive verification (PR #47808: per-slot survival
probabilities and a token budget from a startup cost profile); DSpark (arXiv 2607.05147) for the
confidence head's estimates.
"""

from typing import Optional

from transformers.utils import logging

try:
    from .draft_trees import first_nodes, path_probs
    from .verify_cost import COST_ENV, StepCost, as_step_cost, env_cost  # noqa: F401  (StepCost re-exported)
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from draft_trees import first_nodes, path_probs
    from verify_cost import COST_ENV, StepCost, as_step_cost, env_cost  # noqa: F401

PROBE_LIMIT = 64  # at most this many plain steps between two draft steps that re-measure the curve
PROBE_BLOCK = 4  # a probe drafts this block (at most the call's): whether drafting pays shows in its first slots
PROBE_PATIENCE = 4  # before drafting has paid once, the first probe waits this many times a probe's waste
PRIOR_ACCEPTANCE = 0.8  # the first step's block assumes each slot is accepted with this chance given the ones before

logger = logging.get_logger(__name__)


def best_width(cost: StepCost, expected: list) -> tuple:
    """``(w, rate)``: the drafted positions ``w`` in ``[0, len(expected)]`` of most tokens per unit cost, and
    that rate relative to a plain step. ``expected[k - 1]``: mean accepted drafts per row when ``k`` are
    verified (non-decreasing)."""
    best, rate = 0, 1.0 + 1e-9
    for k, e in enumerate(expected, start=1):
        r = (1.0 + e) / cost.step(k)
        if r >= rate:  # ties go to the longer block (same cost, never fewer tokens)
            best, rate = k, r
    return best, rate


class VerifyPolicy:
    """One call's verify-length policy (built per call; nothing kept between calls).

    ``plan(remaining)`` before a step (``remaining``: each row's tokens still to generate): the block to draft
    (``block_size``; 1: a plain step, no draft pass). ``cut(proposal)`` after the draft pass: the proposal cut
    to its best width. ``record(accepted)`` after the verify: accepted drafts per row (host ints).

    A batch ends with its slowest row, and finished rows leave it: the width is chosen for the row whose
    remaining tokens over its expected tokens per step is largest (the critical row), so a batch with one row
    the draft cannot follow runs plain steps rather than long blocks the others barely need.

    A chain's draft pass costs what its block holds, not what is verified: after a step that verified ``w``
    drafted positions the next one drafts a block of ``2 (w + 1)`` rounded up to a power of two (at most
    ``block_size``, at least [`PROBE_BLOCK`]), so a cut that hit the block's end doubles it; a probe drafts
    [`PROBE_BLOCK`]. Trees (``trees=True``) always draft the call's block."""

    def __init__(self, cost: StepCost, block_size: int, trees: bool = False):
        self.cost, self.block, self.trees = cost, block_size, trees
        self.width = None  # drafted positions the last drafting step verified
        self.effective = None  # last drafted step's expected tokens curve of the critical row (scaled), per width
        self.plain, self.wait = 0, None  # plain steps since the last draft step; plain steps before the next probe
        self.paid = False  # whether a drafting step of this call has paid (its curve beat a plain step)
        self.predicted, self.observed = {}, {}  # per row id: sums over verified steps (a prior of one each)
        self.chosen = None  # this step's (predicted accepted drafts per row, width), for record()
        self.remaining, self.ids = None, None

    def scale(self, row) -> float:
        """Row ``row``'s calibration: accepted drafts over predicted ones so far (both with a prior of 1)."""
        return min(4.0, max(0.25, (1 + self.observed.get(row, 0.0)) / (1 + self.predicted.get(row, 0.0))))

    def plan(self, remaining: Optional[list] = None, ids: Optional[list] = None) -> int:
        self.remaining, self.ids = remaining, ids
        if best_width(self.cost, list(range(1, self.block)))[0] == 0:  # not even a fully accepted block pays
            return 1
        if self.effective is None:
            return self._first_block()
        if best_width(self.cost, self.effective)[0] > 0:
            self.plain, self.wait, self.paid = 0, None, True
            return self._draft_block()
        if self.wait is None:
            self.wait = 1 if self.paid else self._first_wait()
        self.plain += 1
        if self.plain > self.wait and max(remaining or [1 << 40]) > self.wait:  # probe: re-measure the curve
            self.plain, self.wait = 0, min(4 * self.wait, PROBE_LIMIT)
            return self.block if self.trees else min(self.block, PROBE_BLOCK)
        return 1

    def _first_block(self) -> int:
        """The first step's block: the smallest power of two (at least [`PROBE_BLOCK`]) holding the width of
        most tokens per unit cost if every slot were accepted with [`PRIOR_ACCEPTANCE`] given the ones before
        it (no step has been seen yet). Trees draft the call's block."""
        if self.trees:
            return self.block
        prior = [sum(PRIOR_ACCEPTANCE ** j for j in range(1, k + 1)) for k in range(1, self.block)]
        width = best_width(self.cost, prior)[0]
        return min(self.block, max(PROBE_BLOCK, 1 << width.bit_length()))

    def _first_wait(self) -> int:
        """Plain steps before the first probe of a call none of whose drafting steps has paid yet: a probe
        that does not pay wastes ``step(PROBE_BLOCK - 1) - 1`` plain steps, so the first probe comes after
        [`PROBE_PATIENCE`] times that (1 for a call that drafted with profit: a dip there is likely brief)."""
        waste = self.cost.step(min(self.block, PROBE_BLOCK) - 1) - 1.0
        return max(1, min(PROBE_LIMIT, round(PROBE_PATIENCE * waste)))

    def _draft_block(self) -> int:
        if self.width is None or self.trees:
            return self.block
        return min(self.block, max(PROBE_BLOCK, 1 << (2 * self.width + 1).bit_length()))

    def _choose(self, rows: list, cap: int) -> int:
        """Best width from per-row curves ``rows[r][k - 1]`` (expected accepted drafts at width ``k``)."""
        n = max(len(r) for r in rows)
        rows = [r + r[-1:] * (n - len(r)) if r else [0.0] * n for r in rows]
        remaining = self.remaining if self.remaining and len(self.remaining) == len(rows) else [1] * len(rows)
        ids = self.ids if self.ids and len(self.ids) == len(rows) else list(range(len(rows)))
        top, scales = max(remaining), [self.scale(i) for i in ids]
        self.effective = [min((1 + min(cap or k, k, s * r[k - 1])) * top / max(left, 1)
                              for r, left, s in zip(rows, remaining, scales)) - 1 for k in range(1, n + 1)]
        width = max(1, best_width(self.cost, self.effective)[0])
        self.chosen, self.width = ([r[width - 1] for r in rows], width, ids), width
        return width

    def cut(self, proposal):
        """``proposal`` (``proposers.Proposal``, a chain) cut to its best width (at least one drafted position:
        the draft pass is paid). One host transfer of ``(A, n)``."""
        probs = proposal.acceptance if proposal.acceptance is not None else proposal.token_probs  # (A, n)
        if probs.shape[1] == 0 or proposal.tree is not None:  # a tree was cut before it was built: cut_trees
            return proposal
        rows = probs.float().clamp(0, 1).cumprod(dim=1).cumsum(dim=1).tolist()  # (A, n) expected accepted
        return proposal.cut(self._choose(rows, None))

    def cut_trees(self, trees: list) -> list:
        """Best-first trees (``draft_trees.HostTree``, one per row) cut to the node count of most tokens per
        unit cost: a tree's expected accepted depth is the sum of its nodes' path probabilities."""
        rows = []
        for t in trees:
            acc, total = [], 0.0
            for p in path_probs(t):
                total += p
                acc.append(total)
            rows.append(acc)
        width = self._choose(rows, self.block - 1)
        return [first_nodes(t, width) for t in trees]

    def record(self, accepted: list) -> None:
        if self.chosen is not None:
            predicted, width, ids = self.chosen
            for i, p, a in zip(ids, predicted, accepted):
                self.predicted[i] = self.predicted.get(i, 0.0) + p
                self.observed[i] = self.observed.get(i, 0.0) + min(a, width)
            self.chosen = None


class FixedBlocks:
    """The policy of a call without ``adaptive_block_size``: every step drafts and verifies the whole block."""

    def __init__(self, block_size: int):
        self.block = block_size

    def plan(self, remaining=None, ids=None) -> int:
        return self.block

    def cut(self, proposal):
        return proposal

    def record(self, accepted: list) -> None:
        pass


def check_adaptive(adaptive_block_size, verify_cost, tree_budget=None) -> None:
    """Refuse, before any forward, an ``adaptive_block_size`` that is not None / True / False, a
    ``verify_cost`` or ``tree_budget="auto"`` together with ``adaptive_block_size=False`` (both need the policy
    that call turns off), and
    a malformed ``verify_cost`` ([`verify_cost.as_step_cost`]) or ``$DFLASH_VERIFY_COST`` for a call that would
    read it ([`env_cost`]).

    Raises:
        ValueError: naming the value and what was expected.
        TypeError: a ``verify_cost`` that is no StepCost, mapping or object with its fields.
    """
    if adaptive_block_size is not None and not isinstance(adaptive_block_size, bool):
        raise ValueError(f"adaptive_block_size={adaptive_block_size!r} must be None (the default: the verify-length "
                         "policy wherever it applies), True or False (fixed blocks)")
    if adaptive_block_size is False and verify_cost is not None:
        raise ValueError("verify_cost prices the verify-length policy, which adaptive_block_size=False turns off: "
                         "drop one of them")
    if adaptive_block_size is False and tree_budget == "auto":
        raise ValueError("tree_budget='auto' sizes trees by the verify-length policy, which adaptive_block_size=False "
                         "turns off: pass an integer tree_budget for fixed trees, or drop adaptive_block_size=False")
    if adaptive_block_size is not False and verify_cost is not None:
        as_step_cost(verify_cost)  # a malformed verify_cost is refused here, before generate() is entered
    if adaptive_block_size is not False and verify_cost is None:
        env_cost()  # a malformed $DFLASH_VERIFY_COST is refused here, before generate() is entered


def policy_wanted(adaptive_block_size, tree_budget) -> bool:
    """Whether a dynamic-loop call runs the verify-length policy: ``adaptive_block_size`` when given (its
    checks refuse True with an integer ``tree_budget`` and False with ``"auto"``: [`check_adaptive`],
    ``draft_trees.check_tree``); None (the default) runs it wherever it applies, a chain or an ``"auto"``
    tree, while an integer ``tree_budget`` verifies its fixed tree. (The fixed-shape static loop never runs it:
    asked for explicitly there it logs once, by default it runs the fixed blocks silently.)"""
    if adaptive_block_size is None:
        return tree_budget is None or tree_budget == "auto"
    return adaptive_block_size


def policy_for(proposer, block_size: int, cost: Optional[StepCost]):
    """The call's policy: [`FixedBlocks`] (every step the whole block), or with a ``cost``
    (``adaptive_block_size`` / ``tree_budget="auto"``) a [`VerifyPolicy`] on it, which also cuts the trees
    of an ``"auto"`` tree proposer (``proposer.size_trees``)."""
    if cost is None:
        return FixedBlocks(block_size)
    policy = VerifyPolicy(cost, block_size, trees=getattr(proposer, "auto_trees", False))
    if policy.trees:
        proposer.size_trees = policy.cut_trees
    return policy


__all__ = ["COST_ENV", "FixedBlocks", "PRIOR_ACCEPTANCE", "PROBE_BLOCK", "PROBE_LIMIT", "PROBE_PATIENCE", "StepCost",
           "VerifyPolicy", "best_width", "check_adaptive", "env_cost", "policy_for", "policy_wanted"]
