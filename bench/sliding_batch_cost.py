"""Per-step cost of exact sliding windows in ragged batches (prints figures; not a test).

Times one verify forward of a sliding-window target (Mistral-style, every layer windowed) at
block 16 over a committed context, three ways, on the same weights:

* batch 1 (transformers builds its own mask);
* a batch of B rows with holes, with the explicit 4-D masks that count the window in true positions
  (``target_families.target_mask``), per row;
* the mask construction alone;
* the same batch with the plain 2-D validity mask (what ran before; not exact), for the overhead.

Usage: python bench/sliding_batch_cost.py [--hidden 256] [--layers 4] [--context 512] [--batch 4]
"""

import argparse
import os
import sys
import time

import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import target_families  # noqa: E402


def _time(fn, repeat):
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=1000, hidden_size=a.hidden, intermediate_size=a.hidden * 3, num_hidden_layers=a.layers,
                        num_attention_heads=a.hidden // 64, num_key_value_heads=max(1, a.hidden // 256),
                        sliding_window=a.window, max_position_embeddings=4096)
    model = MistralForCausalLM(cfg).eval()
    windows = target_families.layer_windows(model)
    kw = "cache" if "cache" in model.forward.__code__.co_varnames else "past_key_values"

    def verify(bsz, holes, windows=windows):
        ctx = torch.randint(0, 1000, (bsz, a.context))
        valid = torch.ones(bsz, a.context, dtype=torch.long)
        if holes:  # each row owns a different number of the last slots (rejected drafts of other rows)
            for r in range(bsz):
                valid[r, a.context - 3 * r - 1: a.context] = 0 if r else 1
        pos_ctx = (valid.cumsum(1) - 1).clamp_min(0)
        cache = DynamicCache()
        with torch.no_grad():
            mask = target_families.target_mask(windows, valid, pos_ctx, valid[:, :0])
            model(input_ids=ctx, position_ids=pos_ctx, attention_mask=mask, use_cache=True, **{kw: cache})
        start = valid.sum(1)
        block = torch.randint(0, 1000, (bsz, a.block))
        positions = start[:, None] + torch.arange(a.block)
        length = cache.get_seq_length()

        def step():
            with torch.no_grad():
                m = target_families.target_mask(windows, torch.ones_like(block), positions, valid)
                model(input_ids=block, position_ids=positions, attention_mask=m, use_cache=True, **{kw: cache})
                cache.crop(-(cache.get_seq_length() - length)) if cache.get_seq_length() > length else None

        def mask_only():
            target_families.target_mask(windows, torch.ones_like(block), positions, valid)

        return step, mask_only

    one, _ = verify(1, holes=False)
    many, mask_only = verify(a.batch, holes=True)
    plain, _ = verify(a.batch, holes=True, windows={})  # the 2-D validity mask: NOT exact (window in slots)
    t1, tb, tm, tp = _time(one, a.repeat), _time(many, a.repeat), _time(mask_only, a.repeat), _time(plain, a.repeat)
    print(f"Mistral-style target: hidden {a.hidden}, {a.layers} layers, window {a.window}, context {a.context}, "
          f"block {a.block}, {a.threads} thread(s)")
    print(f"batch 1 verify step            : {t1:7.2f} ms")
    print(f"batch {a.batch} ragged verify step     : {tb:7.2f} ms  ({tb / a.batch:.2f} ms per row, "
          f"{tb / a.batch / t1:.2f}x batch 1 per row)")
    print(f"  of which the exact 4-D masks : {tm:7.2f} ms  ({100 * tm / tb:.1f}% of the step)")
    print(f"same batch, plain 2-D mask     : {tp:7.2f} ms  (inexact: the window counts cache slots)")


if __name__ == "__main__":
    main()
