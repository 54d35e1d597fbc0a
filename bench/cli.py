"""The benchmark command: contenders interleaved in one process on the same target.

    python -m bench                                   # embedded pair, 16 held-out prompts x 128 tokens
    python -m bench --reference-dir REFERENCE_DIR    # + the authors' loop from a local copy of their code
    python -m bench --baseline OLD_DRAFTER_DIR       # + a drafter folder with its own (older) remote code
    python -m bench --sweep 64,512,1024               # + prompt-length sweep (held-out prompts left-extended)
    python -m bench --batch-sizes 1,4,16 --block-sizes 16,8,4   # + ragged left-padded batches vs batched generate
    python -m bench --sweep 512,1024 --draft-window 256  # + package@B/window256 (spec_generate(draft_window=256))
    python -m bench --tree-budgets 15,32,64            # + tree@N: spec_generate(tree_budget=N), draft trees
    python -m bench --tree-budgets 15,auto             # + tree@auto: trees sized by the verify-length policy
    python -m bench --tree-budgets 15,32 --ddtree-dir DDTREE_DIR  # + ddtree@N from a local copy of DDTree's code
    python -m bench --dataset gsm8k --chat-template   # an evaluation set through `datasets` (needs the Hub)

Writes a JSON report (``--out``) and a PNG plot (``--plot``), prints a markdown table; ``--acceptance-out``
also writes the ``dflash-acceptance/v1`` record of the package contender (for ``model_cards.render`` and
``convert.push_to_hub --acceptance``). Exit status 0, 1 for a refused input or a greedy output that differs
from ``target.generate`` (one line on stderr; ``--debug`` shows the traceback), 2 for a usage error, 130 on Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

from convert.cli import CommandError, add_debug_flag, add_kernels_flag, quiet_loading, run_command
from convert.loading import load_pair, model_load_kwargs, parse_device
from convert.paths import locate_model

from . import contenders as C
from .acceptance import acceptance_record, dataset_name, write_acceptance
from . import batches as B
from .core import interleaved, plot, summarize, table
from .prompts import DATASETS, HELDOUT, dataset_prompts, encode, extend_prompt, local_prompts, more_heldout_prompts, render

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None, prog: str = "python -m bench"):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    # The second names are the authors' (`dflash benchmark --model M --draft-model D --max-samples N`).
    ap.add_argument("--target", "--model", default=str(ROOT / "pair" / "target"), help="target folder or Hub id")
    ap.add_argument("--draft", "--draft-model", default=str(ROOT / "pair" / "drafter"), help="drafter folder or Hub id")
    ap.add_argument("--prompts", default=str(HELDOUT),
                    help="a JSON list or JSONL file of prompts (strings, or objects with prompt/text/turns)")
    ap.add_argument("--dataset", choices=sorted(DATASETS), help="an evaluation set instead of --prompts")
    ap.add_argument("--data-files", nargs="+", help="local JSON/JSONL file(s) in the --dataset column layout")
    ap.add_argument("--num-prompts", "--max-samples", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; ratios are per-round medians")
    ap.add_argument("--block-sizes", default="16", help="package block sizes, comma separated")
    ap.add_argument("--contenders", default="target,package,prompt_lookup,native,reference,baseline",
                    help="subset of target,package,prompt_lookup,native,reference,baseline,adaptive")
    ap.add_argument("--prompt-lookup-tokens", type=int, default=10)
    ap.add_argument("--reference-dir", help="local copy of the authors' repository (the folder holding dflash/)")
    ap.add_argument("--baseline", help="a drafter folder with its own remote code (e.g. the package before a change)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs checked against the target)")
    ap.add_argument("--top-k", type=int, default=0,
                    help="sampled runs: top-k of every contender's distribution (0 = none, the plain tempered "
                         "distribution; 50 = generate's default); not with the authors' loop, which has none")
    ap.add_argument("--chat-template", action="store_true", help="wrap the first user turn in the chat template")
    ap.add_argument("--enable-thinking", action="store_true", help="passed to the chat template")
    ap.add_argument("--sweep", default="", help="prompt lengths in tokens (held-out prompts left-extended)")
    ap.add_argument("--adaptive-block-sizes", default="",
                    help="block sizes of the adaptive contender (adaptive_block_size=True); default --block-sizes")
    ap.add_argument("--batch-sizes", default="",
                    help="batch sizes (held-out prompts in consecutive groups, left padded; bench/batches.py)")
    ap.add_argument("--batch-rounds", type=int, default=3)
    ap.add_argument("--sweep-prompts", type=int, default=8)
    ap.add_argument("--sweep-rounds", type=int, default=3)
    ap.add_argument("--tree-budgets", default="",
                    help="also run tree@N (spec_generate(tree_budget=N), at the first --block-sizes) for each N; "
                         "'auto': tree@auto, trees sized by the verify-length policy")
    ap.add_argument("--ddtree-dir", help="local copy of liranringel/ddtree: adds ddtree@N for each --tree-budgets N")
    ap.add_argument("--draft-window", type=int, metavar="N",
                    help="also run package@B/windowN: spec_generate(draft_window=N), interleaved with package@B")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, as the demo: the shipped pair "
                    "is tiny, so more threads only add synchronisation overhead; 0 = torch default)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--clock", choices=["cpu", "wall"], help="default: cpu on CPU, wall on CUDA")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_report.json")
    ap.add_argument("--plot", default="bench_report.png", help="'' for none")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--acceptance-out", metavar="PATH",
                    help="also write the dflash-acceptance/v1 record of package@<the drafter's block size> here")
    ap.add_argument("--dataset-name", metavar="NAME",
                    help="dataset name in that record (default: --dataset, else the --prompts file's name)")
    add_kernels_flag(add_debug_flag(ap))
    args = ap.parse_args(argv)
    unknown = [w for w in _names(args.contenders) if w not in CONTENDERS]
    if unknown:
        ap.error(f"--contenders: unknown {unknown}; expected names from {', '.join(CONTENDERS)}")
    for flag in ("num_prompts", "max_new_tokens", "rounds", "sweep_prompts", "sweep_rounds", "batch_rounds"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.data_files and not args.dataset:
        ap.error("--data-files needs --dataset (the column layout to read them with)")
    if args.draft_window is not None and (args.draft_window < 1 or "package" not in _names(args.contenders)):
        ap.error(f"--draft-window {args.draft_window}: expected an integer >= 1, with package in --contenders")
    if args.top_k < 0 or (args.top_k and not args.temperature):
        ap.error(f"--top-k {args.top_k}: expected an integer >= 0, and > 0 only with --temperature > 0")
    if args.top_k and args.reference_dir and "reference" in _names(args.contenders):
        ap.error(f"--top-k {args.top_k}: the authors' loop samples the plain tempered distribution (no top-k); "
                 "leave reference out of --contenders")
    if args.acceptance_out and "package" not in _names(args.contenders):
        ap.error("--acceptance-out records the package contender: add package to --contenders")
    if args.baseline and not (Path(args.baseline) / "config.json").is_file():
        ap.error(f"--baseline {args.baseline}: no config.json there; pass a drafter folder")
    if args.reference_dir and not (Path(args.reference_dir) / "dflash" / "model.py").is_file():
        ap.error(f"--reference-dir {args.reference_dir}: expected a copy of the authors' repository (with dflash/model.py)")
    if args.ddtree_dir and not (Path(args.ddtree_dir) / "ddtree.py").is_file():
        ap.error(f"--ddtree-dir {args.ddtree_dir}: expected a copy of liranringel/ddtree (with ddtree.py)")
    if args.ddtree_dir and not args.tree_budgets:
        ap.error("--ddtree-dir runs ddtree@N for each --tree-budgets N: pass --tree-budgets")
    if args.ddtree_dir and args.top_k:
        ap.error(f"--top-k {args.top_k}: DDTree's loop samples the plain tempered distribution (no top-k); "
                 "leave --ddtree-dir out")
    for flag in ("sweep", "block_sizes", "adaptive_block_sizes", "batch_sizes", "tree_budgets"):
        text = getattr(args, flag)
        words = [x for x in text.split(",") if x.strip() and not (flag == "tree_budgets" and x.strip() == "auto")]
        if not all(x.strip().isdigit() and int(x) > 0 for x in words) or (
                flag == "block_sizes" and not text.strip()):
            ap.error(f"--{flag.replace('_', '-')} {text!r}: expected positive integers separated by commas"
                     + (" (or 'auto')" if flag == "tree_budgets" else ""))
    return args


CONTENDERS = ("target", "package", "prompt_lookup", "native", "reference", "baseline", "adaptive")


def tree_budgets(args) -> list:
    """``--tree-budgets`` as ``spec_generate(tree_budget=...)`` values: integers, and ``"auto"`` (the policy's)."""
    return [w if w == "auto" else int(w) for w in _names(args.tree_budgets)]


def _names(text: str) -> list[str]:
    return [w.strip() for w in text.split(",") if w.strip()]


def load_models(args, device, dtype):
    """``(tokenizer, target, draft)``, checked to fit each other (see ``convert/loading.py``)."""
    draft, target, tok = load_pair(args.target, args.draft, device, dtype, use_kernels=args.use_kernels)
    return tok, target, draft


def _adaptive_blocks(args) -> list:
    """Block sizes of the ``adaptive`` contender: ``--adaptive-block-sizes``, else ``--block-sizes``."""
    return [int(b) for b in (args.adaptive_block_sizes or args.block_sizes).split(",") if b.strip()]


def build_contenders(args, target, draft, device, dtype) -> list:
    """The requested contenders that can run here (``native`` needs transformers with DFlash support,
    ``reference``/``baseline`` their folders); the ones skipped are printed."""
    want = _names(args.contenders)
    for name, flag, value in (("reference", "--reference-dir", args.reference_dir), ("baseline", "--baseline", args.baseline)):
        if name in want and not value:
            print(f"skipped {name}: it needs {flag}", file=sys.stderr)
    blocks = [int(b) for b in args.block_sizes.split(",")]
    out = []
    if "target" in want:
        out.append(C.Contender("target.generate", C.target_generate(target)))
    for b in blocks if "package" in want else []:
        out.append(C.Contender(f"package@{b}", C.package(draft, target, b), b))
        if args.draft_window is not None:
            out.append(C.Contender(f"package@{b}/window{args.draft_window}",
                                   C.package(draft, target, b, draft_window=args.draft_window), b))
    for b in _adaptive_blocks(args) if "adaptive" in want else []:
        out.append(C.Contender(f"adaptive@{b}", C.package(draft, target, b, adaptive_block_size=True), b,
                               warm_every_prompt=True))
    if "baseline" in want and args.baseline:
        from transformers import AutoModel

        old = AutoModel.from_pretrained(args.baseline, trust_remote_code=True, dtype=dtype,
                                        **model_load_kwargs(args.use_kernels)).to(device).eval()
        out += [C.Contender(f"baseline@{b}", C.package(old, target, b), b) for b in blocks]
    if "prompt_lookup" in want:
        out.append(C.Contender("prompt_lookup", C.target_generate(target, prompt_lookup_num_tokens=args.prompt_lookup_tokens)))
    if "native" in want:
        if C.native_supported():
            out.append(C.Contender("native", C.native(draft, target), draft.config.block_size))
        else:
            print("skipped native: this transformers has no DFlashTokenCandidateGenerator", file=sys.stderr)
    budgets = tree_budgets(args)
    out += [C.Contender(f"tree@{n}", C.package(draft, target, blocks[0], tree_budget=n), blocks[0],
                        warm_every_prompt=n == "auto") for n in budgets]  # "auto": the policy's tables, measured first
    fixed = [n for n in budgets if n != "auto"]
    if args.ddtree_dir and fixed:
        fn, model = C.load_ddtree(args.ddtree_dir, args.draft, dtype, device)
        out += [C.Contender(f"ddtree@{n}", C.ddtree(fn, model, target, blocks[0], n), blocks[0]) for n in fixed]
    if "reference" in want and args.reference_dir:
        fn, ref = C.load_reference(args.reference_dir, args.draft, dtype, device)
        out += [C.Contender(f"reference@{b}", C.reference(fn, ref, target, b), b) for b in blocks]
    return out


def load_prompts(args, tok) -> list[dict]:
    if args.dataset:
        return dataset_prompts(args.dataset, args.data_files, args.num_prompts)
    return local_prompts(args.prompts, args.num_prompts)


def environment(args, device, dtype, clock) -> dict:
    import transformers

    return {"device": str(device), "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
            "clock": clock, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "cuda": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def main(argv=None, prog: str = "python -m bench") -> int:
    """The command: exit status 0, 1 (a refused input, or greedy outputs that differ from the target's:
    one line on stderr, ``--debug`` for the traceback), 2 (usage error), 130 (Ctrl-C). ``prog``: the name
    usage lines show (``dflash-hf benchmark`` from the console script)."""
    args = parse_args(argv, prog)
    args.command = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
    return run_command(lambda a: 1 if _mismatches(run(a)) else 0, args)


def _mismatches(report: dict) -> dict:
    return {n: e["mismatches"] for n, e in report["main"]["contenders"].items() if e.get("mismatches")}


def _check_inputs(args) -> None:
    """Refuse missing prompt files and model arguments that point nowhere, before any model loads."""
    if not args.dataset and not Path(args.prompts).is_file():
        raise CommandError(f"--prompts {args.prompts}: no such file; pass a JSON list or JSONL file of prompts")
    for flag, value in (("--target", args.target), ("--draft", args.draft)):
        locate_model(value, flag)
    for f in args.data_files or []:
        if not Path(f).is_file():
            raise CommandError(f"--data-files {f}: no such file")


def run(args) -> dict:
    """Measure, print and write the report (and ``--acceptance-out``); returns the report."""
    _check_inputs(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = parse_device(args.device)
    dtype = getattr(torch, args.dtype)
    clock = args.clock or ("wall" if device.type == "cuda" else "cpu")
    sampling = {"temperature": args.temperature, "top_k": args.top_k}
    quiet_loading()
    tok, target, draft = load_models(args, device, dtype)
    if args.acceptance_out and str(draft.config.block_size) not in _names(args.block_sizes):
        raise CommandError(f"--acceptance-out records package@{draft.config.block_size} (the drafter's block size): "
                           f"add {draft.config.block_size} to --block-sizes (got {args.block_sizes})")
    try:
        records = load_prompts(args, tok)
    except (OSError, ConnectionError, ValueError) as err:  # unreadable file, bad record, or the Hub cannot be reached
        raise CommandError(f"cannot load the prompts ({args.dataset or args.prompts}): {str(err).splitlines()[0]}") from err
    try:
        texts = [render(tok, r["turns"], args.chat_template, args.enable_thinking) for r in records]
    except ValueError as err:  # --chat-template with a tokenizer that has none
        raise CommandError(str(err).splitlines()[0]) from err
    prompts = [torch.tensor([encode(tok, t)], device=device) for t in texts]
    cons = build_contenders(args, target, draft, device, dtype)
    greedy = not args.temperature
    mode = "greedy" if greedy else f"T={args.temperature}" + (f" top-k {args.top_k}" if args.top_k else "")
    runs = interleaved(cons, target, prompts, args.max_new_tokens, args.rounds, sampling, args.seed,
                       progress=not args.no_progress)
    report = {"title": f"{len(prompts)} prompts x {args.max_new_tokens} tokens, "
                       f"{mode}, {args.rounds} round{'' if args.rounds == 1 else 's'}, {device}, "
                       f"{torch.get_num_threads()} thread(s), {args.dtype}",
              "command": getattr(args, "command", "python -m bench"),
              "environment": environment(args, device, dtype, clock), "settings": vars(args),
              "prompt_ids": [r["id"] for r in records], "prompt_lengths": [p.shape[1] for p in prompts],
              "main": summarize(runs, cons, args.max_new_tokens, clock, greedy)}
    report["sweep"] = sweep(args, tok, target, cons, records, device, sampling, clock, greedy)
    batch_prompts = [p[0].tolist() for p in prompts]
    wanted = max([int(x) for x in args.batch_sizes.split(",") if x.strip()], default=0)
    if wanted > len(batch_prompts) and not args.dataset and Path(args.prompts).resolve() == HELDOUT.resolve():
        batch_prompts = more_heldout_prompts(tok, wanted)  # batch 32 from 32 distinct held-out prompts
    report["batches"] = batch_runs(args, target, draft, batch_prompts, sampling, clock, greedy)
    write(report, args)
    if args.acceptance_out:
        write_acceptance(package_acceptance(report, args, draft), args.acceptance_out)
        print(f"wrote {args.acceptance_out}")
    return report


def package_acceptance(report: dict, args, draft) -> dict:
    """The ``dflash-acceptance/v1`` record of ``package@<the drafter's block size>`` in ``report``.

    Raises:
        CommandError: that contender was not measured (``--block-sizes`` without the drafter's block size).
    """
    import transformers

    block = int(draft.config.block_size)
    entry = report["main"]["contenders"].get(f"package@{block}")
    if entry is None:
        raise CommandError(f"--acceptance-out records package@{block} (the drafter's block size): add {block} to "
                           f"--block-sizes (got {args.block_sizes})")
    env = report["environment"]
    device = env["cuda"] or env["device"]
    return acceptance_record(args.target, args.draft, block, env["dtype"], device,
                             dataset_name(args.dataset_name, args.dataset, args.prompts), len(report["prompt_ids"]),
                             args.max_new_tokens, args.temperature, entry["tau"], entry.get("speedup"),
                             transformers.__version__, notes=f"python -m bench, {report['title']}, "
                             f"speedup on {env['clock']} time")


def batch_runs(args, target, draft, prompts: list, sampling: dict, clock: str, greedy: bool):
    """``--batch-sizes``: batched target.generate, package@b per ``--block-sizes``, and prompt lookup at batch 1
    only (transformers refuses assisted generation, prompt lookup included, for batches > 1). None when off."""
    sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    if not sizes:
        return None
    want = _names(args.contenders)
    kw = C.generate_kwargs(target, sampling)
    pad = kw["pad_token_id"]
    pad = (pad[0] if isinstance(pad, list) else pad) if pad is not None else 0
    cons = {}
    if "target" in want:
        cons["target.generate"] = (B.generate_contender(target, kw), None, None)
    package_kw = C.sampling_kwargs(sampling)
    blocks = [int(x) for x in args.block_sizes.split(",")]
    for b in blocks if "package" in want else []:
        cons[f"package@{b}"] = (B.package_contender(draft, target, b, package_kw), b, None)
    for b in _adaptive_blocks(args) if "adaptive" in want else []:
        cons[f"adaptive@{b}"] = (B.package_contender(draft, target, b, dict(package_kw, adaptive_block_size=True)), b,
                                 None)
    for n in tree_budgets(args):
        cons[f"tree@{n}"] = (B.package_contender(draft, target, blocks[0], dict(package_kw, tree_budget=n)), blocks[0],
                             None)
    if "prompt_lookup" in want:
        cons["prompt_lookup"] = (B.generate_contender(target, kw, prompt_lookup_num_tokens=args.prompt_lookup_tokens),
                                 None, {1})
    return B.run_batches(sizes, cons, target, prompts, pad, args.max_new_tokens, args.batch_rounds, clock, greedy,
                         args.seed)


def sweep(args, tok, target, cons, records, device, sampling, clock, greedy) -> dict:
    """Summaries at each ``--sweep`` length: held-out prompts left-extended from their own source."""
    out = {}
    for length in [int(x) for x in args.sweep.split(",") if x.strip()]:
        if not all("path" in r for r in records):
            raise CommandError("--sweep needs held-out prompt records (path, lineno): use the default --prompts")
        ids = [torch.tensor([extend_prompt(tok, r, length)], device=device) for r in records[: args.sweep_prompts]]
        runs = interleaved(cons, target, ids, args.max_new_tokens, args.sweep_rounds, sampling, args.seed,
                           progress=not args.no_progress)
        out[str(length)] = summarize(runs, cons, args.max_new_tokens, clock, greedy)
    return out


def write(report: dict, args) -> None:
    """JSON (temp name then rename), PNG, and the printed tables."""
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, out)
    if args.plot:
        plot(report, args.plot)
    print(report["title"])
    print(table(report["main"]))
    for length, s in report["sweep"].items():
        print(f"\nprompt length {length}:")
        print(table(s))
    if report.get("batches"):
        print("\nbatches (prompts in consecutive groups, left padded):")
        print(B.table(report["batches"]))
    bad = _mismatches(report)
    print(f"\ngreedy mismatches vs target.generate: {bad or 'none'}; wrote {out}" + (f", {args.plot}" if args.plot else ""))
