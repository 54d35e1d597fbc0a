"""DFlash out of the box: the embedded pair (``pair/target`` + ``pair/drafter``) on held-out prompts.

    python demo.py                 # 8 prompts x 128 tokens; CUDA is used when present
    python demo.py --quick         # 2 prompts x 32 tokens: a smoke run, too short for speed figures
    python demo.py --json acceptance.json   # fixed blocks: the drafter's acceptance at its block size
    python demo.py --fixed-blocks          # every step drafts the whole block (adaptive_block_size=False)

It runs in float32 on 1 CPU thread unless told otherwise (``--dtype``, ``--threads``) and says why
in its first lines: the pair is tiny (3 M parameters), so extra threads only add synchronisation and
CPU bfloat16 matmuls are slower than float32 at this size.

Loads the drafter through ``AutoModel.from_pretrained(..., trust_remote_code=True)`` and the target
through ``AutoModelForCausalLM`` / ``AutoTokenizer``, continues real held-out prompts
(``pair/heldout_prompts.json``: ``def`` + docstring from stdlib modules the models never saw) with greedy
speculative decoding (``spec_generate``'s default: the verify-length policy, ``verify_policy.py``, chooses
each step how many drafted tokens to verify), prints the generated code, the acceptance length tau, the
per-position acceptance and tokens/s against the target alone (``target.generate``, same prompts, same run,
after a warm-up; a machine's first run also measures the policy's device constants, a few raw matmuls in
under a second, kept for later runs in ``verify_cost.speed_file()``), and CHECKS that
every output equals the target's own greedy output (exit status 1 otherwise). In bfloat16
(``--dtype bfloat16``) a verify block and a one-token forward round differently, so greedy outputs may
part where two logits are nearly tied: the demo then prints each prompt's first differing token with
that note and exits 0; in float32 a difference is a FAIL (exit 1).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from convert.cli import CommandError, add_debug_flag, add_kernels_flag, quiet_loading, run_command
from convert.loading import load_pair, parse_device

ROOT = Path(__file__).resolve().parent
QUICK_NOTE = ("--quick runs 2 prompts x 32 tokens: the fixed cost of each call (the draft's first block, "
              "the target's prefill) is not amortised over so few tokens, so its speedup (often below 1x) "
              "says nothing; run without --quick for the figures")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=8, help="held-out prompts to run (at most 16)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None, help="per-call block size (default: the drafter's)")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    ap.add_argument("--quick", action="store_true", help="2 prompts x 32 tokens (CI smoke run)")
    ap.add_argument("--fixed-blocks", action="store_true",
                    help="every step drafts and verifies the whole block (adaptive_block_size=False) instead of the "
                         "default verify-length policy; implied by --json (a card's tau is the acceptance at the block)")
    ap.add_argument("--json", metavar="PATH",
                    help="write a dflash-acceptance/v1 record here (for model_cards.render / push_to_hub --acceptance)")
    ap.add_argument("--dataset-name", metavar="NAME",
                    help="the dataset name in the --json record (default: the --prompts file's name without suffix)")
    ap.add_argument("--target", default=str(ROOT / "pair" / "target"), help="target folder or Hub id")
    ap.add_argument("--draft", default=str(ROOT / "pair" / "drafter"), help="drafter folder or Hub id")
    ap.add_argument("--prompts", default=str(ROOT / "pair" / "heldout_prompts.json"),
                    help="a JSON list of prompts (strings, or objects with 'prompt', 'text' or 'turns'; "
                         "'path'/'name' label them) or a JSONL file with one such prompt per line; "
                         "the text is continued as is, no chat template")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads (default 1: these small models run fastest on one thread; 0 = torch default)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="weights and compute dtype (default float32: on CPU, bfloat16 is slower for models this small)")
    ap.add_argument("--quiet", action="store_true", help="do not print the generated code")
    add_kernels_flag(add_debug_flag(ap))
    args = ap.parse_args(argv)
    given = argv if argv is not None else sys.argv[1:]
    if args.quick:
        if "--max-new-tokens" in given or "--num-prompts" in given:
            ap.error("--quick sets 2 prompts x 32 tokens; drop --num-prompts/--max-new-tokens or --quick")
        args.num_prompts, args.max_new_tokens = 2, 32
    args.fixed_blocks = args.fixed_blocks or args.json is not None
    for flag, low in (("num_prompts", 1), ("max_new_tokens", 1), ("threads", 0), ("block_size", 1)):
        value = getattr(args, flag)
        if value is not None and value < low:
            ap.error(f"--{flag.replace('_', '-')} must be >= {low}, got {value}")
    return args


def sync(device) -> float:
    """``time.perf_counter()`` after the device finished its queued work."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    return time.perf_counter()


