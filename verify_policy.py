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

Where the cost comes from ([`step_cost`]): the caller's ``verify_cost`` (a [`StepCost`]), else the same as
JSON in ``$DFLASH_VERIFY_COST`` ([`env_cost`]), else one measurement of the call's own loop
(``spec_generate`` with fixed blocks of 1, 2, 4 ... positions, greedy, on random tokens from a fixed seed)
at the call's batch width and context length (both rounded up to a power of two), made before the call's
first forward and kept for the process and in a JSON file (``verify_costs.json`` in the folder
``$DFLASH_HF_CACHE``, else ``$HF_HOME/dflash_hf``), so that later calls and later processes on the
machine reuse the same table: the policy, and with it a seeded sampled call's tokens, then depend only on
the seed. Costs are ratios to a plain step on that device, rounded to steps of 2^(1/8); nothing is timed
inside a model's forward.

Sources: issue "Verify what pays"; vLLM's adaptive verification (PR #47808: per-slot survival
probabilities and a token budget from a startup cost profile); DSpark (arXiv 2607.05147) for the
confidence head's estimates.
"""

import functools
import hashlib
import json
import math
import os
import statistics
import tempfile
from dataclasses import dataclass
from typing import Optional

import torch
from transformers.utils import logging

try:
    from .draft_trees import first_nodes, path_probs
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from draft_trees import first_nodes, path_probs

PROBE_LIMIT = 64  # at most this many plain steps between two draft steps that re-measure the curve
PROBE_BLOCK = 4  # a probe drafts this block (at most the call's): whether drafting pays shows in its first slots
PROBE_PATIENCE = 4  # before drafting has paid once, the first probe waits this many times a probe's waste
PRIOR_ACCEPTANCE = 0.8  # the first step's block assumes each slot is accepted with this chance given the ones before
BINS = 10  # Observed: trials are counted per confidence bin of width 1 / BINS
PRIOR_WEIGHT = 0.5  # Observed: a slot's raw confidence counts as this many trials of its bin
ROW_WEIGHT = 4.0  # Observed: the call's estimate counts as this many trials against a row's own
MEASURE_ROUNDS = 5  # a measured table takes the median of this many rounds per width
_STEP = 8  # costs are rounded to steps of 2 ** (1 / _STEP)
_TABLES: dict = {}  # this process's measured tables, by key ([`step_cost`])
COST_ENV = "DFLASH_VERIFY_COST"  # a StepCost as JSON for every call without verify_cost ([`step_cost`])

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class StepCost:
    """What one verify step costs, in plain target steps at this batch width (a plain step: one position per
    row, no draft pass, costs 1.0).

    Attributes:
        widths: verified positions per row (anchor included) at which ``verify`` was measured, increasing,
            starting at 1.
        verify: the target forward's cost at each width (``verify[0] == 1.0``); linear in between, and past
            the last width.
        draft: one draft pass (the proposer's whole proposal: draft forward and token choice), added to every
            step that drafts; 0 in measured tables, whose ``verify`` entries above width 1 are whole drafting steps.
    """

    widths: tuple
    verify: tuple
    draft: float = 0.0

    def __post_init__(self):
        faults = [why for bad, why in (
            (len(self.widths) != len(self.verify), f"{len(self.widths)} widths but {len(self.verify)} verify costs"),
            (not self.widths or self.widths[0] != 1, "widths must start at 1"),
            (list(self.widths) != sorted(set(self.widths)), "widths must increase"),
            (not self.verify or self.verify[0] != 1.0, "verify[0] must be 1.0 (a plain step)"),
            (not all(isinstance(v, (int, float)) and v > 0 and math.isfinite(v) for v in self.verify),
             "verify costs must be positive finite numbers"),
            (not (isinstance(self.draft, (int, float)) and self.draft >= 0), "draft must be a number >= 0")) if bad]
        if faults:
            raise ValueError(f"StepCost(widths={self.widths}, verify={self.verify}, draft={self.draft}): "
                             + "; ".join(faults))

    def step(self, drafted: int) -> float:
        """Cost of a step verifying ``drafted`` drafted positions (0: a plain step, 1.0)."""
        return 1.0 if drafted <= 0 else self.draft + self.verify_cost(drafted + 1)

    def verify_cost(self, width: int) -> float:
        w, v = self.widths, self.verify
        for i in range(1, len(w)):
            if width <= w[i]:
                return v[i - 1] + (v[i] - v[i - 1]) * (width - w[i - 1]) / (w[i] - w[i - 1])
        if len(w) == 1:
            return v[0] * width
        slope = (v[-1] - v[-2]) / (w[-1] - w[-2])
        return v[-1] + slope * (width - w[-1])


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

    @staticmethod
    def _bin(c: float) -> int:
        return min(BINS - 1, max(0, int(c * BINS)))

    def estimate(self, row, c: float) -> float:
        b = self._bin(c)
        acc, tried = self.call[b]
        call = (PRIOR_WEIGHT * c + acc) / (PRIOR_WEIGHT + tried)
        racc, rtried = self.rows[row][b] if row in self.rows else (0.0, 0.0)
        return (ROW_WEIGHT * call + racc) / (ROW_WEIGHT + rtried)

    def ahead(self, depth: int) -> float:
        acc, tried = self.depths.get(depth, (0.0, 0.0))
        return (PRIOR_WEIGHT * PRIOR_ACCEPTANCE + acc) / (PRIOR_WEIGHT + tried)

    def add(self, row, confidences: list, accepted: int) -> None:
        """Row ``row`` verified slots of ``confidences`` (host floats, in slot order) and accepted ``accepted``."""
        per_row = self.rows.setdefault(row, [[0.0, 0.0] for _ in range(BINS)])
        for depth, c in enumerate(confidences[: accepted + 1], start=1):
            hit = float(depth <= accepted)
            for counts in (self.call[self._bin(c)], per_row[self._bin(c)], self.depths.setdefault(depth, [0.0, 0.0])):
                counts[0] += hit
                counts[1] += 1.0


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
        self.paid = False  # whether a drafting step of this call has paid (its curve beat a plain step)
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
            self.plain, self.wait, self.observe = 0, min(4 * self.wait, PROBE_LIMIT), True
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
        ahead = [self.observed.ahead(k) for k in range(1, n + 1)]
        for k in range(2, n + 1):
            curve = self._critical([_curve(e[:k] + ahead[k:]) for e in estimates])
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
        self.chosen = (ids, [row[:n] for row, n in zip(confs, lengths)])
        self.effective = self._critical([_curve(e) for e in estimates])
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
            for i, row, a in zip(ids, confs, accepted):
                self.observed.add(i, row, a)
            # the next plan weighs the last step's confidences under what this step taught
            self.effective = self._critical([_curve([self.observed.estimate(i, c) for c in row]) or [0.0]
                                             for i, row in zip(ids, confs)])
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
    a malformed ``$DFLASH_VERIFY_COST`` for a call that would read it ([`env_cost`]).

    Raises:
        ValueError: naming the value and what was expected.
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


def call_cost(spec_generate, draft, target, facts, input_ids, budget: int, block_size: int, trees, draft_window,
              given) -> StepCost:
    """The [`StepCost`] of a ``spec_generate`` call: ``given`` (``verify_cost``), else the table for its batch,
    context (prompt + half the budget, at most 256 more) and widths (``trees``: an ``"auto"`` tree's node
    budget), measured once by [`seconds_per_step`] through ``spec_generate`` itself."""
    width = block_size if trees is None else trees + 1  # verified positions at most (a tree: its nodes + anchor)
    context = input_ids.shape[1] + min(budget, 512) // 2
    timer = functools.partial(seconds_per_step, spec_generate, draft, target, facts.device, block_size, trees,
                              draft_window)
    return step_cost(target, draft, facts.device, facts.mask_dtype, input_ids.shape[0], context, width, timer,
                     draft_window, given, tree_budget=trees)


def seconds_per_step(spec_generate, draft, target, device, block_size: int, trees, draft_window, width: int,
                     batch: int, context: int) -> float:
    """Seconds per verify step of ``spec_generate``'s loop verifying ``width`` positions (fixed blocks, or
    trees of ``width - 1`` nodes), greedy, on ``batch`` rows of ``context`` random tokens (fixed seed; special
    token ids of the config left out; every other row left padded by 3): the decode time (``output_timings``)
    of a call of ``3 * width + 10`` new tokens less that of a call of 2, over the verify steps between them.
    Neither the prefill nor the first step's draft pass over the whole prompt is in it: at 2,048 context
    tokens the prefill is ten plain steps' time or more, and a difference of whole calls measured a step of 2
    positions at 1.3 plain steps where it costs 1.8. The caller's generator and inputs are not touched."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    special = {v for k, v in vars(target.config).items() if isinstance(v, int) and k.endswith(("token_id", "token_index"))}
    allowed = torch.tensor([t for t in range(config.vocab_size) if t not in special])
    ids = allowed[torch.randint(len(allowed), (batch, context), generator=torch.Generator().manual_seed(0))].to(device)
    mask = torch.ones_like(ids)
    if batch > 1:  # a ragged batch, as the calls it stands for: left padding, so the masked path runs throughout
        mask[1::2, : min(3, context - 1)] = 0
    shape = ({"block_size": 1} if width == 1 else {"block_size": width} if trees is None
             else {"block_size": block_size, "tree_budget": width - 1})
    kw = dict(attention_mask=mask, temperature=0.0, do_sample=False, low_acceptance_warning=None,
              adaptive_block_size=False, return_dict_in_generate=True, output_timings=True, draft_window=draft_window,
              **shape)

    def decode(new):  # (decode seconds, verify steps) of a call of `new` tokens
        out = spec_generate(draft, target, ids, max_new_tokens=new, **kw)
        return out.timings["decode_s"], out.num_target_forwards - 1

    short, short_steps = decode(2)
    long, long_steps = decode(3 * width + 10)
    return max(long - short, 0.0) / max(long_steps - short_steps, 1)


