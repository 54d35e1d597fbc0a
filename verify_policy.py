"""Verify what pays: how many drafted positions each step verifies, from the draft's own confidence and the
measured cost of a verified position (``spec_generate(adaptive_block_size=True)``).

A verify step of ``w`` drafted positions at batch width ``A`` costs ``draft + verify(w + 1)`` plain target
steps ([`StepCost`]) and commits, per row, ``1 + E_r(w)`` tokens on average, where
``E_r(w) = sum_{k<=w} prod_{j<=k} a_rj`` and ``a_rj`` is the chance that slot ``j`` is accepted once the slots
before it were: the drafter's own estimate where it has one (DSpark's confidence head,
``Proposal.acceptance``), else the draft's probability of its own token (``Proposal.token_probs``),
scaled by how the call's verified steps compare with what was predicted (one factor per call, from the
accept decisions only). [`VerifyPolicy`] picks the ``w`` of largest tokens per unit cost; when even the
last drafted step's curve does not beat a plain step (``w = 0``: one position, no draft pass), the next
steps run plain, with a draft step every 1, 2, 4 ... 32 plain steps to re-measure (the draft's context keeps
every committed position's features meanwhile, so drafting resumes without loss). Only what is proposed
changes: every committed token is still the target's own (greedy) or exactly its distribution.

Where the cost comes from ([`step_cost`]): the caller's ``verify_cost`` (a [`StepCost`]), else one
measurement of the call's own target and drafter on scratch inputs at the call's batch width and context
length (both rounded up to a power of two), made before the call's first forward and kept for the process
and in a JSON file (``$DFLASH_HF_CACHE`` or ``$HF_HOME/dflash_hf``, file ``verify_costs.json``), so that later
calls and later processes on the machine reuse the same table: the policy, and with it a seeded sampled
call's tokens, then depend only on the seed. Costs are ratios to a plain step on that device, rounded to
steps of 2^(1/8); nothing is timed inside a model's forward.

Sources: issue "Verify what pays"; vLLM's adaptive verification (PR #47808: per-slot survival
probabilities and a token budget from a startup cost profile); DSpark (arXiv 2607.05147) for the
confidence head's estimates.
"""

import hashlib
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import DynamicCache, LogitsProcessorList

try:
    from .decode_step import _Context, _Rows, _forward_target, _sync, crop_cache
    from .draft_trees import first_nodes, path_probs
    from .target_cache import new_target_cache
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from decode_step import _Context, _Rows, _forward_target, _sync, crop_cache
    from draft_trees import first_nodes, path_probs
    from target_cache import new_target_cache

PROBE_LIMIT = 32  # at most this many plain steps between two draft steps that re-measure the curve
_STEP = 8  # costs are rounded to steps of 2 ** (1 / _STEP)
_TABLES: dict = {}  # this process's measured tables, by key ([`step_cost`])


@dataclass(frozen=True)
class StepCost:
    """What one verify step costs, in plain target steps at this batch width (a plain step: one position per
    row, no draft pass, costs 1.0).

    Attributes:
        widths: verified positions per row (anchor included) at which ``verify`` was measured, increasing,
            starting at 1.
        verify: the target forward's cost at each width (``verify[0] == 1.0``); linear in between, and past
            the last width.
        draft: one draft pass (the proposer's whole proposal: draft forward and token choice).
    """

    widths: tuple
    verify: tuple
    draft: float

    def __post_init__(self):
        if (len(self.widths) != len(self.verify) or not self.widths or self.widths[0] != 1
                or list(self.widths) != sorted(set(self.widths)) or self.verify[0] != 1.0
                or not all(v > 0 and math.isfinite(v) for v in self.verify) or not self.draft >= 0):
            raise ValueError(f"StepCost(widths={self.widths}, verify={self.verify}, draft={self.draft}) needs "
                             "increasing widths from 1, verify[0] == 1.0, positive finite costs and draft >= 0")

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


