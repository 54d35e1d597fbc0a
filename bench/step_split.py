"""Where one decoding step's time goes: the target forward, the draft forward, and the glue around them.

    python -m bench.step_split                                   # the package's loop on the shipped pair
    python -m bench.step_split --reference-dir REFERENCE_DIR    # + the authors' loop, interleaved
    python -m bench.step_split --baseline OLD_DRAFTER_DIR      # + a drafter folder with its own (older) code
    python bench/step_split.py --num-prompts 1 --max-new-tokens 16

Every run is greedy at one block size on the held-out prompts (``pair/heldout_prompts.json``, the
benchmark's), one torch thread. Forward pre/post hooks on the target and on the drafter module read
``time.thread_time()`` (CPU time of this thread: other processes on a shared machine barely move it), so
the loops' own code is timed without being edited. Per run, after the prefill (the target's first forward):

* target: the target's verify forwards (its top-level ``forward``, LM head included);
* draft: the drafter module's forwards (the authors call ``target.lm_head`` on its output outside it, as
  the package does, so the draft head is glue on both sides);
* glue: the decode time less both: building blocks, acceptance, commit, cache crops, feature concats.

Figures are per verify step (target forwards less the prefill), pooled over the prompts of a round; the
package / authors ratio is the median of per-round ratios (the two loops alternate prompt by prompt,
in rotated order; ``--baseline``: the same with a drafter folder carrying the package's code before a
change, for before/after figures on a loaded machine). Writes a JSON report (``--out``) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python bench/step_split.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import contenders as C  # noqa: E402
from bench.prompts import HELDOUT, encode, local_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("step", "target", "draft", "glue")


class ForwardClock:
    """Thread time spent inside ``module``'s forward calls: one entry per call, in seconds."""

    def __init__(self, module):
        self.calls, self._start = [], None
        self.ends = []
        self._handles = [module.register_forward_pre_hook(self._enter), module.register_forward_hook(self._leave)]

    def _enter(self, module, args):
        self._start = time.thread_time()

    def _leave(self, module, args, output):
        end = time.thread_time()
        self.calls.append(end - self._start)
        self.ends.append(end)

    def reset(self):
        self.calls, self.ends = [], []

    def remove(self):
        for h in self._handles:
            h.remove()


def split(run, target_clock: ForwardClock, draft_clock: ForwardClock) -> dict:
    """Run ``run()`` once; returns its decode split in seconds (sums) and its verify steps.

    The decode starts where the target's first forward (the prefill) ends and lasts until ``run`` returns."""
    target_clock.reset()
    draft_clock.reset()
    run()
    end = time.thread_time()
    if len(target_clock.calls) < 2:
        return {"steps": 0, **{p: 0.0 for p in PARTS}}
    decode = end - target_clock.ends[0]
    target, draft = sum(target_clock.calls[1:]), sum(draft_clock.calls)
    return {"steps": len(target_clock.calls) - 1, "step": decode, "target": target, "draft": draft,
            "glue": decode - target - draft}


def _package_run(draft, target, ids, new, block_size):
    return lambda: draft.spec_generate(target, ids, max_new_tokens=new, block_size=block_size, do_sample=False,
                                       adaptive_block_size=False)


def _reference_run(generate_fn, model, target, ids, new, block_size):
    eos = target.generation_config.eos_token_id
    stop = None if eos is None else (eos if isinstance(eos, list) else [eos])

    def run():
        with C.positive_crop_patch():
            generate_fn(model, target, ids, new, stop, 0.0, block_size=block_size)
    return run


def per_step(runs: list) -> dict:
    """Milliseconds per verify step of each part, pooled over ``runs``."""
    steps = sum(r["steps"] for r in runs)
    return {p: 1e3 * sum(r[p] for r in runs) / max(steps, 1) for p in PARTS} | {"steps": steps}