# ----------------------------------------------------------------------------- the cost table

def _bucket(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _rounded(ratio: float) -> float:
    return 2.0 ** (round(math.log2(max(ratio, 1e-6)) * _STEP) / _STEP)


def _key(target, draft, device, dtype, batch: int, context: int, width: int, window) -> str:
    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda" else
                   f"cpu{torch.get_num_threads()}t")
    configs = [json.dumps(m.config.to_diff_dict(), sort_keys=True, default=str) for m in (target, draft)]
    digest = hashlib.sha256("|".join(configs).encode()).hexdigest()[:16]
    return (f"{type(target).__name__}/{type(draft).__name__}/{digest}/{device_name}/{dtype}/b{batch}/l{context}"
            f"/w{width}/win{window}")


def cost_file() -> str:
    """The JSON file the measured tables are kept in across processes."""
    root = os.environ.get("DFLASH_HF_CACHE")
    if not root:
        hf_home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
        root = os.path.join(hf_home, "dflash_hf")
    return os.path.join(root, "verify_costs.json")


def _load_file() -> dict:
    try:
        with open(cost_file()) as f:
            tables = json.load(f)
    except (OSError, ValueError):
        return {}
    return tables if isinstance(tables, dict) else {}


def _save(key: str, cost: StepCost) -> None:
    """Add ``key`` to the JSON file: written to a temporary name, then renamed (never half-written)."""
    path = cost_file()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tables = _load_file()
        tables[key] = {"widths": list(cost.widths), "verify": list(cost.verify), "draft": cost.draft}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(tables, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: the table stays in this process
        logger.warning(f"cannot write the verify cost table to {path} ({e}): it stays in this process, and a new "
                       f"process measures it again; set DFLASH_HF_CACHE to a writable folder, or {COST_ENV}")


def _stored(key: str) -> Optional[StepCost]:
    """The cost file's table for ``key``, or None: absent, or damaged (then measured again and rewritten, with
    one warning naming the file: a hand-edited entry must not break every later call)."""
    stored = _load_file().get(key)
    if stored is None:
        return None
    try:
        return _from_json(stored)
    except (ValueError, TypeError, KeyError) as e:
        logger.warning(f"{cost_file()}: the verify cost table {key} is damaged ({type(e).__name__}: {e}); "
                       "measuring it again")
        return None


def step_cost(target, draft, device, dtype, batch: int, context: int, width: int, seconds_per_step,
              draft_window=None, given: Optional[StepCost] = None, tree_budget=None) -> StepCost:
    """The [`StepCost`] of this call: ``given`` (``spec_generate``'s ``verify_cost``), else the one in the
    environment variable ``DFLASH_VERIFY_COST`` ([`env_cost`]), else the table of this target, drafter,
    device, dtype, CPU threads, batch and context buckets (powers of two), verify width, draft window and tree
    budget: from this process, else from the cost file, else measured now ([`measure`] with
    ``seconds_per_step(width, batch, context)``, one info log) and kept in both.

    Raises:
        TypeError: ``given`` is neither None nor a ``StepCost``.
        ValueError: ``DFLASH_VERIFY_COST`` is set but is not a StepCost's JSON.
    """
    if given is not None:
        if not isinstance(given, StepCost):
            raise TypeError(f"verify_cost must be a verify_policy.StepCost, got {type(given).__name__}")
        return given
    pinned = env_cost()
    if pinned is not None:
        return pinned
    batch, context = _bucket(batch), _bucket(max(context, 16))
    key = _key(target, draft, device, dtype, batch, context, width, draft_window) + f"/tree{tree_budget}"
    if key not in _TABLES:
        stored = _stored(key)
        if stored is not None:
            _TABLES[key] = stored
        else:
            logger.info(f"spec_generate: measuring the verify cost of {type(target).__name__} at batch {batch}, "
                        f"context {context}, widths up to {width} (once per shape and machine, kept in {cost_file()}; "
                        f"pass verify_cost= or set {COST_ENV} to skip it, adaptive_block_size=False for fixed blocks)")
            _TABLES[key] = measure(lambda w: seconds_per_step(w, batch, context), width)
            _save(key, _TABLES[key])
    return _TABLES[key]


def env_cost() -> Optional[StepCost]:
    """The [`StepCost`] in ``$DFLASH_VERIFY_COST`` (JSON ``{"widths": [1, ...], "verify": [1.0, ...], "draft":
    0.0}``, the cost file's entry format; ``draft`` optional), or None when it is unset or empty. It pins the
    policy of every call without ``verify_cost``, with no measurement (a CI run, seeded sampling across
    machines). Read at each call, never kept.

    Raises:
        ValueError: naming the variable and its value, when it is not such a JSON object.
    """
    text = os.environ.get(COST_ENV, "").strip()
    if not text:
        return None
    try:
        return _from_json(json.loads(text))
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{COST_ENV}={text!r} must be a JSON object like "
                         f'{{"widths": [1, 16], "verify": [1.0, 2.5], "draft": 0.0}} (a verify_policy.StepCost; '
                         f'"draft" optional, 0 by default): {type(e).__name__}: {e}') from None


