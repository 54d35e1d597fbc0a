"""Benchmark the embedded pair: the closing numbers of the drafter issue, measured in one run.

    python -m train.bench_pair                    # -> pair/bench_pair.json + a printed table

On the held-out prompts (``pair/heldout_prompts.json``), greedy, float32:

* target quality: held-out loss (from ``pair/target_train_summary.json``) and how repetitive its greedy
  continuations are (share of 4-gram occurrences that repeat an earlier 4-gram of the same continuation);
* DFlash tau at block sizes 4, 8, 16 through ``spec_generate`` (outputs checked against ``target.generate``),
  next to the tau of a trivial prompt-lookup n-gram drafter, simulated against the same greedy outputs with
  the same step accounting (one verify step commits the accepted drafts plus one target token);
* wall-clock tokens/s of ``target.generate`` vs ``spec_generate`` on this machine (warm-up first);
* model sizes and training times (from the training summaries).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- prompt lookup


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
    Returns the per-step acceptance lengths (their mean is tau). ``continuation`` is the target's greedy
    output (it may end early at eos).
    """
    seq = prompt + continuation
    c = len(prompt) + 1  # committed length after the prefill token
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


# ----------------------------------------------------------------------------- the benchmark


def sync(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def file_bytes(folder) -> int:
    """Total size of the ``*.safetensors`` files in ``folder``."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "pair" / "target"))
    ap.add_argument("--draft", default=str(ROOT / "pair" / "drafter"))
    ap.add_argument("--prompts", default=str(ROOT / "pair" / "heldout_prompts.json"))
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-sizes", default="4,8,16")
    ap.add_argument("--max-ngram", type=int, default=3, help="prompt-lookup n-gram length (tries n..1)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (0 = torch default)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=str(ROOT / "pair" / "bench_pair.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    import transformers

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    tok = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(device).eval()
    draft = AutoModel.from_pretrained(args.draft, trust_remote_code=True, dtype=torch.float32).to(device).eval()
    prompts = json.loads(Path(args.prompts).read_text())[: args.num_prompts]
    enc = [tok(p["prompt"], return_tensors="pt", add_special_tokens=False)["input_ids"].to(device) for p in prompts]
    eos = target.generation_config.eos_token_id
    gen = dict(do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=eos)
    blocks = [int(b) for b in args.block_sizes.split(",")]

    # warm-up, then the target alone (reference outputs + timing)
    target.generate(enc[0], attention_mask=torch.ones_like(enc[0]), max_new_tokens=8, **gen)
    draft.spec_generate(target, enc[0], max_new_tokens=8, temperature=0.0)
    refs, t_ref, n_ref = [], 0.0, 0
    for ids in enc:
        t0 = sync(device)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, **gen)
        t_ref += sync(device) - t0
        refs.append(out[0, ids.shape[1]:].tolist())
        n_ref += len(refs[-1])
    result = {"target_tok_per_s": n_ref / t_ref, "by_block_size": {}}
    result["repeated_4gram_share"] = sum(repeated_ngram_share(r) * max(len(r) - 3, 0) for r in refs) / max(
        sum(max(len(r) - 3, 0) for r in refs), 1)
    result["repeated_4gram_share_per_prompt"] = [round(repeated_ngram_share(r), 4) for r in refs]
    result["mean_new_tokens"] = n_ref / len(refs)

    mismatches = []
    for b in blocks:
        steps, t_spec, n_spec = [], 0.0, 0
        for ids, ref, p in zip(enc, refs, prompts):
            t0 = sync(device)
            out = draft.spec_generate(target, ids, max_new_tokens=args.max_new_tokens, temperature=0.0, block_size=b,
                                      return_dict_in_generate=True)
            t_spec += sync(device) - t0
            new = out.sequences[0, ids.shape[1]:].tolist()
            n_spec += len(new)
            steps += out.acceptance_lengths
            if new != ref:
                mismatches.append((b, p["path"]))
        pl_steps = []
        for ids, ref in zip(enc, refs):
            pl_steps += prompt_lookup_tau(ids[0].tolist(), ref, b, args.max_new_tokens, args.max_ngram)
        result["by_block_size"][b] = {
            "dflash_tau": sum(steps) / len(steps), "dflash_steps": len(steps),
            "prompt_lookup_tau": sum(pl_steps) / len(pl_steps), "prompt_lookup_steps": len(pl_steps),
            "dflash_tok_per_s": n_spec / t_spec, "speedup": (n_spec / t_spec) / result["target_tok_per_s"],
        }
    result["greedy_mismatches"] = mismatches

    def load_json(path):
        path = Path(path)
        return json.loads(path.read_text()) if path.exists() else {}

    ts = load_json(ROOT / "pair" / "target_train_summary.json")
    ds = load_json(ROOT / "pair" / "drafter_train_summary.json")
    result.update({
        "target_heldout_loss": ts.get("heldout_loss_shipped_fp32"), "target_unigram_loss": ts.get("unigram_heldout_loss"),
        "target_params": sum(p.numel() for p in target.parameters()), "target_bytes": file_bytes(args.target),
        "draft_params": sum(p.numel() for p in draft.parameters()), "draft_bytes": file_bytes(args.draft),
        "target_train_wall_s": ts.get("train_wall_s"), "draft_train_wall_s": ds.get("train_wall_s"),
        "draft_data_wall_s": ds.get("data_wall_s"), "draft_features_wall_s": ds.get("features_wall_s"),
        "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "device": str(device),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "max_ngram": args.max_ngram,
    })
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    print(f"{len(prompts)} held-out prompts x {args.max_new_tokens} new tokens, greedy, {device}, "
          f"{torch.get_num_threads()} threads")
    print(f"target held-out loss {result['target_heldout_loss']} (unigram {result['target_unigram_loss']}); "
          f"repeated 4-gram share of its greedy continuations {result['repeated_4gram_share']:.3f}")
    print("| block | DFlash tau | prompt-lookup tau | DFlash tok/s | target tok/s | speedup |")
    print("|---|---|---|---|---|---|")
    for b, r in result["by_block_size"].items():
        print(f"| {b} | {r['dflash_tau']:.2f} | {r['prompt_lookup_tau']:.2f} | {r['dflash_tok_per_s']:.1f} | "
              f"{result['target_tok_per_s']:.1f} | {r['speedup']:.2f}x |")
    print(f"sizes: target {result['target_params'] / 1e6:.2f} M params / {result['target_bytes'] / 1e6:.2f} MB, "
          f"draft {result['draft_params'] / 1e6:.2f} M params / {result['draft_bytes'] / 1e6:.2f} MB")
    print(f"greedy mismatches: {mismatches or 'none'}; wrote {args.out}")
    if mismatches:
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
