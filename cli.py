"""The ``dflash-hf`` command (``[project.scripts]``): the package's command lines, from any folder.

    dflash-hf generate [--model M] [--draft D] [--temperature T] [--top-p P] [--top-k K]
                       [--max-new-tokens N] [--block-size B] [--enable-thinking] [--no-chat-template] PROMPT
    dflash-hf calibrate [--device D] [--dtype D] [--threads N]  # measure this device's speed constants again
    dflash-hf benchmark [--model M] [--draft D] [--dataset NAME] [--max-samples N] [python -m bench options]
    dflash-hf convert SOURCE OUTPUT [...]         # python -m convert.convert_checkpoint
    dflash-hf push FOLDER --repo-id ORG/NAME [...]  # python -m convert.push_to_hub

``--model`` / ``--draft`` default to the shipped pair (``pair/target``, ``pair/drafter``). The flag names
of the authors' ``dflash`` command are accepted where they mean the same thing (``--draft-model`` is
``--draft``, ``--max-samples`` is ``--num-prompts``, ``--block-size`` is ``--block-sizes``), and so is
``transformers`` as the first word after the command; theirs that mean nothing here (``--reasoning``,
``--model-preset``, ``--base-url``, ``--concurrency``, the ``openai`` and ``mlx`` backends) are refused
by name. Exit status: 0, 1 for a refused input (one line on stderr; ``--debug`` shows the traceback),
2 for a usage error, 130 on Ctrl-C. Nothing heavy (torch, transformers) is imported before the
command's arguments are parsed, and a Ctrl-C from the first instruction on is one line.

Installed (``pip install .`` or ``-e .``), the package folder holds ``bench/``, ``convert/``, ``train/``,
``model_cards/`` and ``pair/`` beside the flat Hub files, the layout of a checkout: the command puts that
folder on ``sys.path`` so that they import as they do from the repository root.
"""
import argparse
import os
import sys

PACKAGE = os.path.dirname(os.path.abspath(__file__))
PAIR = os.path.join(PACKAGE, "pair")
COMMANDS = ("generate", "benchmark", "calibrate", "convert", "push")
THREADS_HELP = ("torch CPU threads (default 1, as the demo: the shipped pair is tiny, so more threads only add "
                "synchronisation overhead; 0 = torch's default)")
# The authors' backends and flags that have no meaning in this package: refused by name, never ignored.
REFUSED_BACKENDS = {
    "openai": "the openai backend (an OpenAI-compatible server) is not part of dflash-hf; this package runs transformers",
    "mlx": "the mlx backend (Apple MLX) is not part of dflash-hf; this package runs transformers (torch)",
}
REFUSED_FLAGS = {
    "--reasoning": "--reasoning belongs to the authors' server backends; pass --enable-thinking to the chat template",
    "--model-preset": "--model-preset (the authors' preset table) has no meaning here; pass --model and --draft",
    "--base-url": "--base-url (a server address) has no meaning here: dflash-hf runs the models in this process",
    "--concurrency": "--concurrency (parallel server requests) has no meaning here: dflash-hf runs one process",
}


def _on_path() -> None:
    """Put the package folder first on ``sys.path`` (``bench``, ``convert``, the flat files import as in a checkout)."""
    if sys.path[:1] != [PACKAGE]:
        sys.path.insert(0, PACKAGE)


def refusal(command: str, argv: list):
    """The one-line reason to refuse ``argv`` (after the command word), or None.

    Refused: a first word naming one of the authors' other backends, and their flags that mean nothing
    here (``--flag`` and ``--flag=value``); only for ``generate`` and ``benchmark``, the authors' commands.
    """
    if command not in ("generate", "benchmark"):
        return None
    if argv and argv[0] in REFUSED_BACKENDS:
        return f"dflash-hf {command} {argv[0]}: {REFUSED_BACKENDS[argv[0]]}"
    for word in argv:
        flag = word.split("=", 1)[0]
        if flag in REFUSED_FLAGS:
            return f"dflash-hf {command} {flag}: {REFUSED_FLAGS[flag]}"
    return None


# ----------------------------------------------------------------------------- generate


