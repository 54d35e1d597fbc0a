"""One prepared GPU check: exactness on CUDA, the cost ratio c per path, syncs per step. Run by gpu_check.sh.

Prints one JSON line after every measurement (so a run cut short still leaves figures):

* ``versions``: python, torch, transformers, device.
* ``exactness`` (a): the shipped pair (pair/target + pair/drafter), sdpa, bf16 and fp16 (fp32 in the
  dry run), greedy ``spec_generate`` against ``target.generate(do_sample=False)``: first the dynamic
  path and the uncompiled static path, and, at the end of the run (compiling takes the longest),
  the compiled static path; at the first divergence, the target's top-1 minus top-2 logit there (a
  near-tie is a rounding divergence, not a wrong token). Every line says ``kernels``: ``off`` (the package's
  loads: ``use_kernels=False`` on transformers >= 5.25) or ``on`` (one more bf16 pass with the target loaded
  with Hub kernels, transformers 5.25's default; a load that fails, e.g. offline, is one refused line).
* ``compile``: the static path's first call (compiling) and second call, and their difference.
* ``speed`` (b): Qwen3-8B shape with random weights built directly on the GPU in bf16; for the
  default (dynamic) path at block 8 and 16, draft trees (tree@15, tree@64) and the static compiled
  path at block 16, each with a random draft (tau about 1) and an oracle draft (full acceptance; the
  real draft forward still runs, then its logits are replaced by the target's own greedy tokens):
  ``c = seconds per verify step /
  seconds per token of plain target decoding`` (``target.generate``, dynamic cache), tau, peak memory.
  Every time is the median of ``--repeats`` runs (3 by default) after a warm-up. Plain decoding per
  token is ``(median N-token generate - median 1-token generate) / (N - 1)``: both medians are taken
  separately, and a figure whose inputs make it non-positive or non-finite is not printed (its key is
  null and ``refused`` says why, naming the inputs), nor is anything derived from it.
* ``syncs`` (c): host-device synchronisations of spec_generate steps under
  ``torch.cuda.set_sync_debug_mode("warn")`` (one warning per sync), per verify step.

``--dry-run``: the same code on CPU at a tiny shape in fp32, the static path uncompiled (the compiled
path is tested on CPU by tests/test_static_generate.py), so a typo fails in CI rather than on the GPU.
Sync counting needs CUDA and reports ``cuda: false`` there (the counts refused). No figure here has
been measured on a GPU yet.
"""

import argparse
import json
import math
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

import generation_utils  # noqa: E402
import proposers  # noqa: E402
import static_generate  # noqa: E402
from configuration_dflash import DFlashConfig  # noqa: E402
from convert.loading import model_load_kwargs  # noqa: E402
from modeling_dflash import DFlashDraftModel  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
DRAFT_8B = dict(num_hidden_layers=5, target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36)  # notes sec. 2
TINY = dict(vocab_size=211, hidden_size=64, rms_norm_eps=1e-6, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False)
DRAFT_TINY = dict(num_hidden_layers=1, target_layer_ids=[0, 3], num_target_layers=4)


def static_name(compile_config):
    return "static" if compile_config is None else "static_compiled"


# Measured or derived figures: printed only when positive and finite, else null with a reason in ``refused``.
FIGURES = ("s_per_token", "prefill_s", "decode_s", "first_call_s", "second_call_s", "compile_s", "c", "s_per_step",
           "tau", "tokens_per_s", "speedup_vs_plain", "peak_gib")
COUNTS = ("syncs_per_step", "syncs_prefill")  # printed when >= 0 and finite (0 syncs is a result)