def display_path(path: str) -> str:
    """``path`` relative to the repository when it lies inside it (``pair/target``), else as given."""
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def explain_settings(device, dtype_name: str, threads: int, explicit_threads: bool) -> str:
    """The line saying which device, dtype and threads the demo uses, and why."""
    why_threads = ("as asked (--threads)" if explicit_threads else
                   "the default: a model this small runs fastest on one thread, more only add synchronisation")
    why_dtype = ("float32, the default: CPU bfloat16 matmuls are slower at this size; --dtype bfloat16 to compare"
                 if dtype_name == "float32" else "bfloat16, as asked (--dtype)")
    if device.type != "cpu":
        return f"device {device}, {dtype_name}"
    return f"device cpu, {why_dtype}; {threads} thread(s), {why_threads}"


REDUCED_PRECISION_NOTE = (
    "note: in {dtype}, the target's verify block (several tokens in one forward) and generate's one-token "
    "forwards round differently, so greedy outputs may part where two logits are nearly tied; that is no "
    "error of the speculative loop (in float32 the outputs are identical: run without --dtype to check it)")


def first_difference(ref, out, prompt_len: int):
    """``(new-token index, target token, DFlash token)`` of the first position where the ``(1, L)`` outputs
    ``ref`` and ``out`` differ after ``prompt_len`` tokens (a missing token reads None), or None."""
    a, b = ref[0, prompt_len:].tolist(), out[0, prompt_len:].tolist()
    for i in range(max(len(a), len(b))):
        x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
        if x != y:
            return i, x, y
    return None


def report_differences(differences: list, dtype_name: str, decode) -> int:
    """Print the outcome of the check and return the exit status. ``differences``: ``(label,
    first_difference)`` per differing prompt; ``decode(token) -> str``. float32: any difference is a FAIL
    (1); bfloat16/float16: each prompt's first differing token and the rounding note, exit 0."""
    if not differences:
        print("check: every speculative output is identical to the target's greedy output")
        return 0
    if dtype_name == "float32":
        print(f"FAIL: speculative output differs from the target's greedy output on {[d[0] for d in differences]}")
        return 1
    print(f"check: {len(differences)} output(s) differ from the target's greedy output in {dtype_name}:")
    for label, (i, want, got) in differences:
        show = lambda t: "(none)" if t is None else repr(decode(t))  # noqa: E731
        print(f"  {label}: first difference at new token {i}: target {want} {show(want)}, DFlash {got} {show(got)}")
    print(REDUCED_PRECISION_NOTE.format(dtype=dtype_name))
    return 0