def generate_parser() -> argparse.ArgumentParser:
    """The ``dflash-hf generate`` argument parser (the authors' flag names)."""
    from convert.cli import add_debug_flag, add_kernels_flag

    ap = argparse.ArgumentParser(prog="dflash-hf generate", description="Generate a reply to PROMPT with speculative "
                                 "decoding; the text goes to stdout, tau and the token count to stderr.")
    ap.add_argument("prompt", help="the user message (through the target tokenizer's chat template when it has one)")
    ap.add_argument("--model", default=os.path.join(PAIR, "target"), help="target folder or Hub id (default: the shipped pair's)")
    ap.add_argument("--draft", "--draft-model", dest="draft", default=os.path.join(PAIR, "drafter"),
                    help="DFlash drafter folder or Hub id (default: the shipped pair's)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    ap.add_argument("--top-p", type=float, help="nucleus sampling (with --temperature > 0)")
    ap.add_argument("--top-k", type=int, help="top-k sampling (with --temperature > 0)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, help="per-call block size (default: the drafter's)")
    ap.add_argument("--fixed-blocks", action="store_true",
                    help="every step verifies the whole block (adaptive_block_size=False) instead of the default "
                         "verify-length policy (priced by verify_cost.py's cost model)")
    ap.add_argument("--enable-thinking", action="store_true", help="passed to the chat template (Qwen3 reads it)")
    ap.add_argument("--no-chat-template", action="store_true", help="continue PROMPT as plain text")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                    help="auto: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--threads", type=int, default=1, help=THREADS_HELP)
    return add_kernels_flag(add_debug_flag(ap))


def prompt_text(tokenizer, prompt: str, chat_template: bool, enable_thinking: bool):
    """``(text to encode, how)``: ``prompt`` through the tokenizer's chat template (a user turn, generation
    prompt added) when asked for and the tokenizer has one, else ``prompt`` as is; ``how`` says which."""
    if not chat_template:
        return prompt, "plain continuation"
    if not getattr(tokenizer, "chat_template", None):
        return prompt, "plain continuation: the target tokenizer has no chat template"
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=enable_thinking), "chat template"


def sampling_arguments(args) -> dict:
    """``spec_generate`` keywords for the sampling flags: greedy at temperature 0, else sampling with the
    top-p / top-k given (left out when not given: the target's generation config decides)."""
    if not args.temperature:
        return {"temperature": 0.0}
    out = {"do_sample": True, "temperature": args.temperature}
    out.update({k: v for k, v in (("top_p", args.top_p), ("top_k", args.top_k)) if v is not None})
    return out


def run_generate(args) -> int:
    """Load the pair, generate, print the text (stdout) and tau (stderr); returns 0.

    Raises:
        CommandError: a model folder or id that is missing, of the wrong kind or not a pair (``load_pair``).
        ValueError: an argument ``spec_generate`` refuses (``--block-size`` above the drafter's, ...).
    """
    import torch

    from convert.cli import quiet_loading
    from convert.loading import load_pair, parse_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = parse_device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    quiet_loading()
    draft, target, tok = load_pair(args.model, args.draft, device, dtype, target_flag="--model",
                                   use_kernels=args.use_kernels)
    text, how = prompt_text(tok, args.prompt, not args.no_chat_template, args.enable_thinking)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
    out = draft.spec_generate(target, ids, max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                              adaptive_block_size=False if args.fixed_blocks else None,  # None: the default
                              return_dict_in_generate=True, **sampling_arguments(args))
    new = out.sequences[0, ids.shape[1]:]
    print(tok.decode(new, skip_special_tokens=True))
    drafting = len(out.acceptance_lengths) - out.plain_steps
    tau = "-" if out.tau is None else f"{out.tau:.2f}"  # None: no step drafted
    print(f"{new.shape[0]} new tokens, tau {tau} over {drafting} target forwards that drafted, "
          f"{out.plain_steps} plain ({how})", file=sys.stderr)
    return 0


def generate(argv: list) -> int:
    """``dflash-hf generate``: parse (usage errors exit 2), then run with one-line errors."""
    from convert.cli import run_command

    args = generate_parser().parse_args(argv)
    for flag, low in (("max_new_tokens", 1), ("block_size", 1), ("top_k", 1), ("threads", 0)):
        if getattr(args, flag) is not None and getattr(args, flag) < low:
            generate_parser().error(f"--{flag.replace('_', '-')} must be >= {low}, got {getattr(args, flag)}")
    return run_command(run_generate, args)


# ----------------------------------------------------------------------------- benchmark, convert, push

# The authors' benchmark flags -> python -m bench's (the others pass through unchanged).
BENCH_FLAGS = {"--model": "--target", "--draft-model": "--draft", "--max-samples": "--num-prompts",
               "--block-size": "--block-sizes"}


def bench_argv(argv: list) -> list:
    """``argv`` with the authors' flag names (``--flag value`` or ``--flag=value``) renamed for ``python -m bench``."""
    out = []
    for word in argv:
        flag, eq, value = word.partition("=")
        out.append(BENCH_FLAGS.get(flag, flag) + eq + value if flag.startswith("--") else word)
    return out


def benchmark(argv: list) -> int:
    """``dflash-hf benchmark``: ``python -m bench`` with the authors' flag names accepted.

    ``--top-p`` is refused in one line (the benchmark measures plain and top-k sampling only)."""
    if any(w.split("=", 1)[0] == "--top-p" for w in argv):
        print("error: dflash-hf benchmark --top-p: the benchmark samples with --temperature and --top-k only",
              file=sys.stderr)
        return 1
    from bench.cli import main as bench_main

    return bench_main(bench_argv(argv), prog="dflash-hf benchmark")


def calibrate(argv: list) -> int:
    """``dflash-hf calibrate``: measure this device's speed constants again (``verify_cost.calibrate``), replacing
    the stored entry; prints the constants and the file they are kept in."""
    ap = argparse.ArgumentParser(prog="dflash-hf calibrate", description="Measure this device's speed constants "
                                 "for the verify-length policy's cost model again (a few raw matmuls, under 1 s) "
                                 "and store them, replacing the entry.")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="default: float32 on CPU, bfloat16 on CUDA (what dflash-hf generate runs)")
    ap.add_argument("--threads", type=int, default=1, help=THREADS_HELP + "; the constants are kept per thread count")
    args = ap.parse_args(argv)
    if args.threads < 0:
        ap.error(f"--threads must be >= 0, got {args.threads}")
    import torch

    import verify_cost

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    speed = verify_cost.calibrate(device, dtype)
    print(f"{verify_cost.speed_key(device, dtype)}: " + ", ".join(
        f"{k} {v:.3g} s" for k, v in vars(speed).items()) + f"\nkept in {verify_cost.speed_file()}")
    return 0


