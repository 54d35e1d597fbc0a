"""Verify what pays: how many drafted positions each step verifies, from the draft's own confidence, what the call
has seen its drafts do, and the modelled cost of a verified position (``spec_generate``'s default;
``adaptive_block_size=False`` turns it off).

A verify step of ``w`` drafted positions at batch width ``A`` costs ``draft + verify(w + 1)`` plain target
steps ([`StepCost`]) and commits, per row, ``1 + E_r(w)`` tokens on average, where
``E_r(w) = sum_{k<=w} prod_{j<=k} a_rj`` and ``a_rj`` is the chance that slot ``j`` is accepted once the slots
before it were. [`VerifyPolicy`] picks the ``w`` of most tokens per unit cost for the batch's critical row;
when even the last drafted step's curve does not beat a plain step, the next steps run plain (no draft
pass), with a probe after 1, 2, 4, ... 64, 64 plain steps in a call that has planned a drafting step from its
estimates (a drafter that paid once is likely to again: ``"def add(a, b):"`` commits 2.72 tokens per step with
these waits, 2.17 with round 4's 1, 4, 16, 64), else after ``PROBE_PATIENCE`` times a failed probe's waste, then 4
times longer each time; none when fewer tokens are left than the wait. The
draft's context keeps every committed position's features meanwhile, so drafting resumes without loss.

**The estimate** ``a_rj`` ([`Observed`]): the slot's confidence (``Proposal.confidence``, or the drafter's own
estimate where it has one: DSpark's confidence head, ``Proposal.acceptance``) is a prior worth half a trial;
every verified slot of the call is a trial (accepted, or the first rejected) counted in its confidence bin,
for the call and for its row, so the estimate follows what the drafter really gets accepted: flat but right
distributions are believed after a few steps, confident wrong ones doubted. The call's first drafting step
and every probe verify their whole block (a fixed schedule), so the estimate sees evidence the cut alone
would never buy.

**Exact by construction.** Speculative sampling commits exactly the target's distribution whatever number of
drafted positions a step verifies, provided that number is a *stopping rule*: the decision to verify slot
``k`` may read the committed prefix, the drafts before ``k``, distributions that do not depend on slot ``k``'s
draw, earlier steps' verify results and randomness independent of the draws; never ``x_k`` or anything
computed from it (notes section 11: with ``p = (0.5, 0.5)``, ``q = (0.55, 0.45)``, verifying only when the
favoured token was drawn makes it come out with probability 0.725). Slot ``k`` verified, its draft passes the
ratio test ``min(1, p / q)`` or is replaced from the residual, which together draw from ``p`` given the prefix;
cut before ``k``, the bonus token is drawn from ``p`` directly; when the choice between them is independent
of ``x_k`` given everything before it, each committed token is drawn from ``p`` given its prefix in both cases.
The cut reads:

- DFlash 1 with prefix-free processors (``speculative_sampling.prefix_free``): every slot's ``q`` comes from
  one parallel pass before any draw, so the cut may read all of them; under random draws it reads each
  slot's largest probability ``max q`` (``proposers.slot_confidence``), never the drawn token's ``q(x_k)``.
- Walks (DFlash 2's selector walk, DSpark's Markov walk, DFlash 1 with a processor that reads the prefix:
  ``Proposal.walk``): slot ``k``'s ``q`` is computed from the draws before it, so slot ``k`` is decided from
  slots ``1..k`` and depth estimates learned in earlier steps ([`Observed.ahead`]), never from this step's
  later slots ([`VerifyPolicy._width`]). DSpark's confidence at slot ``k`` reads ``x_{k-1}``, not ``x_k``: its
  ``confidence_threshold`` cut and the policy's reading of it are stopping rules too.
- ``tree_budget="auto"``: trees are built from the raw draft logits before the target's draws and committed by
  sample-and-match, exact for any tree fixed before those draws; the cut reads path probabilities only.
- Greedy and ``sample_draft=False`` (argmax proposals): nothing random is drafted, so any cut is exact; the
  cut reads the chosen tokens' own probabilities and looks ahead.
- The estimates learn from earlier steps' accept decisions only; a seeded call's widths depend only on the
  seed, the committed tokens, the draft's distributions and the cost, which is fixed before the first forward.

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
BINS = 10  # Observed: trials are counted per confidence bin of width 1 / BINS
PRIOR_WEIGHT = 0.5  # Observed: a slot's raw confidence counts as this many trials of its bin
ROW_WEIGHT = 4.0  # Observed: the call's estimate counts as this many trials against a row's own
DECAY = 0.8  # Observed: at each drafting step, earlier trials weigh this much less

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


class Observed:
    """What one call saw its drafts do, the evidence the policy's estimates learn from (nothing kept between calls).

    Each verified drafted slot is one trial: accepted, or the first one rejected (the slots after a rejection
    were not tried). Trials are counted by the slot's confidence bin ([`BINS`] equal bins of
    ``Proposal.confidence`` or the drafter's own estimate), for the whole call and per row, and by depth.

    ``estimate(row, c)``: the chance that a slot of confidence ``c`` is accepted once the slots before it were,
    ``(PRIOR_WEIGHT c + accepted) / (PRIOR_WEIGHT + tried)`` over the call's trials in ``c``'s bin (the raw
    confidence is the prior, worth [`PRIOR_WEIGHT`] trials), then the row's own trials in that bin against it
    (the call's estimate worth [`ROW_WEIGHT`] trials). So a drafter whose flat distributions are always right
    is believed after a few trials, and one that is confident and always wrong is doubted after a few: the
    raw confidence is a prior, not a cap (the former per-row factor in ``[0.25, 4]`` was, issue 49 item 5).
    ``ahead(k)``: the chance for depth ``k`` learned from earlier steps alone (prior [`PRIOR_ACCEPTANCE`]),
    what a walk's cut assumes for the slots it may not read yet."""

    def __init__(self):
        self.call = [[0.0, 0.0] for _ in range(BINS)]  # per bin: accepted, tried
        self.rows = {}  # row id -> per bin [accepted, tried]
        self.depths = {}  # depth (1 = first drafted slot) -> [accepted, tried]
        self.row_depths = {}  # row id -> {depth: [accepted, tried]}

    @staticmethod
    def _bin(c: float) -> int:
        return min(BINS - 1, max(0, int(c * BINS)))

    def estimate(self, row, c: float) -> float:
        b = self._bin(c)
        acc, tried = self.call[b]
        call = (PRIOR_WEIGHT * c + acc) / (PRIOR_WEIGHT + tried)
        racc, rtried = self.rows[row][b] if row in self.rows else (0.0, 0.0)
        return (ROW_WEIGHT * call + racc) / (ROW_WEIGHT + rtried)

    def ahead(self, depth: int, row=None) -> float:
        """Depth ``depth``'s chance learned from earlier steps (the call's, then ``row``'s own against it)."""
        acc, tried = self.depths.get(depth, (0.0, 0.0))
        call = (PRIOR_WEIGHT * PRIOR_ACCEPTANCE + acc) / (PRIOR_WEIGHT + tried)
        racc, rtried = self.row_depths.get(row, {}).get(depth, (0.0, 0.0))
        return (ROW_WEIGHT * call + racc) / (ROW_WEIGHT + rtried)

    def expected(self, row, n: int) -> list:
        """Row ``row``'s expected accepted drafts at widths ``1..n`` from the depth estimates alone (what the
        next step's plan weighs before its draft is seen)."""
        return _curve([self.ahead(k, row) for k in range(1, n + 1)])

    def add(self, row, confidences: list, accepted: int) -> None:
        """Row ``row`` verified slots of ``confidences`` (host floats, in slot order) and accepted ``accepted``."""
        per_row = self.rows.setdefault(row, [[0.0, 0.0] for _ in range(BINS)])
        row_depths = self.row_depths.setdefault(row, {})
        for depth, c in enumerate(confidences[: accepted + 1], start=1):
            hit = float(depth <= accepted)
            for counts in (self.call[self._bin(c)], per_row[self._bin(c)], self.depths.setdefault(depth, [0.0, 0.0]),
                           row_depths.setdefault(depth, [0.0, 0.0])):
                counts[0] += hit
                counts[1] += 1.0

    def fade(self) -> None:
        """Older trials weigh ``DECAY`` times less at each drafting step: a drafter that starts badly and then
        follows (or the reverse) is seen within a few steps (``"def add(a, b):"``, issue 49 item 5)."""
        for table in [self.call, *self.rows.values(), self.depths.values(), *(d.values() for d in self.row_depths.values())]:
            for counts in table:
                counts[0] *= DECAY
                counts[1] *= DECAY


def _curve(estimates: list) -> list:
    """Expected accepted drafts at each width ``k`` (``sum_{j<=k} prod_{i<=j} a_i``) from per-slot estimates."""
    out, alive, total = [], 1.0, 0.0
    for a in estimates:
        alive *= a
        total += alive
        out.append(total)
    return out


class VerifyPolicy:
    """One call's verify-length policy (built per call; nothing kept between calls).

    ``plan(remaining, ids)`` before a step (``remaining``: each row's tokens still to generate; ``ids``: the
    rows' ids): the block to draft (1: a plain step, no draft pass). ``cut(proposal)`` after the draft pass:
    the proposal cut to its best width. ``record(accepted)`` after the verify: accepted drafts per row (host
    ints), the evidence of [`Observed`].

    **The cut is a stopping rule** (module docstring): it reads ``Proposal.confidence`` (never the drawn token's
    own probability under random draws) or the drafter's own estimate, and for a walk (``Proposal.walk``) it
    decides slot ``k`` from slots ``<= k`` and depth estimates learned in earlier steps ([`Observed.ahead`]),
    never from a later slot of this step.

    A batch ends with its slowest row, and finished rows leave it: the width is chosen for the row whose
    remaining tokens over its expected tokens per step is largest (the critical row).

    **Observation.** The call's first drafting step and every probe verify their whole block (a schedule
    fixed in advance, so the estimates see evidence the cut would not buy; issue 49 "Learns"). A chain's
    draft pass costs what its block holds: after a step that verified ``w`` drafted positions the next
    drafts ``2 (w + 1)`` rounded up to a power of two (at most ``block_size``, at least [`PROBE_BLOCK`]);
    a probe drafts [`PROBE_BLOCK`]. Trees (``trees=True``) always draft the call's block and are cut by
    their nodes' path probabilities, scaled per row by its accepted over predicted depth."""

    def __init__(self, cost: StepCost, block_size: int, trees: bool = False):
        self.cost, self.block, self.trees = cost, block_size, trees
        self.width = None  # drafted positions the last drafting step verified
        self.effective = None  # the critical row's expected accepted drafts per width, from the last drafted step
        self.plain, self.wait = 0, None  # plain steps since the last draft step; plain steps before the next probe
        self.paid = False  # whether this call has planned a drafting step from its estimates (not only probes)
        self.observed = Observed()
        self.tree_seen = {}  # trees: per row id [predicted, observed] accepted depth
        self.chosen = None  # this step's verified slots, for record()
        self.observe = True  # the next drafting step verifies its whole block (the first step, a probe)
        self.remaining, self.ids = None, None

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
            self.plain, self.wait, self.observe = 0, min((2 if self.paid else 4) * self.wait, PROBE_LIMIT), True
            return self.block if self.trees else min(self.block, PROBE_BLOCK)
        return 1

    def _first_block(self) -> int:
        """The first step's block: the smallest power of two (at least [`PROBE_BLOCK`]) holding the width of
        most tokens per unit cost if every slot were accepted with [`PRIOR_ACCEPTANCE`] given the ones before
        it (no step has been seen yet). Trees draft the call's block."""
        if self.trees:
            return self.block
        width = best_width(self.cost, _curve([PRIOR_ACCEPTANCE] * (self.block - 1)))[0]
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

    def _rows(self, n: int):
        remaining = self.remaining if self.remaining and len(self.remaining) == n else [1] * n
        ids = self.ids if self.ids and len(self.ids) == n else list(range(n))
        return remaining, ids

    def _critical(self, curves: list, cap=None) -> list:
        """The critical row's curve: per width ``k``, the fewest expected tokens per step over the rows, each
        row's ``1 + E_r(k)`` weighed by the batch's most remaining tokens over the row's own."""
        remaining, _ = self._rows(len(curves))
        top, n = max(remaining), max(len(c) for c in curves)
        curves = [c + c[-1:] * (n - len(c)) if c else [0.0] * n for c in curves]
        return [min((1 + min(cap or k, k, c[k - 1])) * top / max(left, 1) for c, left in zip(curves, remaining)) - 1
                for k in range(1, n + 1)]

    def _width(self, estimates: list, walk: bool) -> int:
        """The verified width (at least 1: the draft pass is paid) from per-row, per-slot estimates. Without a
        walk, the width of most tokens per unit cost over the whole curve. In a walk, slot by slot: slot ``k`` is
        verified while some width ``>= k`` beats stopping at ``k - 1`` on the curve of slots ``1..k`` and the
        learned depth estimates after ``k``: the decision for slot ``k`` reads nothing computed from its draw."""
        n = len(estimates[0])
        if not walk:
            return max(1, best_width(self.cost, self._critical([_curve(e) for e in estimates]))[0])
        _, ids = self._rows(len(estimates))
        ahead = [[self.observed.ahead(k, i) for k in range(1, n + 1)] for i in ids]
        for k in range(2, n + 1):
            curve = self._critical([_curve(e[:k] + a[k:]) for e, a in zip(estimates, ahead)])
            stop = (1.0 + curve[k - 2]) / self.cost.step(k - 1)
            if all((1.0 + e) / self.cost.step(w) < stop for w, e in enumerate(curve[k - 1:], start=k)):
                return k - 1
        return n

    def cut(self, proposal):
        """``proposal`` (``proposers.Proposal``, a chain) cut to its best width: one host transfer of ``(A, n)``.
        The call's first drafting step and probes are verified whole ([`Observed`])."""
        conf = proposal.acceptance if proposal.acceptance is not None else proposal.confidence
        conf = proposal.token_probs if conf is None else conf  # (A, n)
        if conf.shape[1] == 0 or proposal.tree is not None:  # a tree was cut before it was built: cut_trees
            return proposal
        confs = conf.float().clamp(0, 1).tolist()
        _, ids = self._rows(len(confs))
        estimates = [[self.observed.estimate(i, c) for c in row] for i, row in zip(ids, confs)]
        width = len(confs[0]) if self.observe else self._width(estimates, proposal.walk)
        self.observe, self.width = False, width
        lengths = [width] * len(confs) if proposal.lengths is None else [min(width, n) for n in proposal.lengths.tolist()]
        self.chosen = (ids, [row[:n] for row, n in zip(confs, lengths)])  # record() sets the next plan's curve
        return proposal.cut(width)

    def cut_trees(self, trees: list) -> list:
        """Best-first trees (``draft_trees.HostTree``, one per row) cut to the node count of most tokens per
        unit cost: a tree's expected accepted depth is the sum of its nodes' path probabilities, scaled per row
        by its accepted over predicted depth so far (a prior of one each, within ``[0.25, 4]``)."""
        _, ids = self._rows(len(trees))
        rows = []
        for t, i in zip(trees, ids):
            seen = self.tree_seen.get(i, [0.0, 0.0])
            scale = min(4.0, max(0.25, (1 + seen[1]) / (1 + seen[0])))
            acc, total = [], 0.0
            for p in path_probs(t):
                total += p
                acc.append(scale * total)
            rows.append(acc)
        self.effective = self._critical(rows, self.block - 1)
        width = max(1, best_width(self.cost, self.effective)[0])
        self.width, self.observe = width, False
        self.chosen = (ids, [r[width - 1] if r else 0.0 for r in rows], width)
        return [first_nodes(t, width) for t in trees]

    def record(self, accepted: list) -> None:
        if self.chosen is None:
            return
        if self.trees:
            ids, predicted, width = self.chosen
            for i, p, a in zip(ids, predicted, accepted):
                seen = self.tree_seen.setdefault(i, [0.0, 0.0])
                seen[0], seen[1] = seen[0] + p, seen[1] + min(a, width)
        else:
            ids, confs = self.chosen
            self.observed.fade()
            for i, row, a in zip(ids, confs, accepted):
                self.observed.add(i, row, a)
            # the next plan weighs what each row's drafts have been getting accepted, depth by depth
            self.effective = self._critical([self.observed.expected(i, self.block - 1) for i in ids])
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


__all__ = ["BINS", "COST_ENV", "FixedBlocks", "Observed", "PRIOR_ACCEPTANCE", "PROBE_BLOCK", "PROBE_LIMIT",
           "PROBE_PATIENCE", "StepCost", "VerifyPolicy", "best_width", "check_adaptive", "env_cost", "policy_for",
           "policy_wanted"]
