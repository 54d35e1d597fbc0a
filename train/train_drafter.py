"""Train a DFlash drafter against a frozen target (DFlash paper, section 4).

    python -m train.train_drafter --preset smoke --threads 1          # about a minute on CPU -> runs/smoke/
    python -m train.train_drafter --preset smoke --threads 1 --resume # continue after Ctrl-C
    accelerate launch --multi_gpu --num_processes 8 -m train.train_drafter --preset dflash-b16 \\
        --target Qwen/Qwen3-8B --data chat.jsonl --name qwen3-8b-b16
    python -m train.train_drafter --preset pair --name pair-short     # stage 1 of the shipped pair/drafter
    python -m train.train_drafter --preset pair-long --init runs/pair-short/drafter --reproduce-pair  # stage 2
    python -m train.train_drafter --preset pair-dflash2              # DFlash 2 fine-tuned from pair/drafter

Everything a run writes goes under ``runs/<name>/`` (``--output-dir``): ``data/`` (the target's
responses, JSONL), ``features/`` (the feature cache, when used), ``checkpoints/``, ``train_log.jsonl``,
``summary.json`` and the final ``drafter/`` (a ``save_pretrained`` folder that loads with
``AutoModel.from_pretrained(..., trust_remote_code=True)``). Only ``--reproduce-pair`` writes into ``pair/``.

The pieces live in small modules, usable from a notebook: :mod:`train.data` (chat data, the target's
responses), :mod:`train.features` (tapped target states, packing, cache), :mod:`train.blocks` (anchors,
masks, loss), :mod:`train.model_init`, :mod:`train.evaluate`, :mod:`train.loop` (the accelerate loop),
:mod:`train.presets`. Their public names are also importable from here.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from convert.errors import CommandError
from convert.paths import locate_model

_EXPORTS = {
    "train.data": ["Example", "chat_prompts", "generate_continuations", "load_chat_rows", "load_examples",
                   "read_responses", "regenerate_responses", "render_prompt", "training_prompts"],
    "train.features": ["FeatureCache", "LiveFeatures", "compute_features", "packed_inputs", "target_features",
                       "write_feature_cache"],
    "train.blocks": ["IGNORE", "PUBLISHED_GAMMA", "PackedBatch", "block_inputs", "default_gamma", "drafter_loss",
                     "loss_weights", "pack_batch", "packed_block_mask", "sample_anchors", "trainable_anchor_positions"],
    "train.model_init": ["build_draft_config", "init_draft_from_target"],
    "train.evaluate": ["acceptance_stats", "eval_loss", "eval_selector", "mean_acceptance"],
    "train.selector": ["dflash2_config", "dflash2_from_dflash1", "dflash2_loss", "predecessor_ids", "selector_terms"],
    "train.loop": ["TrainConfig", "TrainingInterrupted", "latest_checkpoint", "lr_at", "make_accelerator",
                   "save_checkpoint", "train_drafter"],
    "train._paths": ["DFlashConfig", "DFlashDraftModel"],
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}


def __getattr__(name):  # lazy re-exports: `--help` stays instant (no torch / transformers import)
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def precompute_features(target, examples, layer_ids, batch_size: int = 8, dtype=None, progress: bool = True):
    """Features ``(T_i, F)`` on CPU for every example, each sequence run alone (notebook helper)."""
    import torch

    from train.features import compute_features

    return compute_features(target, [e.input_ids for e in examples], layer_ids, 0, dtype or torch.float32)


class UsageError(Exception):
    """An expected failure of the CLI (bad flag, missing file or model id, existing output): one line."""


# ----------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m train.train_drafter", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = ap.add_argument
    a("--preset", choices=["smoke", "pair", "pair-long", "pair-dflash2", "dflash-b16", "dflash-b10", "dflash-b8"],
      default=None,
      help="named flag set (train/presets.py); explicit flags override it")
    a("--name", default=None, help="run name: output under runs/<name>/ (default: the preset name, else 'drafter')")
    a("--output-dir", default=None, help="instead of runs/<name>/")
    a("--reproduce-pair", action="store_true",
      help="also copy the final drafter, log and summary into pair/ (implies --preset pair-long; needs --init with "
           "the stage-1 drafter of --preset pair)")
    a("--resume", action="store_true", help="continue the run in --output-dir (data, features, newest checkpoint)")
    a("--overwrite", action="store_true", help="delete an existing --output-dir first")
    a("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    a("--expect-processes", type=int, default=None,
      help="fail unless the launcher started this many processes (catches a launch that silently runs one)")
    g = ap.add_argument_group("model")
    g.add_argument("--target", default="pair/target", help="target folder or Hub id (AutoModelForCausalLM)")
    g.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--target-layer-ids", default=None,
                   help="comma-separated 0-based target layers (output of layer k); default: the published spread "
                        "for the target's depth (5 taps from layer 1 to L-3, never the last layer; the presets that "
                        "reproduce the shipped pair pin 1,3,5)")
    g.add_argument("--mask-token-id", type=int, default=None, help="default: the tokenizer's mask token")
    g.add_argument("--init", default="target",
                   help="'target' (see train/model_init.py), 'random', or a drafter folder to fine-tune (its layers, "
                        "block size and target layer ids must match the flags)")
    g = ap.add_argument_group("DFlash 2 (train/selector.py)")
    g.add_argument("--dflash2", action="store_true",
                   help="train a DFlash 2 drafter (convolutions + candidate selector); a DFlash 1 --init drafter is "
                        "extended with identity DFlash 2 parts, so training starts at its greedy drafts")
    g.add_argument("--conv-kernel-size", type=int, default=2, help="DFlash 2 convolution taps")
    g.add_argument("--conv-group-size", type=int, default=None, help="channels per group (default: 16 if it divides)")
    g.add_argument("--selector-rank", type=int, default=None, help="selector rank (default: min(256, hidden / 2))")
    g.add_argument("--selector-top-k", type=int, default=16, help="candidates per slot")
    g.add_argument("--selector-alpha", type=float, default=1.0, help="weight of the selector loss")
    g.add_argument("--selector-lr-scale", type=float, default=1.0, help="the selector's lr is --lr times this")
    g = ap.add_argument_group("data")
    g.add_argument("--data", default=None,
                   help="chat dataset ({'messages': [...]} rows): .jsonl/.json file or Hub id (streamed); "
                        "default: def+docstring prompts of the stdlib corpus (the shipped pair)")
    g.add_argument("--data-split", default="train")
    g.add_argument("--responses", default=None,
                   help="JSONL of {'prompt_ids','response_ids'} rows from an external engine: skip generation")
    g.add_argument("--regenerate", action=argparse.BooleanOptionalAction, default=True,
                   help="answer --data prompts with the target (else train on the dataset's own replies)")
    g.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="passed to the chat template (Qwen3-style thinking on/off)")
    g.add_argument("--num-prompts", type=int, default=1200, help="training prompts")
    g.add_argument("--num-eval-prompts", type=int, default=48, help="extra prompts kept out of training (eval)")
    g.add_argument("--max-new-tokens", type=int, default=192, help="response length when the target answers")
    g.add_argument("--sampled-fraction", type=float, default=0.25, help="share of responses sampled (rest greedy)")
    g.add_argument("--sample-temperature", type=float, default=0.8)
    g.add_argument("--gen-batch", type=int, default=32, help="prompts per generate call")
    g.add_argument("--max-len", type=int, default=512, help="tokens per training sequence (prompt + response)")
    g.add_argument("--long-prompts", default=None, metavar="LO:HI",
                   help="left-extend a --long-fraction share of the built-in prompts to LO..HI tokens with training-"
                        "split source (train.data.long_training_prompt_ids); without --data only")
    g.add_argument("--long-fraction", type=float, default=0.75, help="share of prompts --long-prompts extends")
    g = ap.add_argument_group("target features")
    g.add_argument("--features", choices=["live", "cache"], default="live",
                   help="run the target per batch, or once into runs/<name>/features/ (safetensors shards)")
    g.add_argument("--cache-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    g.add_argument("--pack-tokens", type=int, default=0,
                   help="pack sequences into target rows of this many tokens (block-diagonal mask); 0 = one each")
    g = ap.add_argument_group("optimisation")
    g.add_argument("--anchors", type=int, default=48, help="anchors per sequence")
    g.add_argument("--batch", type=int, default=4, help="sequences per micro-batch per process")
    g.add_argument("--grad-accum", type=int, default=1)
    g.add_argument("--epochs", type=int, default=6)
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--min-lr-ratio", type=float, default=0.0)
    g.add_argument("--warmup-ratio", type=float, default=0.04)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--clip", type=float, default=1.0)
    g.add_argument("--gamma", type=float, default=None, help="default: 7 for B=16, 5 for 10, 4 for 8")
    g.add_argument("--max-minutes", type=float, default=None, help="training wall-clock budget (cosine follows time)")
    g.add_argument("--max-steps", type=int, default=None)
    g.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=1,
                   help="torch threads per process (CPU); more than 1 only helps on an idle machine")
    g = ap.add_argument_group("logging")
    g.add_argument("--ckpt-every", type=int, default=100)
    g.add_argument("--eval-every", type=int, default=100, help="0: evaluate only at the end")
    g.add_argument("--eval-tau-prompts", type=int, default=4, help="held-out prompts decoded for tau")
    g.add_argument("--eval-max-new-tokens", type=int, default=64)
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--report-to", default=None, help="accelerate tracker(s), e.g. tensorboard, wandb, all")
    g.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    g.add_argument("--no-progress", action="store_true")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """Flags with the preset's values as defaults (explicit flags win). Raises UsageError on bad combinations."""
    from train.presets import PRESETS

    ap = build_parser()
    pre, _ = ap.parse_known_args(argv)
    preset = "pair-long" if pre.reproduce_pair and pre.preset is None else pre.preset
    if pre.reproduce_pair and preset != "pair-long":
        raise UsageError(f"--reproduce-pair rebuilds pair/drafter with --preset pair-long, not --preset {preset}")
    if pre.reproduce_pair and pre.init in ("target", "random"):
        raise UsageError("--reproduce-pair fine-tunes the stage-1 drafter: first run `--preset pair --name pair-short`, "
                         "then pass --init runs/pair-short/drafter")
    if preset:
        ap.set_defaults(preset=preset, **PRESETS[preset])
    args = ap.parse_args(argv)
    if args.target is None:
        raise UsageError(f"--preset {preset} needs --target (a causal LM folder or Hub id)")
    if args.data and args.responses:
        raise UsageError("pass --data (prompts the target answers) or --responses (answers already made), not both")
    if preset and preset.startswith("dflash") and not (args.data or args.responses):
        raise UsageError(f"--preset {preset} needs --data (a chat dataset) or --responses (a JSONL of answers)")
    for flag in ("num_prompts", "batch", "grad_accum", "anchors", "max_len", "threads", "gen_batch"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    args.long_lengths = _parse_lengths(args.long_prompts) if args.long_prompts else None
    if args.long_lengths and (args.data or args.responses):
        raise UsageError("--long-prompts extends the built-in training prompts; it cannot be used with --data/--responses")
    if args.init not in ("target", "random") and not (Path(args.init) / "config.json").is_file():
        raise UsageError(f"--init {args.init!r}: expected 'target', 'random' or a drafter folder with a config.json")
    for flag in ("selector_alpha", "selector_lr_scale"):
        if not getattr(args, flag) > 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if not 0 <= args.sampled_fraction <= 1:
        raise UsageError(f"--sampled-fraction must be in [0, 1], got {args.sampled_fraction}")
    args.name = args.name or preset or "drafter"
    args.output_dir = Path(args.output_dir or Path("runs") / args.name)
    return args


def _parse_lengths(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise UsageError(f"--long-prompts {text!r}: expected LO:HI token counts, e.g. 64:1152") from None
    if not 1 <= lo <= hi:
        raise UsageError(f"--long-prompts {text!r}: expected 1 <= LO <= HI")
    return lo, hi


# ----------------------------------------------------------------------------- phases


def _load_target(args, device):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    target_path = locate_model(args.target, "--target")  # a mistyped folder: "no such folder", no Hub call
    try:
        tok = AutoTokenizer.from_pretrained(target_path)
        target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    except (OSError, ValueError) as e:  # missing / unreachable id, not a causal LM, unreadable files
        raise UsageError(f"cannot load the target {args.target!r}: {str(e).splitlines()[0]}") from e
    return tok, target.to(device).eval().requires_grad_(False)


def _response_files(args) -> dict:
    """The run's response files: ``{"train": [...], "eval": [...]}`` under ``runs/<name>/data/``."""
    d = args.output_dir / "data"
    if args.data and not args.regenerate:
        return {"train": [d / "train.jsonl"], "eval": [d / "eval.jsonl"]}
    sampled = int(round(args.sampled_fraction * args.num_prompts)) > 0
    return {"train": [d / "train_greedy.jsonl"] + ([d / "train_sampled.jsonl"] if sampled else []),
            "eval": [d / "eval.jsonl"]}


def _data_phase(args, tok, target, write: bool):
    """Write the run's response files (``write``: main process only; resumable), return (train, eval) Examples."""
    from train import data

    n_eval = args.num_eval_prompts
    if args.responses:
        rows = data.read_responses(args.responses, tok, args.max_len)
        if len(rows) <= n_eval:
            raise UsageError(f"{args.responses} has {len(rows)} usable rows, need more than --num-eval-prompts {n_eval}")
        return rows[n_eval:], rows[:n_eval]
    files = _response_files(args)
    if write:
        d = args.output_dir / "data"
        if args.data:
            rows = data.load_chat_rows(args.data, args.data_split)
            prompts = data.chat_prompts(rows, tok, args.enable_thinking, args.num_prompts + n_eval, args.max_len - 1,
                                        keep_replies=not args.regenerate)
            if len(prompts) <= n_eval:
                raise UsageError(f"{args.data} gave {len(prompts)} usable prompts, need more than "
                                 f"--num-eval-prompts {n_eval}")
            if not args.regenerate:
                d.mkdir(parents=True, exist_ok=True)
                for path, part in ((files["eval"][0], prompts[:n_eval]), (files["train"][0], prompts[n_eval:])):
                    path.write_text("".join(json.dumps(p) + "\n" for p in part))
            else:
                ids = [p["prompt_ids"] for p in prompts]
                _answer(args, tok, target, ids[n_eval:], ids[:n_eval], d)
        elif args.long_lengths:
            ids = data.long_training_prompt_ids(tok, args.num_prompts + n_eval, args.long_lengths, args.long_fraction,
                                                seed=args.seed)
            _answer(args, tok, target, ids[n_eval:], ids[:n_eval], d, by_length=True)
        else:
            texts = data.training_prompts(args.num_prompts + n_eval, seed=args.seed)
            ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
            _answer(args, tok, target, ids[n_eval:], ids[:n_eval], d)
    train = [e for f in files["train"] for e in data.read_responses(f, max_len=args.max_len)]
    held = [e for f in files["eval"] for e in data.read_responses(f, max_len=args.max_len)]
    return train, held


def _answer(args, tok, target, train_ids, eval_ids, d, by_length: bool = False):
    """The target's responses: greedy, a ``--sampled-fraction`` share sampled; eval prompts greedy.
    ``by_length``: each part is answered in prompt-length order (padded batches of long prompts of
    mixed lengths would otherwise spend most of their compute on padding)."""
    from train.data import regenerate_responses

    n_sampled = int(round(args.sampled_fraction * len(train_ids)))
    if by_length:
        def by_len(part):
            return sorted(part, key=len)
        train_ids = by_len(train_ids[:n_sampled]) + by_len(train_ids[n_sampled:])
        eval_ids = by_len(eval_ids)
    common = dict(max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch, progress=not args.no_progress)
    regenerate_responses(target, tok, train_ids[n_sampled:], d / "train_greedy.jsonl", seed=args.seed, **common)
    if n_sampled:
        regenerate_responses(target, tok, train_ids[:n_sampled], d / "train_sampled.jsonl",
                             temperature=args.sample_temperature, seed=args.seed + 1, **common)
    regenerate_responses(target, tok, eval_ids, d / "eval.jsonl", seed=args.seed + 2, **common)


def _fine_tune_start(args, layer_ids, mask_id):
    """``--init DIR``: the drafter in DIR (fp32) to continue training, after checking it is the drafter
    the flags describe. Raises UsageError naming the first field that differs."""
    import torch

    from train._paths import DFlashDraftModel

    try:
        draft = DFlashDraftModel.from_pretrained(args.init, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - safetensors / OSError / config errors of a damaged folder
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"--init {args.init}: cannot load the drafter ({type(e).__name__}: {first}); "
                         "pass a complete drafter folder (config.json + model.safetensors)") from e
    c = draft.config
    for name, have, want in (("--layers", c.num_hidden_layers, args.layers), ("--block-size", c.block_size, args.block_size),
                             ("--target-layer-ids", list(c.target_layer_ids), list(layer_ids)),
                             ("--mask-token-id", c.mask_token_id, mask_id)):
        if have != want:
            raise UsageError(f"--init {args.init}: the drafter has {name} {have}, the flags ask for {want}")
    return draft, {"fine_tuned_from": str(args.init)}


def _prepare_output_dir(args) -> None:
    out = args.output_dir
    if out.exists() and any(out.iterdir()) and not args.resume:
        if not args.overwrite:
            raise UsageError(f"{out} already exists: continue it with --resume, or pass --overwrite or another --name")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _save_final(draft, out: Path, dtype_name: str) -> int:
    """``save_pretrained`` into ``out`` through a temporary folder and a rename; returns the weights' bytes."""
    import torch

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    draft.to(getattr(torch, dtype_name)).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def _link_pair_code(folder: Path) -> None:
    """Turn the code files ``save_pretrained`` copied into ``folder`` (``pair/drafter``) back into relative
    links to the repository root's files, their one source (tests/test_layout.py checks the links)."""
    for path in [*folder.glob("*.py"), *folder.glob("custom_generate/*.py")]:
        source = Path("custom_generate_template.py" if path.parent.name == "custom_generate" else path.name)
        if source.is_file() and path.read_bytes() == source.read_bytes():
            path.unlink()
            path.symlink_to(os.path.relpath(source, path.parent))


def run(args) -> dict:
    """data -> features -> draft -> :func:`train.loop.train_drafter` -> ``runs/<name>/drafter`` + summary."""
    import torch
    import transformers

    from train import features as tfeat
    from train.loop import TrainConfig, latest_checkpoint, make_accelerator, train_drafter
    from train.model_init import build_draft_config, init_draft_from_target
    from train.presets import spread_layer_ids
    from train._paths import DFlashDraftModel

    torch.set_num_threads(args.threads)
    acc = make_accelerator(mixed_precision=args.mixed_precision, log_with=args.report_to,
                           project_dir=str(args.output_dir))
    if args.expect_processes and acc.num_processes != args.expect_processes:
        raise UsageError(f"{acc.num_processes} process(es) running, --expect-processes {args.expect_processes}: "
                         "without GPUs launch with `accelerate launch --multi_gpu --num_processes N` "
                         "(`--cpu` starts one) or `torchrun --nproc_per_node N`")
    if acc.is_main_process:
        _prepare_output_dir(args)
    acc.wait_for_everyone()
    t0 = time.time()
    tok, target = _load_target(args, acc.device)
    n_target_layers = target.config.get_text_config().num_hidden_layers
    try:
        layer_ids = ([int(x) for x in args.target_layer_ids.split(",")] if args.target_layer_ids
                     else spread_layer_ids(n_target_layers))
    except ValueError as e:
        raise UsageError(f"--target-layer-ids {args.target_layer_ids!r}: {e}") from None
    bad = [k for k in layer_ids if not 0 <= k < n_target_layers]
    if bad:
        raise UsageError(f"--target-layer-ids {layer_ids}: {bad} outside the target's {n_target_layers} layers")
    mask_id = args.mask_token_id if args.mask_token_id is not None else tok.mask_token_id
    if mask_id is None:
        raise UsageError("the tokenizer has no mask token; pass --mask-token-id (a reserved, never-generated id)")
    fine_tune = None
    if args.init not in ("target", "random") and not args.resume:  # checked before the long data phase
        fine_tune = _fine_tune_start(args, layer_ids, mask_id)

    t_data = time.time()
    try:
        if acc.is_main_process:
            _data_phase(args, tok, target, write=True)
        acc.wait_for_everyone()  # the other processes read what the main process wrote
        examples, eval_examples = _data_phase(args, tok, target, write=False)
    except ValueError as e:
        raise UsageError(str(e)) from e
    data_s = time.time() - t_data

    t_feat = time.time()
    if args.features == "cache":
        cache_dir = args.output_dir / "features"
        if acc.is_main_process:
            try:
                tfeat.write_feature_cache(target, examples, layer_ids, cache_dir, getattr(torch, args.cache_dtype),
                                          pack_tokens=args.pack_tokens, progress=not args.no_progress)
            except ValueError as e:
                raise UsageError(str(e)) from e
        acc.wait_for_everyone()
        feats = tfeat.FeatureCache(cache_dir)
    else:
        feats = tfeat.LiveFeatures(target, examples, layer_ids, args.pack_tokens)
    eval_feats = tfeat.LiveFeatures(target, eval_examples, layer_ids, args.pack_tokens)
    feat_s = time.time() - t_feat
    eval_prompts = [e.input_ids[None, : e.prompt_len].to(acc.device) for e in eval_examples[: args.eval_tau_prompts]]

    ckpt_dir = args.output_dir / "checkpoints"
    resume = latest_checkpoint(ckpt_dir) if args.resume else None
    log_path = args.output_dir / "train_log.jsonl"
    if resume is not None:
        draft = DFlashDraftModel.from_pretrained(resume, dtype=torch.float32)
        init_report = {"resumed_from": str(resume)}
        if acc.is_main_process:
            print(f"resuming from {resume}", flush=True)
    else:
        cfg = build_draft_config(target, args.layers, args.block_size, layer_ids, mask_id,
                                 target_model_id=str(args.target))
        torch.manual_seed(args.seed)
        draft = DFlashDraftModel(cfg)
        if fine_tune is not None:
            draft, init_report = fine_tune
        else:
            init_report = init_draft_from_target(draft, target) if args.init == "target" else {"copied": []}
        if args.dflash2 and not getattr(draft, "_is_dflash2_class", False):
            from train.selector import dflash2_from_dflash1

            try:
                draft = dflash2_from_dflash1(draft, kernel_size=args.conv_kernel_size, group_size=args.conv_group_size,
                                             rank=args.selector_rank, top_k=args.selector_top_k)
            except ValueError as e:
                raise UsageError(f"--dflash2: {e}") from e
            init_report = {**init_report, "dflash2": "identity convolutions and zero successor codebook added"}
        if acc.is_main_process:
            log_path.write_text("")
    tcfg = TrainConfig(num_anchors=args.anchors, batch_size=args.batch, grad_accum=args.grad_accum,
                       epochs=args.epochs, lr=args.lr, min_lr_ratio=args.min_lr_ratio, warmup_ratio=args.warmup_ratio,
                       weight_decay=args.weight_decay, clip=args.clip, gamma=args.gamma, max_minutes=args.max_minutes,
                       max_steps=args.max_steps, seed=args.seed, log_every=args.log_every, eval_every=args.eval_every,
                       ckpt_every=args.ckpt_every, eval_max_new_tokens=args.eval_max_new_tokens,
                       selector_alpha=args.selector_alpha, selector_lr_scale=args.selector_lr_scale,
                       progress=not args.no_progress)
    n_train = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    if acc.is_main_process:
        print(f"draft: {draft.config.num_hidden_layers} layers, {n_train / 1e6:.3f} M trainable params; "
              f"{len(examples)} training sequences ({sum(len(e.input_ids) for e in examples)} tokens); "
              f"{acc.num_processes} process(es); data {data_s:.0f}s, features {feat_s:.0f}s", flush=True)
    if args.report_to:
        acc.init_trackers(args.name, config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str))})
    try:
        result = train_drafter(draft, target, examples, feats, tcfg, eval_examples, eval_feats, eval_prompts,
                               log_path, ckpt_dir, resume, accelerator=acc)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if args.report_to:
        acc.end_training()
    if not acc.is_main_process:
        return result
    final = args.output_dir / "drafter"
    draft = acc.unwrap_model(draft)
    size = _save_final(draft, final, args.save_dtype)
    summary = {
        "command": "python -m train.train_drafter " + " ".join(sys.argv[1:]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "draft_config": draft.config.to_dict(), "init": init_report, "trainable_params": n_train,
        "weights_bytes": size, "saved_dtype": args.save_dtype, "num_train_sequences": len(examples),
        "num_train_tokens": sum(len(e.input_ids) for e in examples), "num_eval_sequences": len(eval_examples),
        "data_wall_s": round(data_s, 1), "features_wall_s": round(feat_s, 1), "total_wall_s": round(time.time() - t0, 1),
        **result, "device": str(acc.device), "threads": args.threads, "python_version": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    (args.output_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    if args.reproduce_pair:
        _save_final(draft, Path("pair/drafter"), args.save_dtype)
        _link_pair_code(Path("pair/drafter"))
        shutil.copy(log_path, "pair/drafter_train_log.jsonl")
        shutil.copy(args.output_dir / "summary.json", "pair/drafter_train_summary.json")
    ev = result["final_eval"]
    print(f"done: {result['steps']} steps in {result['train_wall_s']:.0f}s; held-out loss "
          f"{ev.get('heldout_loss', float('nan')):.3f}, tau {ev.get('tau', float('nan')):.2f}; drafter -> {final}\n"
          f"export: python -m convert.convert_checkpoint {final} {args.output_dir / 'export'}", flush=True)
    return summary


def main(argv=None) -> int:
    """The CLI: expected failures end in one line on stderr (exit 1; ``--debug`` shows the traceback), usage
    errors of argparse exit 2, Ctrl-C ends in one line saying how to resume (exit 130)."""
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        args = parse_args(argv)
        run(args)
        return 0
    except KeyboardInterrupt as e:
        if debug:
            raise
        step = getattr(e, "step", None)
        where = f"at step {step}" if step is not None else "before training started (generated data is kept)"
        ckpt = getattr(e, "checkpoint", None)
        saved = f", checkpoint {ckpt}" if ckpt else ""
        print(f"\ninterrupted {where}{saved}; continue with the same command plus --resume", file=sys.stderr)
        return 130
    except (UsageError, CommandError, FileNotFoundError, FileExistsError) as e:
        if debug:
            raise
        print(f"error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:  # an optional package (datasets, tokenizers ...): named with its extra
        from convert.cli import missing_package_message

        message = missing_package_message(e)
        if debug or message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
