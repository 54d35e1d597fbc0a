"""Batched decoding in the benchmark (``--batch-sizes``): ragged batches of the held-out prompts, left padded,
the package's ``spec_generate`` at each block size against batched ``target.generate`` (and prompt lookup
where this transformers decodes that batch size with it; it refuses batches > 1 as assisted generation).

Per batch size and contender: tokens per second of the whole batch (all rows' new tokens over the
batch's time on the benchmark's clock), tau per row (that row's new tokens over the batch's verify steps
while it ran: ``row_acceptance_lengths``), the time per target forward after the prefill (the per-step
cost), and the speedup over ``target.generate`` (median of per-round ratios of time per token). Then the
crossover (the smallest batch size from which no package block size beats ``target.generate``) and the
best block size per batch size. Greedy outputs are compared with ``target.generate``'s row by row; rows
that differ are listed (in fp32 a batch differs from the row alone only by summation order).
"""
from __future__ import annotations

import statistics
import time

import torch

from .contenders import fixed_unless_asked
from .core import REFERENCE, ForwardProbe, _now, drafting_stats


def left_pad(rows: list, pad: int, device) -> tuple:
    """``(ids (B, L), attention_mask (B, L))`` of token lists ``rows`` left padded with ``pad`` to the longest."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


def batches_of(prompts: list, size: int) -> list:
    """Consecutive groups of ``size`` prompts (token lists); a last short group is dropped unless it is the only one."""
    groups = [prompts[i: i + size] for i in range(0, len(prompts), size)]
    return [g for g in groups if len(g) == size] or groups[:1]


def _cut(row: list, eos: set) -> list:
    for i, t in enumerate(row):
        if t in eos:
            return row[: i + 1]
    return row


def generate_contender(target, kw: dict, **extra):
    """Batched ``target.generate``: returns (new tokens per row, None)."""
    eos = kw["eos_token_id"]
    stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    def run(ids, mask, max_new_tokens):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, **kw, **extra)
        return [_cut(row, stops) for row in out[:, ids.shape[1]:].tolist()], None
    return run


def package_contender(draft, target, block_size: int, kw: dict):
    """Batched ``spec_generate`` at ``block_size``, fixed blocks unless ``kw`` asks otherwise
    (``contenders.fixed_unless_asked``): returns (new tokens per row, acceptance lengths per row, drafted positions per row)."""
    kw = fixed_unless_asked(kw)

    def run(ids, mask, max_new_tokens):
        out = draft.spec_generate(target, ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                  block_size=block_size, return_dict_in_generate=True, **kw)
        rows = [out.sequences[i, ids.shape[1]:][: n].tolist() for i, n in enumerate(out.num_new_tokens)]
        return rows, out.row_acceptance_lengths, out.row_draft_lengths
    return run


def _measure(run, target, ids, mask, max_new_tokens, clock, seed) -> dict:
    device = ids.device
    torch.manual_seed(seed)
    with ForwardProbe(target, device) as probe:
        wall0, cpu0 = _now(device), time.process_time()
        result = run(ids, mask, max_new_tokens)
        wall1, cpu1 = _now(device), time.process_time()
    rows, lengths = result[:2]
    drafted = result[2] if len(result) > 2 else None
    spent = (cpu1 - cpu0) if clock == "cpu" else (wall1 - wall0)
    first = (probe.first_cpu - cpu0) if clock == "cpu" else (probe.first_wall - wall0)
    return {"rows": rows, "lengths": lengths, "drafted": drafted, "new": sum(len(r) for r in rows), "time_s": spent,
            "steps": max(probe.forwards - 1, 0), "decode_s": spent - first}


def run_batches(sizes: list, contenders: dict, target, prompts: list, pad: int, max_new_tokens: int, rounds: int,
                clock: str, greedy: bool, seed: int = 0) -> dict:
    """``{"sizes": {B: summary}, "crossover": B or None, "best_block": {B: b}}``.

    Args:
        contenders: name -> ``(run(ids, mask, max_new_tokens), block size or None, batch sizes it supports or None)``.
        prompts: token lists (the held-out prompts, in order).
    """
    device = next(target.parameters()).device
    out = {}
    for size in sizes:
        groups = [left_pad(g, pad, device) for g in batches_of(prompts, size)]
        names = [n for n, (_, _, ok) in contenders.items() if ok is None or size in ok]
        for n in names:  # warm-up at this shape and length: the policy's cost table for it is measured here
            _measure(contenders[n][0], target, groups[0][0], groups[0][1], max_new_tokens, clock, seed)
        runs = {n: [] for n in names}
        for r in range(rounds):
            per = {n: [] for n in names}
            for g, (ids, mask) in enumerate(groups):
                shift = (r + g) % len(names)
                for n in names[shift:] + names[:shift]:
                    per[n].append(_measure(contenders[n][0], target, ids, mask, max_new_tokens, clock, seed + r))
            for n in names:
                runs[n].append(per[n])
        out[str(size)] = _summarize(runs, contenders, greedy, len(groups), size)
        skipped = [n for n in contenders if n not in names]
        if skipped:
            out[str(size)]["unsupported"] = skipped
    best = {s: _best(v["contenders"]) for s, v in out.items()}
    crossover = next((int(s) for s, v in out.items() if not any(
        (e.get("speedup") or 0) > 1 for n, e in v["contenders"].items() if e.get("block_size"))), None)
    return {"sizes": out, "crossover": crossover, "best_block": best}


def _best(entries: dict):
    scored = [(e["speedup"], e["block_size"]) for e in entries.values() if e.get("block_size") and e.get("speedup")]
    return max(scored)[1] if scored else None


def _summarize(runs: dict, contenders: dict, greedy: bool, n_batches: int, size: int) -> dict:
    per_token = {n: [sum(x["time_s"] for x in rnd) / max(sum(x["new"] for x in rnd), 1) for rnd in rs]
                 for n, rs in runs.items()}
    base = per_token.get(REFERENCE)
    entries = {}
    for n, rs in runs.items():
        flat = [x for rnd in rs for x in rnd]
        e = {"block_size": contenders[n][1], "batches": n_batches, "batch_size": size,
             "tokens_per_s": 1 / statistics.median(per_token[n]) if statistics.median(per_token[n]) else None,
             "step_ms": 1e3 * statistics.median(sum(x["decode_s"] for x in rnd) / max(sum(x["steps"] for x in rnd), 1)
                                                for rnd in rs),
             "steps": sum(x["steps"] for x in rs[0]), "new_tokens": sum(x["new"] for x in rs[0])}
        if flat and flat[0]["lengths"] is not None:
            e["row_tau"] = [sum(lengths) / max(len(lengths), 1) for x in rs[0] for lengths in x["lengths"]]
            e["tau"] = statistics.mean(e["row_tau"])
        if flat and flat[0].get("drafted") is not None:
            e.update(drafting_stats([ls for x in flat for ls in x["lengths"]], [ds for x in flat for ds in x["drafted"]],
                                    len(rs)))
        if base is not None:
            e["speedup"] = statistics.median(b / t for b, t in zip(base, per_token[n]))
        if greedy and n != REFERENCE and REFERENCE in runs:
            e["mismatched_rows"] = sum(a != b for rnd, ref in zip(rs, runs[REFERENCE]) for x, y in zip(rnd, ref)
                                       for a, b in zip(x["rows"], y["rows"]))
        entries[n] = e
    return {"contenders": entries}


def table(batches: dict) -> str:
    lines = ["| batch | contender | tok/s (batch) | speedup vs target.generate | tau (mean of rows) | ms per step | "
             "tau (drafting steps) | verified per step |", "|---|---|---|---|---|---|---|---|"]
    for size, v in batches["sizes"].items():
        for n, e in v["contenders"].items():
            sp, tau, td, vp = e.get("speedup"), e.get("tau"), e.get("tau_drafting"), e.get("verified_per_step")
            lines.append(f"| {size} | {n} | {e['tokens_per_s']:.1f} | {'-' if sp is None else f'{sp:.2f}x'} | "
                         f"{'-' if tau is None else f'{tau:.2f}'} | {e['step_ms']:.2f} | "
                         f"{'-' if td is None else f'{td:.2f}'} | {'-' if vp is None else f'{vp:.2f}'} |")
        if v.get("unsupported"):
            lines.append(f"| {size} | {', '.join(v['unsupported'])} | unsupported at this batch size | | | |")
    lines.append(f"\ncrossover (smallest batch size where no block size beats target.generate): {batches['crossover']}; "
                 f"best block size per batch size: {batches['best_block']}")
    return "\n".join(lines)