def convert(argv: list) -> int:
    """``dflash-hf convert``: ``python -m convert.convert_checkpoint``."""
    from convert.convert_checkpoint import main as convert_main

    return convert_main(argv)


def push(argv: list) -> int:
    """``dflash-hf push``: ``python -m convert.push_to_hub``."""
    from convert.push_to_hub import main as push_main

    return push_main(argv)


HANDLERS = {"generate": generate, "benchmark": benchmark, "calibrate": calibrate, "convert": convert, "push": push}


# ----------------------------------------------------------------------------- entry point


def _usage(error: str = "") -> int:
    """Print the usage (stdout for --help, stderr with ``error``); the exit status (0, or 2)."""
    text = __doc__.split("\n\n")[1]
    if not error:
        print("usage:\n" + text)
        return 0
    print("usage:\n" + text + f"\ndflash-hf: error: {error}", file=sys.stderr)
    return 2


def dispatch(argv: list) -> int:
    """Run the command ``argv[0]`` on the rest (``transformers`` first word dropped, refusals checked)."""
    if not argv or argv[0] in ("-h", "--help"):
        return _usage("" if argv else f"name a command: {', '.join(COMMANDS)}")
    command, rest = argv[0], argv[1:]
    if command not in HANDLERS:
        return _usage(f"unknown command {command!r}; expected one of {', '.join(COMMANDS)}")
    if rest[:1] == ["transformers"] and command in ("generate", "benchmark"):  # the authors' backend word
        rest = rest[1:]
    reason = refusal(command, rest)
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 1
    _on_path()
    return HANDLERS[command](rest)


def main(argv=None) -> int:
    """The console script: exit status 0, 1 (refused input: one line), 2 (usage), 130 (Ctrl-C, at any point)."""
    try:
        return dispatch(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