def _from_json(value) -> StepCost:
    """A [`StepCost`] from its JSON object (the cost file's entries, ``$DFLASH_VERIFY_COST``).

    Raises:
        ValueError: not an object, a key other than widths / verify / draft, or a key missing.
        TypeError: a value of the wrong type.
    """
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    unknown, missing = set(value) - {"widths", "verify", "draft"}, {"widths", "verify"} - set(value)
    if unknown or missing:
        raise ValueError(f"unknown keys {sorted(unknown)}" if unknown else f"missing keys {sorted(missing)}")
    return StepCost(tuple(int(w) for w in value["widths"]), tuple(float(v) for v in value["verify"]),
                    float(value.get("draft", 0.0)))


def _widths(width: int) -> tuple:
    points = {1, width}
    k = 2
    while k < width:
        points.add(k)
        k *= 2
    return tuple(sorted(points))


def measure(seconds_per_step, width: int) -> StepCost:
    """A [`StepCost`] from ``seconds_per_step(w)``, the time of one whole step of the call's own loop verifying
    ``w`` positions (``w = 1``: a plain step; above, the draft pass, the verify forward and the bookkeeping
    together, so ``draft`` is 0), at each width of ``_widths(width)``: per round over the widths in turn the
    ratio to that round's plain step (a machine's speed drifts 20% between rounds), the median of
    ``MEASURE_ROUNDS`` rounds (one slow moment of a busy machine once priced a step of 4 positions at 3.1
    plain steps where it costs 1.7), rounded to steps of 2^(1/8), never decreasing with the width. Runs once
    per table ([`step_cost`])."""
    widths = _widths(width)
    seconds_per_step(min(2, width))  # warm-up
    rounds = [[max(seconds_per_step(w), 1e-9) for w in widths] for _ in range(MEASURE_ROUNDS)]  # widths in turn
    ratios = [statistics.median(r[i] / r[0] for r in rounds) for i in range(1, len(widths))]  # per round: drift
    costs = [1.0] + [max(1.0, _rounded(x)) for x in ratios]
    for i in range(1, len(costs)):
        costs[i] = max(costs[i], costs[i - 1])
    return StepCost(widths, tuple(costs), 0.0)


__all__ = ["BINS", "COST_ENV", "FixedBlocks", "Observed", "PRIOR_ACCEPTANCE", "PROBE_BLOCK", "PROBE_LIMIT", "PROBE_PATIENCE", "StepCost",
           "VerifyPolicy", "best_width", "call_cost", "check_adaptive", "cost_file", "env_cost", "measure", "policy_for",
           "policy_wanted", "seconds_per_step", "step_cost"]