class VerifyPolicy:
    """One call's verify-length policy (built per call; nothing kept between calls).

    ``plan()`` before a step: the block to draft (``block_size``; 1: a plain step, no draft pass).
    ``cut(proposal)`` after the draft pass: the proposal cut to the best width of its own curve.
    ``record(accepted)`` after the verify: the accepted drafts per row ``(A,)`` (host ints), for the
    call's calibration factor."""

    def __init__(self, cost: StepCost, block_size: int):
        self.cost, self.block = cost, block_size
        self.curve = None  # last drafted step's expected accepted drafts per row, per width
        self.plain, self.wait = 0, 1  # plain steps since the last draft step; plain steps before the next probe
        self.predicted, self.observed = 1.0, 1.0  # sums over verified steps (a prior of one each)
        self.chosen = None  # this step's predicted mean accepted drafts per row, for record()

    @property
    def scale(self) -> float:
        return min(4.0, max(0.25, self.observed / self.predicted))

    def _expected(self, curve: list, trees: bool = False) -> list:
        cap = self.block - 1 if trees else None  # a tree accepts at most its depth, a chain its length
        return [min(cap or k, k, self.scale * e) for k, e in enumerate(curve, start=1)]

    def plan(self) -> int:
        if best_width(self.cost, list(range(1, self.block)))[0] == 0:  # not even a fully accepted block pays
            return 1
        if self.curve is None or best_width(self.cost, self._expected(self.curve))[0] > 0:
            self.plain, self.wait = 0, 1
            return self.block
        self.plain += 1
        if self.plain > self.wait:  # probe: draft once to re-measure the curve
            self.plain, self.wait = 0, min(2 * self.wait, PROBE_LIMIT)
            return self.block
        return 1

    def cut(self, proposal):
        """``proposal`` (``proposers.Proposal``, a chain) cut to its best width (at least one drafted position:
        the draft pass is paid), with the curve kept for the next ``plan``. One host transfer of ``(n,)``."""
        probs = proposal.acceptance if proposal.acceptance is not None else proposal.token_probs  # (A, n)
        if probs.shape[1] == 0 or proposal.tree is not None:  # a tree was cut before it was built: cut_trees
            return proposal
        self.curve = probs.float().clamp(0, 1).cumprod(dim=1).mean(dim=0).cumsum(dim=0).tolist()  # (n,)
        expected = self._expected(self.curve)
        width = max(1, best_width(self.cost, expected)[0])
        self.chosen = (self.curve[width - 1], width)
        return proposal.cut(width)

    def cut_trees(self, trees: list) -> list:
        """Best-first trees (``draft_trees.HostTree``, one per row) cut to the node count of most tokens per
        unit cost: a tree's expected accepted depth is the sum of its nodes' path probabilities."""
        n = max(t.size for t in trees)
        rows = [path_probs(t) for t in trees]
        self.curve = [sum(sum(p[:k]) for p in rows) / len(rows) for k in range(1, n + 1)]
        width = max(1, best_width(self.cost, self._expected(self.curve, trees=True))[0])
        self.chosen = (self.curve[width - 1], width)
        return [first_nodes(t, width) for t in trees]

    def record(self, accepted: list) -> None:
        if self.chosen is not None:
            self.predicted += self.chosen[0]
            self.observed += sum(min(a, self.chosen[1]) for a in accepted) / max(len(accepted), 1)
            self.chosen = None


class FixedBlocks:
    """The policy of a call without ``adaptive_block_size``: every step drafts and verifies the whole block."""

    def __init__(self, block_size: int):
        self.block = block_size

    def plan(self) -> int:
        return self.block

    def cut(self, proposal):
        return proposal

    def record(self, accepted: list) -> None:
        pass


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
            return json.load(f)
    except (OSError, ValueError):
        return {}


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
    except OSError:  # a read-only home: the table stays in this process
        pass


def step_cost(target, draft, facts, proposer_cls, batch: int, context: int, width: int, mask_token_id: int,
              draft_window=None, given: Optional[StepCost] = None, tree_budget=None, block: Optional[int] = None) -> StepCost:
    """The [`StepCost`] of this call: ``given`` (``spec_generate``'s ``verify_cost``), else the table of this
    target, drafter, device, dtype, CPU threads, batch and context buckets and verify width, from this
    process, else from the cost file, else measured now ([`measure`]) and kept in both.

    Raises TypeError when ``given`` is neither None nor a ``StepCost``."""
    if given is not None:
        if not isinstance(given, StepCost):
            raise TypeError(f"verify_cost must be a verify_policy.StepCost, got {type(given).__name__}")
        return given
    dtype = facts.mask_dtype
    batch, context = _bucket(batch), _bucket(max(context, 16))
    key = _key(target, draft, facts.device, dtype, batch, context, width, draft_window) + f"/tree{tree_budget}"
    if key not in _TABLES:
        stored = _load_file().get(key)
        if stored is not None:
            _TABLES[key] = StepCost(tuple(stored["widths"]), tuple(stored["verify"]), stored["draft"])
        else:
            _TABLES[key] = measure(target, draft, facts, proposer_cls, batch, context, width, mask_token_id,
                                   draft_window, tree_budget=tree_budget, block=block)
            _save(key, _TABLES[key])
    return _TABLES[key]