def measure(loops: dict, target, prompts, new: int, block_size: int, rounds: int) -> dict:
    """``{loop: [per-round per_step dict]}``: the loops alternate prompt by prompt, order rotated.

    Args:
        loops: name -> ``(drafter module to clock, factory(ids, new, block_size) -> callable)``.
    """
    target_clock = ForwardClock(target)
    clocks = {name: ForwardClock(module) for name, (module, _) in loops.items()}
    names = list(loops)
    try:
        for name in names:  # warm-up: first-call allocations out of the figures
            split(loops[name][1](prompts[0], min(8, new), block_size), target_clock, clocks[name])
        out = {name: [] for name in names}
        for r in range(rounds):
            runs = {name: [] for name in names}
            for p, ids in enumerate(prompts):
                shift = (r + p) % len(names)
                for name in names[shift:] + names[:shift]:
                    runs[name].append(split(loops[name][1](ids, new, block_size), target_clock, clocks[name]))
            for name in names:
                out[name].append(per_step(runs[name]))
        return out
    finally:
        target_clock.remove()
        for c in clocks.values():
            c.remove()


def summarize(rounds: dict) -> dict:
    """Per loop: the median over rounds of each part (ms per step); ``ratio package/<other>`` for every other
    loop: per part, the median of per-round ratios."""
    out = {name: {p: statistics.median(r[p] for r in rs) for p in PARTS} | {"steps": rs[0]["steps"]}
           for name, rs in rounds.items()}
    first, *others = list(rounds)
    for other in others:
        a, b = rounds[first], rounds[other]
        out[f"ratio {first}/{other}"] = {p: statistics.median(x[p] / y[p] for x, y in zip(a, b) if y[p]) for p in PARTS}
    return out


def table(summary: dict) -> str:
    lines = ["| loop | step ms | target ms | draft ms | glue ms | steps per round |", "|---|---|---|---|---|---|"]
    for name, e in summary.items():
        if name.startswith("ratio"):
            lines.append(f"| {name} (median per round) | " + " | ".join(f"{e[p]:.3f}" for p in PARTS) + " | |")
        else:
            lines.append(f"| {name} | " + " | ".join(f"{e[p]:.2f}" for p in PARTS) + f" | {e['steps']} |")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.step_split", description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "pair" / "target"))
    ap.add_argument("--draft", default=str(ROOT / "pair" / "drafter"))
    ap.add_argument("--prompts", default=str(HELDOUT))
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reference-dir", help="local copy of the authors' repository (the folder holding dflash/)")
    ap.add_argument("--baseline", help="a drafter folder with its own (older) remote code, run as a third loop")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="step_split.json", help="'' for none")
    args = ap.parse_args(argv)
    for flag in ("num_prompts", "max_new_tokens", "block_size", "rounds", "threads"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.baseline and not (Path(args.baseline) / "config.json").is_file():
        ap.error(f"--baseline {args.baseline}: no config.json there; pass a drafter folder")
    if args.reference_dir and not (Path(args.reference_dir) / "dflash" / "model.py").is_file():
        ap.error(f"--reference-dir {args.reference_dir}: expected a copy of the authors' repository (with dflash/model.py)")
    return args


def run(args) -> dict:
    """Load the pair, measure, print the table, write ``--out``; returns the report."""
    from convert.cli import quiet_loading
    from convert.loading import load_pair, model_load_kwargs

    torch.set_num_threads(args.threads)
    quiet_loading()
    device, dtype = torch.device("cpu"), torch.float32
    draft, target, tok = load_pair(args.target, args.draft, device, dtype)
    records = local_prompts(args.prompts, args.num_prompts)
    prompts = [torch.tensor([encode(tok, r["turns"][0])]) for r in records]
    loops = {"package": (draft, lambda ids, n, b: _package_run(draft, target, ids, n, b))}
    if args.baseline:
        from transformers import AutoModel

        old = AutoModel.from_pretrained(args.baseline, trust_remote_code=True, dtype=dtype, **model_load_kwargs()).eval()
        loops["baseline"] = (old, lambda ids, n, b: _package_run(old, target, ids, n, b))
    if args.reference_dir:
        fn, ref = C.load_reference(args.reference_dir, args.draft, dtype, device)
        loops["authors"] = (ref, lambda ids, n, b: _reference_run(fn, ref, target, ids, n, b))
    rounds = measure(loops, target, prompts, args.max_new_tokens, args.block_size, args.rounds)
    summary = summarize(rounds)
    report = {"settings": {k: v for k, v in vars(args).items() if k not in ("reference_dir", "baseline")},
              "threads": torch.get_num_threads(), "clock": "time.thread_time", "rounds": rounds, "summary": summary}
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, block {args.block_size}, greedy, "
          f"{args.rounds} round(s), {torch.get_num_threads()} thread(s), ms per verify step (thread time)")
    print(table(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
