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
    ``(1, L)`` prefix and ``scores=None``.
    """

    def __init__(self, criteria, prompt_len: int):
        self.eos, self.timers, self.others, max_length = set(), [], [], None
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
            if any(bool(c(prefix, None).any()) for c in self.others):
                return take[: j + 1], True
        return take, hit is not None

    def timed_out(self) -> bool:
        probe = torch.zeros(1, 1, dtype=torch.long)
        return any(bool(c(probe, None).any()) for c in self.timers)


class _Scores:
    """Per-row processed scores / raw logits of each committed token, assembled like generate's tuples."""

    def __init__(self, bsz: int, scores: bool, logits: bool):
        self.want = {"scores": scores, "logits": logits}
        self.rows = {name: [[] for _ in range(bsz)] for name, on in self.want.items() if on}

    def add(self, row: int, n: int, scores, logits):
        for name, value in (("scores", scores), ("logits", logits)):
            if name in self.rows:
                self.rows[name][row].append(value[:n].float())

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