def emit(**record):
    """Print one JSON line; a figure (``FIGURES``) that is not positive and finite, or a count (``COUNTS``)
    that is negative, is replaced by null and its reason added to ``refused`` (reasons passed in ``refused``
    are kept). Raises ValueError for a null figure without a reason (a bug in this script)."""
    refused = dict(record.pop("refused", None) or {})
    for key in FIGURES + COUNTS:
        if key in refused:
            record[key] = None
            continue
        if key not in record:
            continue
        value, low = record[key], 0 if key in COUNTS else None
        if value is None:
            raise ValueError(f"figure {key!r} is null without a reason")
        ok = isinstance(value, (int, float)) and math.isfinite(value) and (value >= low if low is not None else value > 0)
        if not ok:
            record[key] = None
            refused[key] = f"{key} = {value!r} is not {'>= 0' if low is not None else 'positive'} and finite"
    if refused:
        record["refused"] = refused
    print(json.dumps(record), flush=True)


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def per_unit_difference(long_s, short_s, units, what):
    """``((long_s - short_s) / units, None)``, or ``(None, reason)`` when an input or the result is not
    positive and finite: the reason names the figure and both inputs (a per-token time that is the
    difference of two timings can come out negative when noise exceeds the difference)."""
    value = (long_s - short_s) / units if units > 0 else float("nan")
    if positive(long_s) and positive(short_s) and positive(value):
        return value, None
    return None, (f"{what} = ({long_s!r} s - {short_s!r} s) / {units} is not positive: the longer run did not take "
                  f"longer than the shorter one (noise, or too few tokens to measure)")


def ratio(num, den, what, den_why=None):
    """``(num / den, None)`` or ``(None, reason)`` unless both are positive and finite."""
    if den_why is not None:
        return None, f"{what} needs {den_why}"
    if positive(num) and positive(den):
        return num / den, None
    return None, f"{what} = {num!r} / {den!r} has an input that is not positive and finite"


def median_s(fn, device, repeats):
    """``(median seconds of fn() over repeats, the last result)``, synchronising the device around each."""
    times, result = [], None
    for _ in range(repeats):
        t0 = sync(device)
        result = fn()
        times.append(sync(device) - t0)
    return statistics.median(times), result


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def peak_gib(device):
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# ----------------------------------------------------------------------------- (a) exactness


def first_divergence_margin(target, ref, out, prompt_len):
    """(index of the first differing new token or None, top-1 minus top-2 target logit there)."""
    n = min(ref.shape[1], out.shape[1])
    diff = (ref[0, :n] != out[0, :n]).nonzero()
    if len(diff) == 0 and ref.shape == out.shape:
        return None, None
    i = int(diff[0, 0]) if len(diff) else n
    with torch.no_grad():
        logits = target(ref[:, :i]).logits[0, -1].float()
    top = logits.topk(2).values
    return i - prompt_len, float(top[0] - top[1])