def run(args) -> int:
    """The demo; returns the exit status (0 = every output equals the target's)."""
    import torch

    from bench.acceptance import acceptance_record, dataset_name, write_acceptance
    from bench.prompts import local_prompts

    if not Path(args.prompts).is_file():
        raise CommandError(f"--prompts {args.prompts}: no such file; pass a JSON list or JSONL file of prompts")
    try:
        prompts = local_prompts(args.prompts, args.num_prompts)
    except (ValueError, UnicodeDecodeError) as err:
        raise CommandError(f"--prompts {args.prompts}: {err}") from None
    from convert.paths import locate_model

    args.target, args.draft = locate_model(args.target, "--target"), locate_model(args.draft, "--draft")
    device = parse_device(args.device)
    threads = 1 if args.threads is None else args.threads
    if threads:
        torch.set_num_threads(threads)
    quiet_loading()
    print(explain_settings(device, args.dtype, torch.get_num_threads(), args.threads is not None))
    if args.quick:
        print(QUICK_NOTE)
    t_load = time.perf_counter()
    draft, target, tok = load_pair(args.target, args.draft, device, getattr(torch, args.dtype),
                                   use_kernels=args.use_kernels)
    block = args.block_size or draft.config.block_size
    n_params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    print(f"target {display_path(args.target)}: {n_params(target) / 1e6:.2f} M params | drafter {display_path(args.draft)}: "
          f"{n_params(draft) / 1e6:.2f} M params, {draft.config.num_hidden_layers} layers, block {block}, "
          f"target layers {draft.config.target_layer_ids} | {device}, {args.dtype}, {torch.get_num_threads()} thread(s) | "
          f"loaded in {time.perf_counter() - t_load:.1f}s")
    encoded = [tok(p["turns"][0], return_tensors="pt", add_special_tokens=False)["input_ids"].to(device) for p in prompts]
    gen_kwargs = dict(do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=target.generation_config.eos_token_id)

    def target_alone(ids, n):
        return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, **gen_kwargs)

    def speculative(ids, n):
        return draft.spec_generate(target, ids, max_new_tokens=n, temperature=0.0, block_size=block,
                                   adaptive_block_size=False if args.fixed_blocks else None,  # None: the default
                                   return_dict_in_generate=True)

    # warm-up (allocator, kernels, lazy imports; on a machine's first run the policy's device constants) for both
    t_warm = time.perf_counter()
    target_alone(encoded[0], 8)
    speculative(encoded[0], 8)
    print(f"warm-up {time.perf_counter() - t_warm:.1f}s")

    t_ref = t_spec = 0.0
    n_ref = n_spec = 0
    rows, mismatches = {"lengths": [], "drafted": [], "accepted": []}, []  # per prompt, from each output's row 0
    for p, ids in zip(prompts, encoded):
        t0 = sync(device)
        ref = target_alone(ids, args.max_new_tokens)
        t1 = sync(device)
        out = speculative(ids, args.max_new_tokens)
        t2 = sync(device)
        t_ref, t_spec = t_ref + t1 - t0, t_spec + t2 - t1
        n_ref += ref.shape[1] - ids.shape[1]
        n_spec += out.sequences.shape[1] - ids.shape[1]
        for key, field in (("lengths", "row_acceptance_lengths"), ("drafted", "row_draft_lengths"),
                           ("accepted", "row_accepted_drafts")):
            rows[key].append(getattr(out, field)[0])
        same = out.sequences.tolist() == ref.tolist()
        if not same:
            mismatches.append((p.get("path", p["id"]), first_difference(ref, out.sequences, ids.shape[1])))
        tau_p = "-" if out.tau is None else f"{out.tau:.2f}"
        if not args.quiet:
            label = f"{p['path']} :: {p['name']}" if "path" in p and "name" in p else p["id"]
            print(f"\n----- {label}  (tau {tau_p}, {'identical' if same else 'DIFFERENT'})")
            bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")  # generated text in bold
            print(p["turns"][0] + bold + tok.decode(out.sequences[0, ids.shape[1]:]) + plain)

    from generation_output import DFlashGenerateOutput  # tau and slot acceptance: the one definition

    pooled = DFlashGenerateOutput(sequences=None, row_acceptance_lengths=rows["lengths"],
                                  row_draft_lengths=rows["drafted"], row_accepted_drafts=rows["accepted"])  # a prompt a row
    tau, drafting = pooled.tau, sum(d > 0 for row in rows["drafted"] for d in row)  # tau None: no step drafted
    tps_ref, tps_spec = n_ref / t_ref, n_spec / t_spec
    speedup = tps_spec / tps_ref
    print("\n===== summary")
    policy = "fixed blocks" if args.fixed_blocks else "verify-length policy (the default)"
    print(f"prompts {len(prompts)}, max_new_tokens {args.max_new_tokens}, greedy, block {block}, {policy}")
    print(f"tau (mean accepted tokens per target forward that drafted, bonus included): "
          f"{'-' if tau is None else f'{tau:.2f}'} over {drafting} "
          f"steps; plain steps (no draft pass) {pooled.plain_steps}")
    shares = pooled.slot_acceptance()
    print("per-position acceptance (share of the steps that drafted slot k whose draft at slot k was accepted):")
    print("  " + "  ".join(f"k{k}:{'-' if s is None else f'{s:.2f}'}" for k, s in enumerate(shares, start=1)))
    print(f"target alone: {tps_ref:.1f} tok/s | DFlash: {tps_spec:.1f} tok/s | speedup {speedup:.2f}x"
          + (" (--quick: not a speed figure, see above)" if args.quick else ""))
    if args.json:
        import transformers

        record = acceptance_record(display_path(args.target), display_path(args.draft), block, args.dtype, str(device),
                                   dataset_name(args.dataset_name, None, args.prompts), len(prompts),
                                   args.max_new_tokens, 0.0, 1.0 if tau is None else tau, None if args.quick else speedup,
                                   transformers.__version__, notes="demo.py, fixed blocks, speedup on wall-clock time")
        write_acceptance(record, args.json)
        print(f"wrote {args.json}")
    return report_differences(mismatches, args.dtype, lambda t: tok.decode([t]))


def main(argv=None) -> int:
    """Command-line entry point: exit status 0 (identical outputs; in bfloat16 also reported differences),
    1 (a difference in float32, or a refused input: one line on stderr; ``--debug`` for the traceback)."""
    return run_command(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
