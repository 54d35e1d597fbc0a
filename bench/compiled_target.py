"""Speed of a COMPILED target with and without DFlash (prints figures; not a test).

The target's forward is compiled the way the transformers docs show
(``model.forward = torch.compile(model.forward, ...)``); then, on the shipped pair (``pair/target`` +
``pair/drafter``) and held-out prompts, greedy tokens/s of ``target.generate`` and of
``draft.spec_generate(target=...)`` (whose taps then come from the compiled forward's own hidden
states, ``target_taps.run_target``), each after one warm-up call that pays the compiles, plus the
uncompiled target alone for reference. Outputs are checked equal.

Usage: python bench/compiled_target.py [--backend inductor|eager] [--num-prompts 4] [--new 128]
       [--fullgraph] [--threads 1] [--device cpu]
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.prompts import local_prompts  # noqa: E402
from convert.loading import load_pair  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(fn, prompts, new, device):
    """(new tokens per second, outputs) over ``prompts``; ``fn(ids, new)`` returns the full sequence."""
    outs, tokens = [], 0
    _sync(device)
    start = time.perf_counter()
    for ids in prompts:
        out = fn(ids, new)
        outs.append(out)
        tokens += out.shape[1] - ids.shape[1]
    _sync(device)
    return tokens / (time.perf_counter() - start), outs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", default=os.path.join(ROOT, "pair", "target"))
    p.add_argument("--draft", default=os.path.join(ROOT, "pair", "drafter"))
    p.add_argument("--prompts", default=os.path.join(ROOT, "pair", "heldout_prompts.json"))
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--fullgraph", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    draft, target, tok = load_pair(a.target, a.draft, device, torch.float32)
    prompts = [tok(x["turns"][0], return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
               for x in local_prompts(a.prompts, a.num_prompts)]
    greedy = dict(do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=target.generation_config.eos_token_id)

    def alone(ids, n):
        return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, **greedy)

    def dflash(ids, n):
        return draft.spec_generate(target, ids, max_new_tokens=n, adaptive_block_size=False, **greedy)

    alone(prompts[0], 8)
    eager_rate, ref = _rate(alone, prompts, a.new, device)
    target.forward = torch.compile(target.forward, backend=a.backend, fullgraph=a.fullgraph, dynamic=True)
    results = {}
    for name, fn in (("target.generate", alone), ("spec_generate", dflash)):
        start = time.perf_counter()
        fn(prompts[0], a.new)  # warm-up: the compiles
        warm = time.perf_counter() - start
        rate, outs = _rate(fn, prompts, a.new, device)
        same = all(torch.equal(o, r) for o, r in zip(outs, ref))
        results[name] = rate
        print(f"compiled ({a.backend}, fullgraph={a.fullgraph}) {name}: {rate:.1f} tok/s "
              f"(warm-up {warm:.1f}s), outputs equal to the eager target's: {same}")
    print(f"eager target.generate: {eager_rate:.1f} tok/s | compiled target: DFlash "
          f"{results['spec_generate'] / results['target.generate']:.2f}x its own generate, "
          f"{results['spec_generate'] / eager_rate:.2f}x the eager target | {a.num_prompts} prompts x {a.new} "
          f"new tokens, {device}, float32, {torch.get_num_threads()} thread(s)")


if __name__ == "__main__":
    main()
