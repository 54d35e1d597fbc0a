"""generate's stopping criteria asked as often as each needs (``_Stops``: eos per token, the length
budget, ``max_time`` once per step, other criteria per committed token), and the per-row scores/logits
of committed tokens assembled like generate's tuples (``_Scores``).
"""

from typing import Optional

import torch
from transformers import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

try:
    from .speculative_sampling import _History
except ImportError:  # imported from the repository root instead of as a Hub remote-code package
    from speculative_sampling import _History


class _Stops:
    """generate's stopping criteria, split by how often they must be asked.

    ``EosTokenCriteria`` -> the id set ``eos``, checked per committed token (cheap); ``MaxLengthCriteria``
    -> the token budget (``max_length`` minus the padded prompt width, at least 1 as in generate);
    ``MaxTimeCriteria`` -> asked once per verify step, after the commit; every other criterion
    (``StopStringCriteria``, a user's) -> called once per committed token, in order, with that row's
    ``(1, L)`` prefix and ``scores=None``. A criterion may answer as generate accepts: a bool, a bool tensor
    or a list of bools (the tutorial pattern returns a plain ``bool``).

    Without an eos criterion, generate pads no finished row: in a batch, a row stopped by another
    criterion keeps generating until every row has stopped (``keep_going``; the rows are then cut at the
    longest row's stop, ``batch_end``). With one, a stopped row ends there and is padded, as today.
    """

    def __init__(self, criteria, prompt_len: int, bsz: int = 1):
        self.eos, self.timers, self.others, max_length = set(), [], [], None
        # generate's has_eos_stopping_criteria: finished rows are padded only when one exists
        self.keep_going = bsz > 1 and not any(hasattr(c, "eos_token_id") for c in criteria)
        self.bsz, self.stopped_at = bsz, {}  # row -> new tokens at its first stop (keep_going only)
        for c in criteria:
            if isinstance(c, EosTokenCriteria):
                self.eos |= set(torch.as_tensor(c.eos_token_id).reshape(-1).tolist())
            elif isinstance(c, MaxTimeCriteria):
                self.timers.append(c)
            elif isinstance(c, MaxLengthCriteria):
                max_length = c.max_length if max_length is None else min(max_length, c.max_length)
            else:
                self.others.append(c)
        self.budget = max(1, max_length - prompt_len) if max_length is not None else None

    def cut(self, take: list, history: Optional[_History], row: int, start: int):
        """``take`` cut right after its first stopping token; ``(take, stopped)``. ``history`` already
        holds ``take`` from index ``start``."""
        hit = next((j for j, t in enumerate(take) if t in self.eos), None)
        if hit is not None:
            take = take[: hit + 1]
        for j in range(len(take) if self.others else 0):
            prefix = history.tokens[row: row + 1, : start + j + 1]
            if any(_fired(c(prefix, None)) for c in self.others):
                return take[: j + 1], True
        return take, hit is not None

    def keep_generating(self, row: int, n_before: int, take: list, cut: list, stopped: bool):
        """``(take, done)`` of a row whose committed ``take`` was cut to ``cut`` by a stop (``stopped``):
        with ``keep_going``, the first stop is recorded and the row keeps every token; else ``(cut, stopped)``."""
        if not self.keep_going:
            return cut, stopped
        if stopped and row not in self.stopped_at:
            self.stopped_at[row] = n_before + len(cut)
        return take, False

    def batch_end(self):
        """New-token count at which a ``keep_going`` batch ends (the last row's first stop), or None."""
        if not self.keep_going or len(self.stopped_at) < self.bsz:
            return None
        return max(self.stopped_at.values())

    def trim(self, chunks: list) -> dict:
        """Cut every row's committed chunks at ``batch_end`` (rows may have committed past it). Returns
        ``{row: (k, n)}`` for each row cut: its chunk ``k`` keeps its first ``n`` tokens, later ones are dropped
        (what else was recorded per chunk follows, ``decode_step._trim_to_batch_end``)."""
        end, cuts = self.batch_end(), {}
        for r, row in enumerate(chunks if end is not None else ()):
            total = 0
            for k, chunk in enumerate(row):
                if total + len(chunk) >= end:
                    if total + len(chunk) > end or k + 1 < len(row):
                        cuts[r] = (k, end - total)
                    row[k:] = [chunk[: end - total]]
                    break
                total += len(chunk)
        return cuts

    def timed_out(self) -> bool:
        if not self.timers:  # the common case: no tensor built per step
            return False
        probe = torch.zeros(1, 1, dtype=torch.long)
        return any(_fired(c(probe, None)) for c in self.timers)


def _fired(answer) -> bool:
    """A criterion's answer, as generate takes it (a bool, a bool tensor or a list of bools): any row set."""
    return bool(torch.as_tensor(answer, dtype=torch.bool).any())


class _Scores:
    """Per-row processed scores / raw logits of each committed token, assembled like generate's tuples."""

    def __init__(self, bsz: int, scores: bool, logits: bool):
        self.want = {"scores": scores, "logits": logits}
        self.rows = {name: [[] for _ in range(bsz)] for name, on in self.want.items() if on}

    def add(self, row: int, n: int, scores, logits):
        for name, value in (("scores", scores), ("logits", logits)):
            if name in self.rows:
                self.rows[name][row].append(value[:n].float())

    def trim(self, row: int, k: int, n: int) -> None:
        """Row ``row`` keeps its first ``k`` chunks' entries and ``n`` of chunk ``k``'s (``_Stops.trim``)."""
        for rows in self.rows.values():
            rows[row][k:] = [rows[row][k][:n]]

    def tuples(self, width: int):
        """name -> tuple of ``width`` tensors ``(B, V)``; NaN after a row's last token."""
        out = {}
        for name, rows in self.rows.items():
            per_row = [torch.cat(r) for r in rows]
            stacked = per_row[0].new_full((len(per_row), width, per_row[0].shape[-1]), float("nan"))
            for i, r in enumerate(per_row):
                stacked[i, : len(r)] = r
            out[name] = tuple(stacked.unbind(1))
        return out