def check_exactness(device, dtypes, static_config, new_tokens, n_prompts, kernels=False):
    """Greedy equality against ``target.generate`` on the shipped pair: the dynamic path, and the
    static path with ``static_config`` (None: uncompiled). ``kernels``: the target loaded with Hub kernels
    (transformers >= 5.25's default; ``use_kernels=True``), rows marked ``kernels=on``; a load that fails
    (no network, no ``kernels`` package) is one refused row."""
    tok = AutoTokenizer.from_pretrained(ROOT / "pair" / "target")
    prompts = [p["prompt"] for p in json.loads((ROOT / "pair" / "heldout_prompts.json").read_text())][:n_prompts]
    for dtype in dtypes:
        try:
            target = AutoModelForCausalLM.from_pretrained(ROOT / "pair" / "target", dtype=dtype,
                                                          attn_implementation="sdpa", **model_load_kwargs(kernels))
            target = target.to(device).eval()
        except Exception as err:  # noqa: BLE001 (any load failure is reported, the script goes on)
            emit(check="exactness", kernels="on" if kernels else "off", dtype=str(dtype).split(".")[-1],
                 refused={"equal": f"{type(err).__name__}: {str(err)[:200]}"})
            continue
        draft = DFlashDraftModel.from_pretrained(ROOT / "pair" / "drafter", dtype=dtype,
                                                 **model_load_kwargs()).to(device).eval()
        paths = {static_name(static_config): dict(cache_implementation="static", compile_config=static_config)}
        if static_config is None:
            paths = {"dynamic": {"adaptive_block_size": False}, **paths}  # fixed blocks; the policy's rows below
        paths.update({"tree@15": {"tree_budget": 15}, "tree@64": {"tree_budget": 64},  # draft trees (dynamic loop)
                      "adaptive": {"adaptive_block_size": True}, "tree@auto": {"tree_budget": "auto"}})  # the policy
        for k, text in enumerate(prompts):
            ids = tok(text, return_tensors="pt").input_ids.to(device)
            ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, pad_token_id=tok.pad_token_id)
            for name, kwargs in paths.items():
                out = draft.spec_generate(target, ids, max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=[],
                                          return_dict_in_generate=True, **kwargs)
                at, margin = first_divergence_margin(target, ref, out.sequences, ids.shape[1])
                tie = 8 * torch.finfo(dtype).eps * 30  # a few units of rounding at logit magnitude ~30
                emit(check="exactness", kernels="on" if kernels else "off", dtype=str(dtype).split(".")[-1], path=name,
                     prompt=k, equal=at is None,
                     first_divergence=at, logit_margin=margin, ok=at is None or (margin is not None and margin <= tie),
                     tau=round(sum(out.acceptance_lengths) / max(len(out.acceptance_lengths), 1), 3))
        del target, draft


def check_big_targets(device, new_tokens, n_prompts):
    """The shipped pair's target split over two GPUs (``device_map``, when the machine has two) and
    quantized to FP8 on load (``FineGrainedFP8Config``): greedy ``spec_generate`` against that target's own
    ``generate`` (a divergence is reported with its logit margin: a quantized kernel may round a verify
    block differently from a one-token decode). Each case that cannot run here prints why."""
    tok = AutoTokenizer.from_pretrained(ROOT / "pair" / "target")
    prompts = [p["prompt"] for p in json.loads((ROOT / "pair" / "heldout_prompts.json").read_text())][:n_prompts]
    cases = {}
    if torch.cuda.device_count() >= 2:
        cases["split_2_gpus"] = dict(device_map="auto", max_memory={0: "300MiB", 1: "40GiB"}, dtype=torch.bfloat16)
    else:
        emit(check="big_target", case="split_2_gpus", refused={"equal": "one GPU on this machine"})
    if hasattr(transformers, "FineGrainedFP8Config"):
        cases["fp8"] = dict(quantization_config=transformers.FineGrainedFP8Config(), dtype=torch.bfloat16,
                            device_map={"": device.index or 0})
    for case, kwargs in cases.items():
        try:
            target = AutoModelForCausalLM.from_pretrained(ROOT / "pair" / "target", **kwargs, **model_load_kwargs()).eval()
            draft = DFlashDraftModel.from_pretrained(ROOT / "pair" / "drafter", dtype=torch.bfloat16)
            draft = draft.to(target.get_output_embeddings().weight.device).eval()
            for k, text in enumerate(prompts):
                ids = tok(text, return_tensors="pt").input_ids.to(target.device)
                ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=tok.pad_token_id)
                for name, extra in (("chain", {"adaptive_block_size": False}), ("tree@15", {"tree_budget": 15})):
                    out = draft.spec_generate(target, ids, max_new_tokens=new_tokens, temperature=0.0,
                                              stop_token_ids=[], return_dict_in_generate=True, **extra)
                    at, margin = first_divergence_margin(target, ref, out.sequences, ids.shape[1])
                    emit(check="big_target", case=case, path=name, prompt=k, equal=at is None, first_divergence=at,
                         logit_margin=margin, tau=round(out.tau, 3))
            del target, draft
        except Exception as err:  # a case this machine cannot run: say why, go on with the others
            emit(check="big_target", case=case, refused={"equal": f"{type(err).__name__}: {str(err)[:300]}"})
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- (b) speed


