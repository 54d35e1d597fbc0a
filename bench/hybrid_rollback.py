"""Per-step cost of exact hybrid rollback, against a dense target of the same size.

    python bench/hybrid_rollback.py [--device cpu] [--threads 1] [--steps 24] [--block 16]

Two random fp32 targets with the same hidden size, layer count, heads and MLP: a Qwen3 (all full
attention) and a Qwen3.5 hybrid (3 Gated DeltaNet layers per full-attention layer, as the published
stacks). Each runs the target side of a spec_generate step, ``steps`` times after a 256-token
prefill: the verify forward of a ``block``-token block (for the hybrid with the snapshot + input
recording of ``target_cache.recording``), then the rollback to a committed count that cycles
through 1 .. block (the attention crop, and for the hybrid the per-row replay of
``restore_linear_states``). Prints mean milliseconds per step for each part and the ratios. The
hybrid's verify forward itself is slower than the dense one on CPU because transformers falls back
to its PyTorch gated-delta kernels without flash-linear-attention; the rollback overhead is reported
relative to the hybrid's own verify forward as well.

On transformers >= 5.25 a third row times that library's own rollback on the same hybrid target, at batch 1
(its one count per cache cannot serve rows that keep different counts): ``activate_past_recording(
recurrent_states_to_keep=block)`` makes the verify forward keep the recurrent state after each of the
block's tokens (the chunked kernel runs on none of them: the block goes token by token) and the conv inputs,
and ``crop`` picks the state of the committed length. Its states after the last step are checked against the
replay's (``max |diff|`` printed). This is the measurement behind ``target_cache``'s choice of replay.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import transformers  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from decode_step import _cache_kwarg, crop_cache  # noqa: E402
from target_cache import new_target_cache, recording, restore_linear_states  # noqa: E402

SIZE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4,
              linear_num_value_heads=8, layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
              + ["full_attention"])


def _sync(device):
    """Seconds: device-synchronised wall clock on CUDA; this process's CPU time on CPU (with one thread that
    is the work done, and other processes on a shared machine do not inflate it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time()


@torch.no_grad()
def measure(target, device, steps, block, prompt_len=256, keep=None):
    """Mean seconds per step: (verify forward, rollback); ``keep`` (a list) receives the cache."""
    kw = _cache_kwarg(target)
    cache = new_target_cache(target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SIZE["vocab_size"], (1, prompt_len), generator=g).to(device)
    target(input_ids=ids, use_cache=True, **{kw: cache})
    verify = rollback = 0.0
    for step in range(steps + 2):  # two warm-up steps
        start = cache.get_seq_length()
        tokens = torch.randint(0, SIZE["vocab_size"], (1, block), generator=g).to(device)
        positions = torch.arange(start, start + block, device=device)[None]
        committed = torch.tensor([1 + step % block], device=device)
        t0 = _sync(device)
        with recording(cache):
            target(input_ids=tokens, position_ids=positions, use_cache=True, **{kw: cache})
        t1 = _sync(device)
        crop_cache(cache, start + int(committed.max()))
        restore_linear_states(cache, committed)
        t2 = _sync(device)
        if step >= 2:
            verify, rollback = verify + t1 - t0, rollback + t2 - t1
    if keep is not None:
        keep.append(cache)
    return verify / steps, rollback / steps


@torch.no_grad()
def measure_history(target, device, steps, block, prompt_len=256):
    """``measure`` with transformers' own rollback (>= 5.25, batch 1): ``(verify, rollback, cache)``."""
    kw = _cache_kwarg(target)
    cache = DynamicCache(config=target.config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SIZE["vocab_size"], (1, prompt_len), generator=g).to(device)
    target(input_ids=ids, use_cache=True, **{kw: cache})
    cache.activate_past_recording(recurrent_states_to_keep=block)
    verify = rollback = 0.0
    for step in range(steps + 2):
        start = int(cache.get_seq_length(1))  # layer 1 is full attention in LINEAR's stack
        tokens = torch.randint(0, SIZE["vocab_size"], (1, block), generator=g).to(device)
        positions = torch.arange(start, start + block, device=device)[None]
        t0 = _sync(device)
        target(input_ids=tokens, position_ids=positions, use_cache=True, **{kw: cache})
        t1 = _sync(device)
        cache.crop(-(block - (1 + step % block)))
        t2 = _sync(device)
        if step >= 2:
            verify, rollback = verify + t1 - t0, rollback + t2 - t1
    return verify / steps, rollback / steps, cache


def _history_row(hybrid, device, args, replay_cache):
    """Print transformers' own rollback against the replay (same seed, same tokens, same committed counts)."""
    hv, hr, cache = measure_history(hybrid, device, args.steps, args.block)
    diff = max((a - b).abs().max().item() for i, layer in enumerate(cache.layers) if hasattr(layer, "recurrent_states")
               for a, b in [(layer.recurrent_states[0], replay_cache.layers[i].recurrent_states[0])])
    print(f"{'hybrid, history':15s} {'':15s}verify {hv * 1e3:8.2f} ms  rollback {hr * 1e3:7.2f} ms  "
          f"step {(hv + hr) * 1e3:8.2f} ms  (transformers' recurrent-state history; states vs replay: max |diff| {diff:.1e})")
    return hv + hr


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--block", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    dense = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZE)).to(device).eval()
    hybrid = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SIZE, **LINEAR)).to(device).eval()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {device}, {args.threads} thread(s), "
          f"block {args.block}, committed 1..{args.block} cycled, {args.steps} steps")
    rows, caches = {}, []
    for name, model in (("dense Qwen3", dense), ("hybrid Qwen3.5", hybrid)):
        params = sum(p.numel() for p in model.parameters()) / 1e6
        rows[name] = measure(model, device, args.steps, args.block, keep=caches)
        v, r = rows[name]
        print(f"{name:15s} {params:6.1f} M params  verify {v * 1e3:8.2f} ms  rollback {r * 1e3:7.2f} ms  "
              f"step {(v + r) * 1e3:8.2f} ms")
    (dv, dr), (hv, hr) = rows["dense Qwen3"], rows["hybrid Qwen3.5"]
    print(f"hybrid / dense per step: {(hv + hr) / (dv + dr):.2f}x (verify {hv / dv:.2f}x); "
          f"hybrid rollback = {hr / hv:.1%} of its own verify forward")
    if hasattr(caches[1].layers[0], "cumulative_length_linear"):  # transformers >= 5.25
        history = _history_row(hybrid, device, args, caches[1])
        print(f"history / replay per step: {history / (hv + hr):.2f}x")


if __name__ == "__main__":
    main()
