"""The first call's cost against the second (issue 49 "Cheap and visible"): in a fresh process on an empty
cache folder, ``spec_generate``'s default at a batch and prompt length, called twice on the same inputs; prints
``first - second`` wall seconds and both calls' times, per shape. What a first call pays beyond the second is
the device constants' measurement (a few raw matmuls, once per machine) and whatever the policy decides before
it has learned anything.

    python bench/first_call.py [--batches 1 4 16 32] [--contexts 64 512 2048] [--new 64] [--processes 3]

Each shape runs in ``--processes`` fresh processes, each with its own empty ``DFLASH_HF_CACHE``; the table
gives the median over them. Shipped pair, fp32, one thread, greedy.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_shape(batch: int, context: int, new: int, fixed: int = 0) -> dict:
    """Run in a fresh process: two calls of the same shape (the default, or ``fixed`` blocks); wall seconds."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    torch.set_num_threads(1)
    pair = os.path.join(ROOT, "pair")
    draft = AutoModel.from_pretrained(os.path.join(pair, "drafter"), trust_remote_code=True, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(os.path.join(pair, "target"), dtype=torch.float32).eval()
    ids = torch.randint(5, target.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(2):
        t = time.perf_counter()
        draft.spec_generate(target, ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, temperature=0.0,
                            adaptive_block_size=False if fixed else None)
        times.append(time.perf_counter() - t)
    return {"first": times[0], "second": times[1]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--one", nargs=4, type=int, help=argparse.SUPPRESS)  # batch context new fixed: the child
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one_shape(*args.one)))
        return 0
    print("| batch | context | default: first - second, s | first, s | second, s | max(1 s, 10% of second) "
          "| fixed blocks: first - second, s |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batches:
        for context in args.contexts:
            runs = {0: [], 1: []}
            for _ in range(args.processes):
                for fixed in (0, 1):  # interleaved: the default, then fixed blocks, each in a fresh process
                    with tempfile.TemporaryDirectory() as cache:
                        env = dict(os.environ, DFLASH_HF_CACHE=cache)
                        env.pop("DFLASH_VERIFY_COST", None)
                        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", str(batch),
                                              str(context), str(args.new), str(fixed)], env=env, capture_output=True,
                                             text=True, check=True)
                        runs[fixed].append(json.loads(out.stdout.strip().splitlines()[-1]))
            gap, fixed_gap = (statistics.median(r["first"] - r["second"] for r in runs[f]) for f in (0, 1))
            first = statistics.median(r["first"] for r in runs[0])
            second = statistics.median(r["second"] for r in runs[0])
            print(f"| {batch} | {context} | {gap:.2f} | {first:.2f} | {second:.2f} | {max(1.0, 0.1 * second):.2f} "
                  f"| {fixed_gap:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
