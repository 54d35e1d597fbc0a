"""Per-step cost of a DFlash 2 step against a DFlash 1 step of the same size (prints figures; not a test).

    python bench/dflash2_step_cost.py [--threads 1] [--prompts 4] [--new 64] [--repeats 3]

The shipped pair's target with the shipped DFlash 1 drafter, and a DFlash 2 drafter built from it: the
same backbone weights, the published DFlash 2 sizes (convolution 2 taps, groups of 16 channels; selector
rank 256, top-k 16; z-lab/dflash tests/fixtures/dflash2-config.json) at their identity init (tap 0 = 1,
projection 0, successor codebook 0). The DFlash 2 drafter then drafts exactly the DFlash 1 tokens (checked:
identical outputs and acceptance), so both run the same steps and only the per-step cost differs: the
convolutions in every layer and the selector walk. Greedy, batch 1, fp32 on CPU; the two drafters
alternate prompt by prompt, ``repeats`` times, in one process. Reported per verify step (medians over
the repeats): the draft forward with its logits (``_draft_logits``), the proposal (DFlash 1: per-slot
argmax; DFlash 2: the walk), their sum, and the whole step (``decode_s`` of ``output_timings`` / steps).
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

import generation_utils  # noqa: E402
import proposers  # noqa: E402
import speculative_sampling  # noqa: E402
from configuration_dflash import DFlashConfig  # noqa: E402
from modeling_dflash import DFlash2DraftModel, DFlashDraftModel  # noqa: E402

PUBLISHED = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)


def dflash2_from(draft) -> DFlash2DraftModel:
    """A DFlash 2 drafter on ``draft``'s backbone weights, its DFlash 2 parts at the identity init."""
    config = DFlashConfig(**{**draft.config.to_dict(), "architectures": ["DFlash2DraftModel"], **PUBLISHED})
    model = DFlash2DraftModel(config).to(dtype=draft.fc.weight.dtype).eval()
    missing, unexpected = model.load_state_dict(draft.state_dict(), strict=False)
    assert not unexpected and all("_conv." in k or k.startswith("candidate_selector.") for k in missing)
    return model


class Timer:
    """Wall-clock seconds spent in the wrapped functions of the decode loop, by name."""

    def __init__(self):
        self.spent = {}
        self.saved = []

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


def run(draft, target, ids, new):
    """One greedy spec_generate; returns (sequences, acceptance lengths, {part: ms per step})."""
    timer = Timer()
    timer.wrap(proposers, "_draft_logits", "draft forward + logits")
    timer.wrap(proposers.BlockProposer, "choose", "proposal")
    timer.wrap(proposers.SelectorProposer, "choose", "proposal")
    try:
        out = draft.spec_generate(target, ids, max_new_tokens=new, temperature=0.0, stop_token_ids=[],
                                  return_dict_in_generate=True, output_timings=True, adaptive_block_size=False)
    finally:
        timer.restore()
    steps = len(out.acceptance_lengths)
    parts = {k: v / steps * 1e3 for k, v in timer.spent.items()}
    parts["draft + proposal"] = sum(parts.values())
    parts["whole step"] = out["timings"]["decode_s"] / steps * 1e3
    return out.sequences, out.acceptance_lengths, parts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pair = os.path.join(REPO, "pair")
    from convert.loading import model_load_kwargs

    target = AutoModelForCausalLM.from_pretrained(os.path.join(pair, "target"), dtype=torch.float32,
                                                  **model_load_kwargs()).eval()
    tok = AutoTokenizer.from_pretrained(os.path.join(pair, "target"))
    one = DFlashDraftModel.from_pretrained(os.path.join(pair, "drafter"), dtype=torch.float32).eval()
    two = dflash2_from(one)
    with open(os.path.join(pair, "heldout_prompts.json")) as f:
        prompts = [tok(p["prompt"], return_tensors="pt", add_special_tokens=False)["input_ids"]
                   for p in json.load(f)[: args.prompts]]
    results = {"DFlash 1": {}, "DFlash 2": {}}
    taus = {"DFlash 1": [], "DFlash 2": []}
    for ids in prompts:  # warm-up, and the check that both draft the same tokens
        a, acc_a, _ = run(one, target, ids, args.new)
        b, acc_b, _ = run(two, target, ids, args.new)
        assert torch.equal(a, b) and acc_a == acc_b, "the identity DFlash 2 must draft as its DFlash 1 backbone"
        taus["DFlash 1"] += acc_a
        taus["DFlash 2"] += acc_b
    for _ in range(args.repeats):
        for ids in prompts:
            for name, draft in (("DFlash 1", one), ("DFlash 2", two)):
                _, _, parts = run(draft, target, ids, args.new)
                for k, v in parts.items():
                    results[name].setdefault(k, []).append(v)
    tau = sum(taus["DFlash 1"]) / len(taus["DFlash 1"])
    print(f"shipped pair, greedy, batch 1, fp32 CPU, {args.threads} thread(s), {args.prompts} prompts x {args.new} "
          f"new tokens, {args.repeats} repeats; tau {tau:.2f} for both (same drafts)")
    print(f"DFlash 2 parts: {PUBLISHED}")
    print(f"{'ms per verify step (median)':34s} {'DFlash 1':>9s} {'DFlash 2':>9s} {'ratio':>7s}")
    for part in ("draft forward + logits", "proposal", "draft + proposal", "whole step"):
        one_ms, two_ms = (statistics.median(results[n][part]) for n in ("DFlash 1", "DFlash 2"))
        print(f"{part:34s} {one_ms:9.2f} {two_ms:9.2f} {two_ms / one_ms:7.3f}")


if __name__ == "__main__":
    main()
