"""Interleaved measurement of contenders on one target, and the summary that turns it into a report.

Timing: every run is timed from outside on CPU time (``time.process_time``, less disturbed by other
processes on a shared machine than wall time) and wall time (device-synchronised); TTFT is the end of
the target's first forward (the prefill), seen by a forward hook that also counts the target's
forwards. Rounds interleave the contenders prompt by prompt (rotating their order), so slow drifts of
the machine hit all of them alike; ratios are taken per round and their median reported.
"""
from __future__ import annotations

import statistics
import time

import torch

from .stats import acceptance_stats, pooled_tau, step_cost

REFERENCE = "target.generate"


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class ForwardProbe:
    """Counts the target's top-level forwards and records when the first one ends (wall and CPU)."""

    def __init__(self, target, device):
        self.target, self.device = target, device
        self.forwards, self.first_wall, self.first_cpu, self._handle = 0, None, None, None

    def _hook(self, module, args, output):
        self.forwards += 1
        if self.forwards == 1:
            self.first_wall, self.first_cpu = _now(self.device), time.process_time()

    def __enter__(self):
        self._handle = self.target.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self._handle.remove()


def measure(contender, target, ids, max_new_tokens: int, sampling: dict, seed: int) -> dict:
    """One timed run of ``contender`` on ``ids`` ``(1, L)``: tokens, steps, acceptance lengths, times (s)."""
    device = ids.device
    torch.manual_seed(seed)
    with ForwardProbe(target, device) as probe:
        wall0, cpu0 = _now(device), time.process_time()
        result = contender.run(ids, max_new_tokens, sampling)
        wall1, cpu1 = _now(device), time.process_time()
    tokens, lengths = result[:2]
    n = len(tokens)
    return {"tokens": tokens, "new": n, "steps": max(probe.forwards - 1, 0), "lengths": lengths,
            "drafted": result[2] if len(result) > 2 else None,
            "wall_s": wall1 - wall0, "cpu_s": cpu1 - cpu0,
            "ttft_s": probe.first_wall - wall0, "tpot_s": (wall1 - probe.first_wall) / max(n - 1, 1)}


def interleaved(contenders, target, prompts, max_new_tokens: int, rounds: int, sampling: dict, seed: int = 0,
                progress: bool = True) -> dict:
    """``{name: [[run dict per prompt] per round]}``: every contender on every prompt, ``rounds`` times,
    interleaved prompt by prompt with the contender order rotated each time. One warm-up run each first; a
    contender with ``warm_every_prompt`` (the verify-length policy, whose cost table is measured once per
    batch and context bucket, on first use) warms up on every prompt at ``max_new_tokens``, so no
    measurement falls inside a timed round.

    Args:
        prompts: list of ``(1, L)`` LongTensors on the target's device.
    """
    from tqdm.auto import tqdm

    for c in contenders:  # warm-up: first-call allocations and lazy imports out of the timings
        warm, new = (prompts, max_new_tokens) if c.warm_every_prompt else (prompts[:1], min(8, max_new_tokens))
        for ids in warm:
            measure(c, target, ids, new, sampling, seed)
    runs = {c.name: [[None] * len(prompts) for _ in range(rounds)] for c in contenders}
    bar = tqdm(total=rounds * len(prompts) * len(contenders), disable=not progress, desc="bench", leave=False)
    for r in range(rounds):
        for p, ids in enumerate(prompts):
            shift = (r + p) % len(contenders)
            for c in contenders[shift:] + contenders[:shift]:
                runs[c.name][r][p] = measure(c, target, ids, max_new_tokens, sampling, seed + 1000 * r + p)
                bar.update()
    bar.close()
    return runs


def _median(xs):
    return statistics.median(xs) if xs else None


def summarize(runs: dict, contenders, max_new_tokens: int, clock: str = "cpu", greedy: bool = True) -> dict:
    """Per contender: tau, per-slot acceptance, histogram, per-prompt tau, TTFT, TPOT, tokens/s,
    speedup over ``target.generate`` (median of per-round ratios of time per token) and the step
    cost c = tau / speedup; ``ratios[a][b]``: median per-round ratio of a's time per token to b's.
    Greedy runs list every prompt whose tokens differ from ``target.generate``'s in the same round."""
    key = f"{clock}_s"
    per_token = {name: [sum(run[key] for run in rnd) / max(sum(run["new"] for run in rnd), 1) for rnd in rounds]
                 for name, rounds in runs.items()}
    base = per_token.get(REFERENCE)
    out = {}
    for c in contenders:
        rounds = runs[c.name]
        flat = [run for rnd in rounds for run in rnd]
        entry = {"tau": pooled_tau([x["new"] for x in flat], [x["steps"] for x in flat]),
                 "row_tau": [pooled_tau([rnd[p]["new"] for rnd in rounds], [rnd[p]["steps"] for rnd in rounds])
                             for p in range(len(rounds[0]))],
                 "ttft_s": _median([x["ttft_s"] for x in flat]), "tpot_s": _median([x["tpot_s"] for x in flat]),
                 "time_per_token_s": _median(per_token[c.name]), "per_round_time_per_token_s": per_token[c.name],
                 "new_tokens": sum(x["new"] for x in rounds[0])}
        entry["tokens_per_s"] = 1 / entry["time_per_token_s"] if entry["time_per_token_s"] else None
        if c.block_size and all(x["lengths"] is not None for x in flat):
            acc = acceptance_stats([x["lengths"] for x in flat], [x["new"] for x in flat], c.block_size, max_new_tokens)
            entry.update(per_slot=acc["per_slot"], histogram=acc["histogram"])
        if flat and all(x.get("drafted") is not None for x in flat):
            entry.update(drafting_stats([x["lengths"] for x in flat], [x["drafted"] for x in flat], len(rounds)))
        if base is not None:
            entry["speedup"] = _median([b / t for b, t in zip(base, per_token[c.name])])
            entry["c"] = step_cost(entry["tau"], entry["speedup"])
        if greedy and c.name != REFERENCE and REFERENCE in runs:
            entry["mismatches"] = [p for rnd, ref in zip(rounds, runs[REFERENCE]) for p, (x, y) in
                                   enumerate(zip(rnd, ref)) if x["tokens"] != y["tokens"]]
        out[c.name] = entry
    ratios = {a: {b: _median([x / y for x, y in zip(per_token[a], per_token[b])]) for b in per_token} for a in per_token}
    return {"contenders": out, "ratios": ratios, "clock": clock}


