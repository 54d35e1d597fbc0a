"""Per-step cost of a DSpark step beside a DFlash 1 step of the same size (prints figures; not a test).

    python bench/dspark_step_cost.py [--threads 1] [--prompts 4] [--new 48] [--rounds 3]

The shipped pair's target with the shipped DFlash 1 drafter, and a DSpark drafter of the same sizes built
from it (issue 38): the same backbone weights (``fc``, ``hidden_norm``, layers, ``norm``), its own
``embed_tokens`` / ``lm_head`` copied from the target's (as DeepSpec's ``initialize_embeddings_and_head``
copies them), a Markov head of the published rank 256 (``config/dspark/*.py``) with zero weights, and a
confidence head with zero weights and bias +20 run with ``confidence_threshold=0.5`` (sigmoid ~ 1: it cuts
nothing, checked). Both draft one forward over ``block_size`` = 16 positions ``[anchor, MASK x 15]``: DFlash 1
keeps slots 1..15 (15 drafts, verifies 16), DSpark all 16 slots (16 drafts through the Markov walk, verifies
17). Greedy, batch 1, fp32 on CPU, one process; the two drafters alternate prompt by prompt in each round
(interleaved), ``rounds`` times after a warm-up round that also checks both give the target's own tokens.

Reported per verify step: the median over every (round, prompt) run and its spread (min .. max), for the
draft forward with its logits (``proposers._draft_logits``), the proposal (DFlash 1: per-slot argmax;
DSpark: the Markov walk), the confidence head (DSpark only), their sum, and the whole step (``decode_s`` of
``output_timings`` / steps). Acceptance is not reported: DSpark's slot k predicts ``start + k + 1`` and this
backbone was trained for ``start + k``, so its drafts are off by one position by construction.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import proposers  # noqa: E402
from configuration_dflash import DFlashConfig  # noqa: E402
from modeling_dflash import DFlashDraftModel, DSparkDraftModel  # noqa: E402

PUBLISHED = dict(markov_rank=256, markov_head_type="vanilla", enable_confidence_head=True,
                 confidence_head_with_markov=True, num_anchors=512)  # DeepSpec config/dspark/*.py
THRESHOLD, BIAS = 0.5, 20.0
PARTS = ("draft forward + logits", "proposal", "confidence head", "draft + proposal", "whole step")


def dspark_from(draft, target) -> DSparkDraftModel:
    """A DSpark drafter on ``draft``'s backbone weights with the target's embedding / head copied in, a zero
    Markov head and a confidence head that says 'accepted' everywhere (weights 0, bias ``BIAS``)."""
    values = {k: v for k, v in draft.config.to_dict().items() if k not in ("auto_map", "dflash_config")}
    config = DFlashConfig(**{**values, "architectures": ["Qwen3DSparkModel"], **PUBLISHED})
    model = DSparkDraftModel(config).to(dtype=draft.fc.weight.dtype).eval()
    missing, unexpected = model.load_state_dict(draft.state_dict(), strict=False)
    assert not unexpected and all(k.split(".")[0] in ("embed_tokens", "lm_head", "markov_head", "confidence_head")
                                  for k in missing), (missing, unexpected)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        model.lm_head.weight.copy_(target.get_output_embeddings().weight)
        model.markov_head.markov_w1.weight.zero_()
        model.markov_head.markov_w2.weight.zero_()
        model.confidence_head.proj.weight.zero_()
        model.confidence_head.proj.bias.fill_(BIAS)
    return model


class Timer:
    """Wall-clock seconds spent in the wrapped functions of the decode loop, by label."""

    def __init__(self):
        self.spent, self.saved = {}, []

    def wrap(self, owner, name, label):
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.spent[label] = self.spent.get(label, 0.0) + time.perf_counter() - start

        self.saved.append((owner, name, real))
        setattr(owner, name, timed)

    def restore(self):
        for owner, name, real in reversed(self.saved):
            setattr(owner, name, real)


def run(draft, target, ids, new, **kwargs):
    """One greedy spec_generate; returns (sequences, drafted per step, tokens committed per step,
    {part: ms per verify step})."""
    timer = Timer()
    timer.wrap(proposers, "_draft_logits", "draft forward + logits")
    timer.wrap(proposers.BlockProposer, "choose", "proposal")
    timer.wrap(proposers.DSparkProposer, "choose", "proposal")
    timer.wrap(proposers, "confidence_logits", "confidence head")
    try:
        out = draft.spec_generate(target, ids, max_new_tokens=new, temperature=0.0, stop_token_ids=[],
                                  return_dict_in_generate=True, output_timings=True,
                                  **{"adaptive_block_size": False, **kwargs})
    finally:
        timer.restore()
    steps = len(out.acceptance_lengths)
    parts = {k: timer.spent.get(k, 0.0) / steps * 1e3 for k in PARTS[:3]}
    parts["draft + proposal"] = sum(parts.values())
    parts["whole step"] = out["timings"]["decode_s"] / steps * 1e3
    return out.sequences, out.row_draft_lengths[0], out.acceptance_lengths, parts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pair = os.path.join(REPO, "pair")
    from convert.loading import model_load_kwargs

    target = AutoModelForCausalLM.from_pretrained(os.path.join(pair, "target"), dtype=torch.float32,
                                                  **model_load_kwargs()).eval()
    tok = AutoTokenizer.from_pretrained(os.path.join(pair, "target"))
    one = DFlashDraftModel.from_pretrained(os.path.join(pair, "drafter"), dtype=torch.float32).eval()
    spark = dspark_from(one, target)
    drafters = (("DFlash 1", one, {}),  # DSpark accepts ~nothing here (off by one slot): no low-acceptance warning
                ("DSpark", spark, {"confidence_threshold": THRESHOLD, "low_acceptance_warning": None}))
    with open(os.path.join(pair, "heldout_prompts.json")) as f:
        prompts = [tok(p["prompt"], return_tensors="pt", add_special_tokens=False)["input_ids"]
                   for p in json.load(f)[: args.prompts]]
    for ids in prompts:  # warm-up, and the checks: the target's own tokens, full blocks (the cut cuts nothing)
        ref = target.generate(ids, max_new_tokens=args.new, do_sample=False, min_new_tokens=args.new)
        for name, draft, kwargs in drafters:
            seq, drafted, accepted, _ = run(draft, target, ids, args.new, **kwargs)
            assert torch.equal(seq, ref), f"{name} must give the target's greedy tokens"
        if name == "DSpark":  # full blocks wherever the budget allows: drafts = min(block, tokens left - 1)
            committed = [1 + sum(accepted[:i]) for i in range(len(accepted))]
            want = [min(spark.config.block_size, args.new - c - 1) for c in committed]
            assert drafted == want, ("the confidence head must cut nothing", drafted, want)
    results = {name: {} for name, _, _ in drafters}
    for _ in range(args.rounds):
        for ids in prompts:
            for name, draft, kwargs in drafters:
                *_, parts = run(draft, target, ids, args.new, **kwargs)
                for k, v in parts.items():
                    results[name].setdefault(k, []).append(v)
    cfg = one.config
    print(f"shipped pair, greedy, batch 1, fp32 CPU, {args.threads} thread(s), {args.prompts} prompts x {args.new} "
          f"new tokens, {args.rounds} interleaved rounds ({args.rounds * args.prompts} runs per drafter)")
    print(f"both: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, draft forward over {cfg.block_size} positions; "
          f"DFlash 1 drafts {cfg.block_size - 1} / verifies {cfg.block_size}, DSpark drafts {cfg.block_size} / verifies "
          f"{cfg.block_size + 1} (Markov rank {PUBLISHED['markov_rank']}, zero; confidence head cutting nothing at "
          f"threshold {THRESHOLD})")
    print(f"{'ms per verify step: median (min .. max)':40s} {'DFlash 1':>22s} {'DSpark':>22s} {'ratio':>6s}")
    for part in PARTS:
        cells, medians = [], []
        for name, _, _ in drafters:
            values = results[name].get(part, [0.0])
            medians.append(statistics.median(values))
            cells.append(f"{medians[-1]:6.2f} ({min(values):5.2f} .. {max(values):5.2f})")
        ratio = f"{medians[1] / medians[0]:6.3f}" if medians[0] > 0 else "     -"
        print(f"{part:40s} {cells[0]:>22s} {cells[1]:>22s} {ratio}")


if __name__ == "__main__":
    main()