def build_pair(device, dtype, shape, draft_shape, block_size):
    """Random target and draft built directly on ``device`` in ``dtype`` (no CPU init)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            target = Qwen3ForCausalLM(Qwen3Config(**shape, attn_implementation="sdpa")).eval()
            draft_cfg = DFlashConfig(**{k: shape[k] for k in ("vocab_size", "hidden_size", "num_attention_heads",
                                                                "num_key_value_heads", "head_dim", "rms_norm_eps")},
                                     intermediate_size=shape["intermediate_size"], block_size=block_size,
                                     mask_token_id=shape["vocab_size"] - 1, **draft_shape)
            draft = DFlashDraftModel(draft_cfg).eval()
    finally:
        torch.set_default_dtype(old)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    return target, draft


class Oracle:
    """Replaces the draft's logits (after the real draft forward ran) by the target's greedy tokens,
    indexed on the device (no sync): full acceptance up to rounding. Patched where each loop looks the
    draft logits up (``proposers._draft_logits``, ``static_generate._draft_logits``); leaving the
    ``with`` block raises when the oracle never ran (a patch on a name the loop no longer reads)."""

    def __init__(self, ref):
        self.ref = ref[0]  # (prompt + new,) on the device
        self.saved = []
        self.calls = 0

    def logits(self, start, b, vocab):
        self.calls += 1
        idx = (start.reshape(1) + torch.arange(1, b, device=start.device)).clamp_max(self.ref.shape[0] - 1)
        return torch.nn.functional.one_hot(self.ref[idx], vocab).float()[None] * 30

    def __enter__(self):
        dyn, sta = proposers._draft_logits, static_generate._draft_logits

        def fake_dynamic(draft, embed, head, anchor, ctx, cache, valid, start, b, mask_token_id):
            real = dyn(draft, embed, head, anchor, ctx, cache, valid, start, b, mask_token_id)
            return self.logits(start, b, real.shape[-1])

        def fake_static(fn, draft, embed, head, anchor, features, n_ctx, cache, b, mask_token_id):
            real = sta(fn, draft, embed, head, anchor, features, n_ctx, cache, b, mask_token_id)
            return self.logits(cache.length, b, real.shape[-1])

        self.saved = [(proposers, "_draft_logits", dyn), (static_generate, "_draft_logits", sta)]
        proposers._draft_logits, static_generate._draft_logits = fake_dynamic, fake_static
        return self

    def __exit__(self, exc_type, *exc):
        for module, name, fn in self.saved:
            setattr(module, name, fn)
        if exc_type is None and not self.calls:
            raise RuntimeError("the oracle draft never ran: patch the draft logits where the decode loops look them up")


def plain_decode_s_per_token(target, ids, new_tokens, device, repeats):
    """Plain ``target.generate`` per token: ``(s_per_token or None, reason or None, prefill_s, decode_s, ref)``.

    ``prefill_s`` is the median time of a 1-token generate (the prefill and one step), ``decode_s`` that of
    a ``new_tokens`` generate, each over ``repeats`` runs after a warm-up; per token is their difference
    over ``new_tokens - 1`` ([`per_unit_difference`], refused when not positive)."""
    def gen(n):
        return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                               min_new_tokens=n)

    gen(4)  # warm-up
    prefill_s, _ = median_s(lambda: gen(1), device, repeats)
    decode_s, ref = median_s(lambda: gen(new_tokens), device, repeats)
    per_token, why = per_unit_difference(decode_s, prefill_s, new_tokens - 1, "s_per_token")
    return per_token, why, prefill_s, decode_s, ref


def spec_times(draft, target, ids, new_tokens, block_size, repeats, **kwargs):
    """Medians over ``repeats`` calls: ``(seconds per verify step, seconds per call, last output)``; a
    step is ``timings["decode_s"] / (num_target_forwards - 1)`` (the prefill excluded)."""
    steps_s, totals, out = [], [], None
    for _ in range(repeats):
        out = draft.spec_generate(target, ids, max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=[],
                                  block_size=block_size, output_timings=True, return_dict_in_generate=True, **kwargs)
        steps = out.num_target_forwards - 1
        steps_s.append(out.timings["decode_s"] / steps if steps > 0 else float("nan"))
        totals.append(out.timings["total_s"])
    return statistics.median(steps_s), statistics.median(totals), out


def check_speed(device, dtype, shape, draft_shape, prompt_len, new_tokens, compile_config, sync_tokens, repeats):
    target, draft = build_pair(device, dtype, shape, draft_shape, block_size=16)
    ids = torch.randint(0, shape["vocab_size"] - 1, (1, prompt_len), device=device,
                        generator=torch.Generator(device).manual_seed(0))
    plain_s, plain_why, prefill_s, decode_s, ref = plain_decode_s_per_token(target, ids, new_tokens, device, repeats)
    emit(check="speed", path="plain_target_decode", s_per_token=plain_s, prefill_s=prefill_s, decode_s=decode_s,
         prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats,
         refused={"s_per_token": plain_why} if plain_why else None)
    static = dict(cache_implementation="static", compile_config=compile_config)
    t0 = sync(device)
    spec_times(draft, target, ids, new_tokens, 16, 1, **static)  # compiles the draft and verify forwards
    first_s = sync(device) - t0
    second_s, _ = median_s(lambda: spec_times(draft, target, ids, new_tokens, 16, 1, **static), device, repeats)
    if compile_config is None:
        compile_s, compile_why = None, "the static path runs uncompiled here (dry run): nothing to compile"
    else:
        compile_s, compile_why = per_unit_difference(first_s, second_s, 1, "compile_s")
    emit(check="compile", path=static_name(compile_config), block_size=16, first_call_s=round(first_s, 4),
         second_call_s=round(second_s, 4), compile_s=compile_s, repeats=repeats,
         refused={"compile_s": compile_why} if compile_why else None)
    check_syncs(draft, target, ids, device, compile_config, sync_tokens)
    fixed = {"adaptive_block_size": False}
    runs = [("dynamic", 8, fixed), ("dynamic", 16, fixed), (static_name(compile_config), 16, static),
            ("tree@15", 16, {"tree_budget": 15}), ("tree@64", 16, {"tree_budget": 64}),  # draft trees, dynamic loop
            ("adaptive", 16, {"adaptive_block_size": True}), ("tree@auto", 16, {"tree_budget": "auto"})]  # the policy,
    # its cost table measured on this GPU (verify_policy.cost_file), never a CPU figure
    plain_need = None if plain_why is None else f"plain decode per token, refused: {plain_why}"
    for path, b, kwargs in runs:
        for draft_kind in ("random", "oracle"):
            oracle = Oracle(ref) if draft_kind == "oracle" else None
            with oracle if oracle is not None else _null():
                spec_times(draft, target, ids, new_tokens, b, 1, **kwargs)  # warm-up
                reset_peak(device)
                step_s, call_s, out = spec_times(draft, target, ids, new_tokens, b, repeats, **kwargs)
                exact = bool(torch.equal(out.sequences, ref))
            refused = {}
            c, refused["c"] = ratio(step_s, plain_s, "c", plain_need)
            speedup, refused["speedup_vs_plain"] = ratio(plain_s * new_tokens if plain_s else None, call_s,
                                                         "speedup_vs_plain", plain_need)
            tokens_per_s, refused["tokens_per_s"] = ratio(new_tokens, call_s, "tokens_per_s")
            if device.type != "cuda":
                refused["peak_gib"] = "no CUDA: peak memory is tracked on CUDA only"
            c, speedup, tokens_per_s = (None if v is None else round(v, 3) for v in (c, speedup, tokens_per_s))
            emit(check="speed", path=path, block_size=b, draft=draft_kind, c=c, s_per_step=step_s,
                 tau=round(sum(out.acceptance_lengths) / len(out.acceptance_lengths), 3), tokens_per_s=tokens_per_s,
                 speedup_vs_plain=speedup, peak_gib=peak_gib(device), equal_to_generate=exact, repeats=repeats,
                 refused={k: v for k, v in refused.items() if v})


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------- (c) syncs


def count_syncs(fn, device):
    """Run ``fn`` and count CUDA synchronisations (warnings from the sync debug mode); 0 on CPU."""
    if device.type != "cuda":
        fn()
        return 0
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def check_syncs(draft, target, ids, device, compile_config, tokens):
    """Syncs of ``tokens`` new tokens minus those of 1 (the prefill), per verify step, random draft."""
    fixed = {"adaptive_block_size": False}
    for path, kwargs in (("dynamic", fixed), (static_name(compile_config), dict(cache_implementation="static",
                                                                              compile_config=compile_config))):
        results = {}
        for n in (1, tokens):
            run = lambda: results.__setitem__(n, draft.spec_generate(  # noqa: E731
                target, ids, max_new_tokens=n, temperature=0.0, stop_token_ids=[], block_size=16,
                return_dict_in_generate=True, **kwargs))
            run()  # warm-up: compiles, allocates
            results[(n, "syncs")] = count_syncs(run, device)
        steps = results[tokens].num_target_forwards - results[1].num_target_forwards
        why = None if device.type == "cuda" else "no CUDA: syncs are counted by torch.cuda.set_sync_debug_mode only"
        if why is None and steps <= 0:
            why = f"{tokens} tokens took no more verify steps than 1 token ({steps})"
        per_step = None if why else round((results[(tokens, "syncs")] - results[(1, "syncs")]) / steps, 2)
        emit(check="syncs", path=path, cuda=device.type == "cuda", steps=steps, syncs_per_step=per_step,
             syncs_prefill=None if why else results[(1, "syncs")],
             refused={"syncs_per_step": why, "syncs_prefill": why} if why else None)


# ----------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shape on CPU, fp32, static path uncompiled")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per figure; the median is printed (default 3)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    torch.manual_seed(0)
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    emit(check="versions", python=platform.python_version(), torch=torch.__version__,
         transformers=transformers.__version__, device=torch.cuda.get_device_name() if cuda else "cpu",
         dry_run=args.dry_run)
    if not cuda and not args.dry_run:
        raise SystemExit("no CUDA device: run with --dry-run for the CPU rehearsal")
    if cuda:  # cheapest first, so that a run cut short still has the figures that matter most
        compile_config = CompileConfig()  # inductor, mode="reduce-overhead": CUDA graphs
        check_exactness(device, [torch.bfloat16, torch.float16], None, new_tokens=64, n_prompts=4)
        check_exactness(device, [torch.bfloat16], None, new_tokens=64, n_prompts=4, kernels=True)  # Hub kernels on
        check_speed(device, torch.bfloat16, QWEN3_8B, DRAFT_8B, prompt_len=256, new_tokens=128,
                    compile_config=compile_config, sync_tokens=17, repeats=args.repeats)
        torch.cuda.empty_cache()
        check_exactness(device, [torch.bfloat16, torch.float16], compile_config, new_tokens=64, n_prompts=4)
        check_big_targets(device, new_tokens=64, n_prompts=2)
    else:
        compile_config = None  # the static path uncompiled: tests/test_static_generate.py compiles it on CPU
        check_exactness(device, [torch.float32], None, new_tokens=12, n_prompts=1)
        check_speed(device, torch.float32, TINY, DRAFT_TINY, prompt_len=9, new_tokens=12,
                    compile_config=compile_config, sync_tokens=5, repeats=args.repeats)
    emit(check="done")


if __name__ == "__main__":
    main()