def drafting_stats(lengths: list, drafted: list, rounds: int = 1) -> dict:
    """From per-run step lists (tokens committed per verify step, drafted positions per step): ``tau_drafting``
    (tokens per step over the steps that drafted), ``plain_steps`` (steps that verified no drafted position,
    per round) and ``verified_per_step`` (target positions per verify step, anchor included)."""
    pairs = [(a, d) for ls, ds in zip(lengths, drafted) for a, d in zip(ls, ds)]
    drafting = [a for a, d in pairs if d > 0]
    return {"tau_drafting": sum(drafting) / len(drafting) if drafting else None,
            "plain_steps": sum(d == 0 for _, d in pairs) / max(rounds, 1),
            "verified_per_step": sum(d + 1 for _, d in pairs) / len(pairs) if pairs else None}


def table(summary: dict) -> str:
    """Markdown table of a summary."""
    lines = ["| contender | tau | speedup vs target.generate | c = tau / speedup | tok/s | TTFT ms | TPOT ms | "
             "tau (drafting steps) | verified per step |", "|---|---|---|---|---|---|---|---|---|"]
    for name, e in summary["contenders"].items():
        sp, c, td, vp = e.get("speedup"), e.get("c"), e.get("tau_drafting"), e.get("verified_per_step")
        lines.append(f"| {name} | {e['tau']:.2f} | {'-' if sp is None else f'{sp:.2f}x'} | "
                     f"{'-' if c is None else f'{c:.2f}'} | {e['tokens_per_s']:.1f} | {1e3 * e['ttft_s']:.1f} | "
                     f"{1e3 * e['tpot_s']:.2f} | {'-' if td is None else f'{td:.2f}'} | "
                     f"{'-' if vp is None else f'{vp:.2f}'} |")
    return "\n".join(lines)


def plot(report: dict, path) -> None:
    """PNG: speedup and c per contender, per-slot acceptance, and the prompt-length sweep (matplotlib, lazily)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = report["main"]["contenders"]
    batches = (report.get("batches") or {}).get("sizes")
    fig, axes = plt.subplots(1, 4 if batches else 3, figsize=(20 if batches else 15, 4.2))
    names = list(main)
    axes[0].bar(names, [main[n].get("speedup") or 0 for n in names])
    axes[0].set_ylabel("speedup vs target.generate")
    axes[0].tick_params(axis="x", rotation=30)
    for n in names:
        if main[n].get("per_slot"):
            axes[1].plot(range(1, len(main[n]["per_slot"]) + 1), main[n]["per_slot"], marker=".", label=n)
    axes[1].set_xlabel("draft slot k")
    axes[1].set_ylabel("P(slot k accepted | drafted)")
    axes[1].legend(fontsize=7)
    sweep = report.get("sweep") or {}
    for n in names:
        pts = [(int(L), s["contenders"][n].get("speedup")) for L, s in sweep.items() if n in s["contenders"]]
        if pts:
            axes[2].plot(*zip(*pts), marker="o", label=n)
    axes[2].set_xlabel("prompt length (tokens)")
    axes[2].set_ylabel("speedup vs target.generate")
    if sweep:
        axes[2].legend(fontsize=7)
    if batches:
        for n in sorted({n for v in batches.values() for n in v["contenders"]}):
            pts = [(int(s), v["contenders"][n]["tokens_per_s"]) for s, v in batches.items() if n in v["contenders"]]
            axes[3].plot(*zip(*pts), marker="o", label=n)
        axes[3].set_xscale("log", base=2)
        axes[3].set_xlabel("batch size (left-padded held-out prompts)")
        axes[3].set_ylabel("tokens/s of the whole batch")
        axes[3].legend(fontsize=7)
    fig.suptitle(report.get("title", "DFlash benchmark"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