def _widths(width: int) -> tuple:
    points = {1, width}
    k = 2
    while k < width:
        points.add(k)
        k *= 2
    return tuple(sorted(points))


def measure(target, draft, facts, proposer_cls, batch: int, context: int, width: int, mask_token_id: int,
            draft_window=None, repeats: int = 3, tree_budget=None, block: Optional[int] = None) -> StepCost:
    """Time, on scratch inputs (random tokens from a fixed seed, zero features; the caller's generator is not
    touched), the target's forward over ``context`` cached tokens at each width of ``_widths(width)`` and one
    proposal of a ``block`` block (default ``width``; a tree of ``tree_budget`` nodes when given) by
    ``proposer_cls``, at ``batch`` rows; the fastest of ``repeats`` each,
    as ratios to the width-1 forward, rounded. Runs once per table ([`step_cost`])."""
    # local import: speculative_sampling imports nothing from here, the proposers import this module's siblings
    try:
        from .speculative_sampling import _Sampling
    except ImportError:
        from speculative_sampling import _Sampling
    device = facts.device
    vocab = facts.head.weight.shape[0] if hasattr(facts.head, "weight") else target.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (batch, context + width), generator=gen).to(device)
    positions = torch.arange(context + width, device=device)[None].expand(batch, -1)
    cache = new_target_cache(target)
    with torch.inference_mode():
        _forward_target(target, facts, cache, ids[:, :context], positions[:, :context], None, record=False)

        def verify(n):
            _forward_target(target, facts, cache, ids[:, context:context + n], positions[:, context:context + n], None)
            crop_cache(cache, context)

        widths = _widths(width)
        times = [_fastest(lambda n=n: verify(n), repeats, device) for n in widths]
        draft_time = _proposal_time(draft, facts, proposer_cls, _Sampling(LogitsProcessorList(), False, None),
                                    batch, context, block or width, mask_token_id, draft_window, repeats, device,
                                    tree_budget)
    base = times[0]
    verify_costs = [1.0] + [max(1.0, _rounded(t / base)) for t in times[1:]]
    for i in range(1, len(verify_costs)):  # never cheaper to verify more
        verify_costs[i] = max(verify_costs[i], verify_costs[i - 1])
    return StepCost(widths, tuple(verify_costs), _rounded(draft_time / base))


def _fastest(fn, repeats: int, device) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        t0 = _sync(device)
        fn()
        best = min(best, _sync(device) - t0)
    return max(best, 1e-9)


def _proposal_time(draft, facts, proposer_cls, sampling, batch, context, width, mask_token_id, window, repeats,
                   device, tree_budget=None) -> float:
    """Seconds of one proposal of a ``width`` block over a draft context of ``context`` positions, of which
    the last 4 are new (as after a verify step)."""
    fc = draft.fc.weight
    draft_cache = DynamicCache()
    proposer = proposer_cls(draft, facts, draft_cache, sampling, mask_token_id, window,
                            **({} if tree_budget is None else {"tree_budget": tree_budget}))
    anchor = torch.zeros(batch, 1, dtype=torch.long, device=device)

    def rows(start, new):
        ctx = _Context(fc.new_zeros(batch, new, fc.shape[1]),
                       (start - new + torch.arange(new, device=device))[None].expand(batch, -1), None)
        return _Rows(ids=torch.arange(batch, device=device), anchor=anchor,
                     start=torch.full((batch,), start, device=device), n_new=torch.ones(batch, dtype=torch.long,
                     device=device), target_valid=None, draft_valid=None, ctx=ctx, host_ids=list(range(batch)),
                     host_new=[1] * batch, holes=False, masked=False)

    def propose():
        crop_cache(draft_cache, context - 4)
        r = rows(context, 4)
        proposer.propose(r, width, r.start[:, None] + torch.arange(width, device=device))

    proposer.propose(rows(context - 4, context - 4), width,
                     (context - 4 + torch.arange(width, device=device))[None].expand(batch, -1))  # fills the context
    return _fastest(propose, repeats, device)


__all__ = ["FixedBlocks", "PROBE_LIMIT", "StepCost", "VerifyPolicy", "best_width", "cost_file", "measure", "step_cost"]
