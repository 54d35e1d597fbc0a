"""Acceptance statistics under ONE definition, shared by every contender of the benchmark.

tau (acceptance length) = (new tokens - 1) / verify steps, per row; pooled over rows as
sum(new - 1) / sum(steps). The prefill commits the first new token without a verify step, so it
is not counted. A verify step is one target forward after the prefill; for contenders that run
through ``target.generate`` the steps are counted as target forwards - 1.

Per-slot acceptance of draft slot k (1-based): steps that accepted >= k drafts / steps that
drafted slot k. Histogram: share of steps whose acceptance length (accepted drafts + 1) is a.
"""
from __future__ import annotations


def pooled_tau(num_new_tokens: list[int], num_steps: list[int]) -> float:
    """sum(new - 1) / sum(steps) over rows; 1.0 when no row took a verify step."""
    steps = sum(num_steps)
    return sum(max(n - 1, 0) for n in num_new_tokens) / steps if steps else 1.0


def row_taus(num_new_tokens: list[int], num_steps: list[int]) -> list[float]:
    """Per-row tau: (new - 1) / steps (1.0 for a row without a verify step)."""
    return [(max(n - 1, 0) / s if s else 1.0) for n, s in zip(num_new_tokens, num_steps)]


def drafted_slots(acceptance_lengths: list[int], block_size: int, max_new_tokens: int) -> list[int]:
    """Draft slots each step of ONE row drafted: ``min(block_size, max_new_tokens - n_new) - 1``,
    replaying ``spec_generate``'s block cap from ``n_new = 1`` after the prefill."""
    n_new, out = 1, []
    for a in acceptance_lengths:
        out.append(max(min(block_size, max_new_tokens - n_new) - 1, 0))
        n_new += a
    return out


def acceptance_stats(row_acceptance_lengths: list[list[int]], num_new_tokens: list[int], block_size: int,
                     max_new_tokens: int) -> dict:
    """tau, per-row tau, per-slot acceptance and the acceptance-length histogram of one run.

    Args:
        row_acceptance_lengths: per row, each verify step's acceptance length (accepted drafts + 1,
            in ``[1, block_size]``), as ``DFlashGenerateOutput.row_acceptance_lengths``.
        num_new_tokens: per row, new tokens after the cut at a stop token / ``max_new_tokens``.
        block_size, max_new_tokens: the call's settings (the last steps draft fewer slots).

    Returns a dict: ``tau`` (pooled), ``row_tau`` (list), ``steps`` (int), ``per_slot`` (list over
    slots 1..block_size-1, None for a slot never drafted), ``histogram`` (list over a = 1..block_size,
    shares summing to 1).
    """
    steps = [len(r) for r in row_acceptance_lengths]
    hist = [0] * block_size
    drafted, passed = [0] * max(block_size - 1, 0), [0] * max(block_size - 1, 0)
    for lengths in row_acceptance_lengths:
        for a, slots in zip(lengths, drafted_slots(lengths, block_size, max_new_tokens)):
            hist[a - 1] += 1
            for k in range(slots):
                drafted[k] += 1
                passed[k] += a - 1 >= k + 1
    total = sum(hist)
    return {
        "tau": pooled_tau(num_new_tokens, steps), "row_tau": row_taus(num_new_tokens, steps), "steps": sum(steps),
        "per_slot": [p / d if d else None for p, d in zip(passed, drafted)],
        "histogram": [h / total if total else 0.0 for h in hist],
    }


def step_cost(tau: float, speedup: float) -> float:
    """c = tau / speedup: the cost of one draft+verify step in target decode steps (notes on
    speculative decoding: speedup = tau / c)."""
    return tau / speedup if speedup else float("inf")


# ----------------------------------------------------------------------------- simulated prompt lookup
# (kept from the drafter issue's benchmark: an n-gram drafter simulated against known greedy outputs)


def prompt_lookup_propose(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` draft tokens: what followed the LAST earlier occurrence of the longest suffix n-gram.

    Tries ``n = max_ngram .. min_ngram``; an occurrence must start before the suffix itself. Returns ``[]``
    when nothing matches (the step then commits only the target's token).
    """
    L = len(tokens)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def prompt_lookup_tau(prompt: list[int], continuation: list[int], block_size: int, max_new_tokens: int,
                      max_ngram: int = 3) -> list[int]:
    """Acceptance lengths of greedy verification of prompt-lookup drafts, simulated on a known greedy output.

    Mirrors ``spec_generate``: the prefill commits the first token; then every step drafts
    ``b - 1 = min(block_size, max_new_tokens - n_new) - 1`` tokens after the last committed one, accepts
    the longest prefix equal to the target's greedy continuation and commits it plus one target token.
    """
    seq = prompt + continuation
    c = len(prompt) + 1
    lengths = []
    while c < len(seq) and c - len(prompt) < max_new_tokens:
        b = min(block_size, max_new_tokens - (c - len(prompt)))
        drafts = prompt_lookup_propose(seq[:c], b - 1, max_ngram) if b > 1 else []
        acc = 0
        while acc < len(drafts) and c + acc < len(seq) and drafts[acc] == seq[c + acc]:
            acc += 1
        lengths.append(acc + 1)
        c += acc + 1
    return lengths


def repeated_ngram_share(tokens: list[int], n: int = 4) -> float:
    """Share of the n-gram occurrences of ``tokens`` that repeat an earlier n-gram (0 = none repeated)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0
