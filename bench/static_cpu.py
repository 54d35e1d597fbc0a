"""The static loop against the dynamic loop on the shipped pair (prints one JSON line; not a test).

    python -m bench.static_cpu [--prompts 6] [--new 128] [--rounds 3] [--threads 1] [--compile none,eager,inductor]

Greedy, batch 1, fp32, on the device of ``--device`` (default CPU). Per prompt and round, in an order rotated
each time: ``target.generate``, ``spec_generate`` (dynamic loop), ``spec_generate(cache_implementation="static")``
uncompiled, and for each ``--compile`` backend the static loop with ``CompileConfig(backend=...)``. Every
contender runs once on the first prompt before timing (warm-up: compilation, first allocations; its seconds are
reported apart as ``warmup_s``). Cost is ``time.thread_time()`` (CPU seconds of this thread, robust to other
jobs on the machine; with ``--threads 1`` torch computes on this thread), summed over the prompts of a round;
``speedup`` is the median over rounds of target seconds / contender seconds, ``vs_dynamic`` the same against the
dynamic loop. Outputs are checked identical to ``target.generate``. Source of the question: issue 27 part 2.
"""

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, CompileConfig

from convert.loading import model_load_kwargs
from .prompts import HELDOUT, encode, local_prompts
from .cli import ROOT


def contenders(draft, target, backends):
    def spec(**kw):
        return lambda ids, n: draft.spec_generate(target, ids, max_new_tokens=n, temperature=0.0, stop_token_ids=[],
                                                  **{"adaptive_block_size": False, **kw})  # fixed blocks, both loops

    out = {"target.generate": lambda ids, n: target.generate(ids, attention_mask=torch.ones_like(ids),
                                                             max_new_tokens=n, do_sample=False, eos_token_id=None),
           "dynamic": spec(), "static": spec(cache_implementation="static")}
    for backend in backends:
        out[f"static+{backend}"] = spec(cache_implementation="static", compile_config=CompileConfig(backend=backend))
    return out


def timed(fn, ids, n):
    start = time.thread_time()
    out = fn(ids, n)
    return time.thread_time() - start, out[0, ids.shape[1]:ids.shape[1] + n].tolist()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.static_cpu", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", default="", help="CompileConfig backends for the static loop, comma separated")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    target = AutoModelForCausalLM.from_pretrained(ROOT / "pair" / "target", dtype=torch.float32,
                                                  **model_load_kwargs()).to(device).eval()
    draft = AutoModel.from_pretrained(ROOT / "pair" / "drafter", trust_remote_code=True,
                                      dtype=torch.float32).to(device).eval()
    tok = AutoTokenizer.from_pretrained(ROOT / "pair" / "target")
    prompts = [torch.tensor([encode(tok, r["prompt"])], device=device) for r in local_prompts(HELDOUT, args.prompts)]
    runs = contenders(draft, target, [b for b in args.compile.split(",") if b.strip()])
    names = list(runs)
    warmup = {name: timed(fn, prompts[0], args.new)[0] for name, fn in runs.items()}
    seconds = {name: [0.0] * args.rounds for name in names}
    mismatches = {name: 0 for name in names}
    for r in range(args.rounds):
        for p, ids in enumerate(prompts):
            shift = (r + p) % len(names)
            outs = {}
            for name in names[shift:] + names[:shift]:
                s, outs[name] = timed(runs[name], ids, args.new)
                seconds[name][r] += s
            mismatches = {n: mismatches[n] + (outs[n] != outs["target.generate"]) for n in names}

    def median_ratio(base, name):
        return round(statistics.median(b / s for b, s in zip(seconds[base], seconds[name])), 3)

    print(json.dumps({"prompts": len(prompts), "new_tokens": args.new, "rounds": args.rounds,
                      "threads": torch.get_num_threads(), "device": str(device), "clock": "thread_time",
                      "seconds_per_round": {n: round(statistics.median(v), 3) for n, v in seconds.items()},
                      "speedup": {n: median_ratio("target.generate", n) for n in names},
                      "vs_dynamic": {n: median_ratio("dynamic", n) for n in names},
                      "warmup_s": {n: round(v, 2) for n, v in warmup.items()}, "mismatches": mismatches}))


if __name__ == "__main__":
    main()
