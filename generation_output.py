"""What a ``spec_generate`` call returns: ``DFlashGenerateOutput`` (generate's output class plus the
speculative statistics: tau, per-slot acceptance, one definition each), its plot, and the assembly of
the per-row chunks into ``sequences``.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.utils import logging

logger = logging.get_logger(__name__)

# At least this many verify steps that drafted before a call judges its drafter (issue 39); or, when none of
# them accepted anything at all, MIN_JUDGED_STEPS steps that tried MIN_DRAFTED_POSITIONS drafted positions between
# them: under the verify-length policy a drafter that accepts nothing goes plain after its first steps and is
# probed rarely (issue 49), so that evidence is counted in positions tried, as the first steps and probes saw it.
MIN_DRAFTING_STEPS = 16
MIN_JUDGED_STEPS, MIN_DRAFTED_POSITIONS = 3, 8


class _Table(str):
    """A string that shows as itself (not quoted) at a notebook prompt."""

    def __repr__(self):
        return str(self)


@dataclass(repr=False)
class DFlashGenerateOutput(GenerateDecoderOnlyOutput):
    """What ``spec_generate(..., return_dict_in_generate=True)`` returns: a ``GenerateDecoderOnlyOutput``
    (``isinstance`` holds, the fields follow the installed transformers) plus the speculative statistics.

    Fields of ``generate``:
        sequences: ``(B, prompt_len + new_len)`` LongTensor, prompt first, right padded.
        scores: with ``output_scores=True``: a tuple of one ``(B, V)`` fp32 tensor per new token (the first
            from the prefill), the processed scores the token was chosen from, as generate gives them. In a
            batch, a row's entries after its last token are NaN (generate would hold scores of pad steps).
        logits: with ``output_logits=True``: the same for the raw target logits.
        attentions, hidden_states: always None (refused: the target runs on blocks).
        cache / past_key_values (the name follows the installed version): batch 1, the target's cache holding
            every token of ``sequences`` but the last (as generate's), with the draft's context attached, to pass
            back as ``cache=`` / ``past_key_values=`` (``cache_reuse.py``); None for batches (the loop's cache
            holds rejected slots and holes of other rows) and for the static loop.

    Speculative statistics (one definition, read by README, demo and benchmarks):
        acceptance_lengths: tokens each verify step committed, bonus included, all rows in row order.
            Tokens past a row's budget or stop are not counted, nor those past the batch end of a batch
            without an eos criterion (steps wholly past it are dropped); the prefill token is not counted.
        row_acceptance_lengths: the same, one list per row; ``sum(row) == num_new_tokens[r] - 1``.
        row_draft_lengths: drafts proposed per verify step, per row (``b - 1``, capped by the row's
            remaining budget or by the tokens a step keeps before such a batch end: a slot not drafted is
            not a rejection).
        row_accepted_drafts: drafts the verifier accepted per step, per row (capped alike, before any stop cut).
        num_new_tokens: new tokens per row.
        num_draft_forwards / num_target_forwards: forward passes (the target's include the prefill).
        timings: with ``output_timings=True``: ``prefill_s``, ``decode_s``, ``total_s`` (seconds,
            device-synchronised) and ``new_tokens``.
    Derived: [`tau`], [`row_tau`], [`slot_acceptance`], [`summary`].
    """

    acceptance_lengths: Optional[list] = None
    row_acceptance_lengths: Optional[list] = None
    row_draft_lengths: Optional[list] = None
    row_accepted_drafts: Optional[list] = None
    num_new_tokens: Optional[list] = None
    num_draft_forwards: Optional[int] = None
    num_target_forwards: Optional[int] = None
    timings: Optional[dict] = None

    @property
    def tau(self) -> Optional[float]:
        """Acceptance length pooled over rows and over the verify steps that drafted (``row_draft_lengths``
        > 0): tokens those steps committed / their number (without plain steps ``sum(new - 1) / steps``);
        None with no such step. Plain steps are counted apart: [`plain_steps`]."""
        pairs = self._drafting_steps()
        return sum(a for a, _ in pairs) / len(pairs) if pairs else None

    @property
    def plain_steps(self) -> int:
        """Verify steps of all rows that verified no drafted position (``block_size=1``, or steps where
        ``adaptive_block_size``'s policy found that drafting did not pay): one target position, no draft pass."""
        return sum(d == 0 for row in self.row_draft_lengths or [] for d in row)

    def _drafting_steps(self) -> list:
        return [(a, d) for lengths, drafted in zip(self.row_acceptance_lengths or [], self.row_draft_lengths or [])
                for a, d in zip(lengths, drafted) if d > 0]

    @property
    def row_tau(self) -> list:
        """Per row, tokens committed by its verify steps that drafted / their number (None for a row without one)."""
        out = []
        for lengths, drafted in zip(self.row_acceptance_lengths or [], self.row_draft_lengths or []):
            kept = [a for a, d in zip(lengths, drafted) if d > 0]
            out.append(sum(kept) / len(kept) if kept else None)
        return out

    def slot_acceptance(self) -> list:
        """Acceptance rate of draft slot ``k = 1..K``: steps that accepted >= k drafts / steps that drafted
        slot k (all rows pooled); None for a slot no step drafted. With draft trees (``tree_budget``) slot
        ``k`` is depth ``k``: steps that accepted >= k nodes / steps whose tree reached depth k."""
        drafted = [d for row in self.row_draft_lengths or [] for d in row]
        accepted = [a for row in self.row_accepted_drafts or [] for a in row]
        rates = []
        for k in range(1, max(drafted, default=0) + 1):
            n = sum(d >= k for d in drafted)
            rates.append(sum(a >= k for a, d in zip(accepted, drafted) if d >= k) / n if n else None)
        return rates

    def summary(self) -> str:
        """A short table: rows, new tokens, verify steps, tau, per-slot acceptance, forwards, timings."""
        tau = self.tau
        lines = [f"DFlashGenerateOutput: {len(self.num_new_tokens or [])} row(s), sequences "
                 f"{tuple(self.sequences.shape) if self.sequences is not None else None}",
                 f"  tau per drafting step : {'-' if tau is None else f'{tau:.2f}'}",
                 "  row  new  steps   tau"]
        for r, (n, steps, t) in enumerate(zip(self.num_new_tokens, self.row_acceptance_lengths, self.row_tau)):
            lines.append(f"  {r:>3} {n:>4} {len(steps):>6} {'-' if t is None else f'{t:5.2f}':>5}")
        rates = self.slot_acceptance()
        if rates:
            lines.append("  slot acceptance: " + " ".join("-" if x is None else f"{x:.2f}" for x in rates))
        lines.append(f"  forwards: draft {self.num_draft_forwards}, target {self.num_target_forwards}"
                     + (f"; plain steps {self.plain_steps}" if self.plain_steps else ""))
        if self.timings:
            t = self.timings
            tps = t["new_tokens"] / t["total_s"] if t["total_s"] > 0 else float("nan")
            lines.append(f"  time: prefill {t['prefill_s']:.3f}s, decode {t['decode_s']:.3f}s, {tps:.1f} tok/s")
        return _Table("\n".join(lines))

    def __repr__(self):
        return str(self.summary())


def per_slot_acceptance(acceptance_lengths, block_size: int) -> list:
    """Acceptance of each draft slot ``k = 1..block_size-1``: steps that accepted at least ``k``
    drafts / steps (every step drafts the full block except near ``max_new_tokens``). A step with
    acceptance length ``a`` (bonus included) accepted ``a - 1`` drafts."""
    n = max(len(acceptance_lengths), 1)
    return [sum(a - 1 >= k for a in acceptance_lengths) / n for k in range(1, block_size)]


def plot_acceptance(result, block_size: Optional[int] = None):
    """Plot per-slot acceptance and the histogram of acceptance lengths of a ``spec_generate`` (or
    ``native_acceptance_stats``) result. Needs matplotlib (optional; imported here, any backend).

    Args:
        result: has ``acceptance_lengths`` (tokens per verify step, bonus included).
        block_size: slots to show; default the result's block size if it records one, else the
            longest acceptance length seen.

    Returns:
        A ``matplotlib.figure.Figure`` with two axes: bars of per-slot acceptance (slot 1..b-1, in
        [0, 1]) and a histogram of acceptance lengths (1..b) with tau marked.

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
        ValueError: the result holds no verify steps.
    """
    lengths = list(result.acceptance_lengths or [])
    if not lengths:
        raise ValueError("the result holds no verify steps (nothing was drafted): nothing to plot")
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as err:
        raise ImportError("plot() needs matplotlib: pip install matplotlib") from err
    b = int(block_size or getattr(result, "block_size", None) or max(lengths))
    tau = getattr(result, "tau", None) or sum(lengths) / len(lengths)
    rates = result.slot_acceptance() if hasattr(result, "slot_acceptance") else per_slot_acceptance(lengths, b)
    rates = [0.0 if r is None else r for r in rates][: b - 1]
    rates += [0.0] * (b - 1 - len(rates))  # slots no step drafted
    fig = Figure(figsize=(10, 3.5), layout="constrained")
    slots, hist = fig.subplots(1, 2)
    slots.bar(range(1, b), rates, color="tab:blue")
    slots.xaxis.set_major_locator(MaxNLocator(integer=True))  # slots are whole numbers
    slots.set(xlabel="draft slot k (with trees: depth k)", ylabel="share of steps accepting slot k", ylim=(0, 1),
              title="per-slot acceptance")
    hist.hist(lengths, bins=[x - 0.5 for x in range(1, b + 2)], color="tab:green", rwidth=0.85)
    hist.axvline(tau, color="black", linestyle="--", label=f"tau = {tau:.2f}")
    hist.set(xlabel="acceptance length (tokens per verify step)", ylabel="verify steps",
             title=f"acceptance lengths ({len(lengths)} steps)")
    hist.yaxis.set_major_locator(MaxNLocator(integer=True))
    hist.legend()
    return fig


DFlashGenerateOutput.plot = plot_acceptance


def _empty_output(input_ids):
    bsz = input_ids.shape[0]
    return DFlashGenerateOutput(
        sequences=input_ids, acceptance_lengths=[], row_acceptance_lengths=[[] for _ in range(bsz)],
        row_draft_lengths=[[] for _ in range(bsz)], row_accepted_drafts=[[] for _ in range(bsz)],
        num_new_tokens=[0] * bsz, num_draft_forwards=0, num_target_forwards=0)


def _assemble(out, input_ids, run, pad):
    """``sequences`` = prompt as given + each row's new tokens, right padded with ``pad``; scores/logits."""
    rows = [sum(row, []) for row in run.chunks]
    width = max(len(r) for r in rows)
    new = input_ids.new_full((len(rows), width), pad)
    for i, r in enumerate(rows):
        new[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    out.sequences = torch.cat([input_ids, new], dim=1)
    out.num_new_tokens = [len(r) for r in rows]
    out.acceptance_lengths = [a for row in out.row_acceptance_lengths for a in row]
    if run.recorder is not None:
        for name, value in run.recorder.tuples(width).items():
            out[name] = value  # ModelOutput: item and attribute


def drafting_acceptance(out) -> tuple:
    """``(steps, mean accepted drafts per step)`` over the call's verify steps that proposed at least one
    drafted token (all rows pooled); steps with no drafted token (``block_size=1``, a plain step) do not
    count. ``(0, None)`` when no step drafted."""
    pairs = _drafting_steps(out)
    return len(pairs), (sum(a for _, a in pairs) / len(pairs) if pairs else None)


def _drafting_steps(out) -> list:
    """``(drafted, accepted)`` of each row's verify steps that drafted."""
    return [(d, a) for drafted, accepted in zip(out.row_draft_lengths or [], out.row_accepted_drafts or [])
            for d, a in zip(drafted, accepted) if d > 0]


def warn_if_not_drafting(out, threshold: Optional[float]) -> None:
    """One logging warning when at least ``MIN_DRAFTING_STEPS`` verify steps drafted and they accepted on average
    at most ``threshold`` drafted tokens per step, or when ``MIN_JUDGED_STEPS`` that drafted
    ``MIN_DRAFTED_POSITIONS`` positions between them (the verify-length policy's first steps and probes)
    accepted none at all (``threshold`` None: never). The output is not changed.

    Source: issue 39; a quantized DFlash 2 drafter accepted nothing for 155 batches and nobody was told
    (SGLang #39087, #36599); a drafter on the wrong target accepts 2-12% (z-lab/dflash #152)."""
    if threshold is None:
        return
    steps, mean = drafting_acceptance(out)
    tried = sum(d for d, _ in _drafting_steps(out))
    few = steps >= MIN_JUDGED_STEPS and tried >= MIN_DRAFTED_POSITIONS and mean == 0  # nothing at all: enough said
    if (steps >= MIN_DRAFTING_STEPS and mean <= threshold) or few:
        logger.warning(
            f"the drafter is not drafting: {steps} verify steps accepted {mean:.3f} drafted tokens per step on "
            f"average (low_acceptance_warning={threshold}). The output is the target's own, but speculative "
            "decoding is only adding cost. Usual causes, most likely first: target_layer_ids that do not match "
            "this target; a target of another revision or fine-tune than the drafter was trained on; a quantized "
            "target the drafter was not trained against; a drafter quantization that broke its head. Pass "
            "low_acceptance_warning=None to silence this.")


__all__ = ["DFlashGenerateOutput", "drafting_acceptance", "per_slot_acceptance", "plot_acceptance",
           "warn_if_not_drafting"]
