"""Check ``verify_cost.model_step_cost`` (the cost model from shapes) against the cost it replaced: the old
measurement of the call's own loop (``seconds_per_step`` / ``measure``, kept here and nowhere in the package),
on the shipped pair, fp32, one CPU thread.

    python bench/cost_model_check.py --measure costs.json [--batches 1 4 16 32] [--contexts 64 512 2048]
                                     [--widths 1 2 4 8 16] [--rounds 3]
    python bench/cost_model_check.py --compare costs.json     # measured vs modelled, per cell and width

``--measure`` times each cell (batch x context) with the old loop timing and writes the seconds per step at
every width (the median of ``--rounds`` rounds); ``--compare`` prints, per cell, the measured cost (plain
steps: seconds at width w over seconds at width 1), the model's, and their ratio, plus the model's own
seconds of a plain step against the measured ones. The two steps are separate so that a slow measurement
(batch 32 x 2,048 takes minutes) runs once and the model can be refitted against it many times.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PAIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pair")


def seconds_per_step(spec_generate, draft, target, device, width: int, batch: int, context: int) -> float:
    """The old ``verify_policy.seconds_per_step`` (fixed blocks, chains): seconds per verify step of
    ``spec_generate``'s loop verifying ``width`` positions, greedy, on ``batch`` rows of ``context`` random
    tokens (fixed seed; special token ids left out; every other row left padded by 3): the decode time of a
    call of ``3 * width + 10`` new tokens less that of a call of 2, over the verify steps between them."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    special = {v for k, v in vars(target.config).items() if isinstance(v, int) and k.endswith(("token_id", "token_index"))}
    allowed = torch.tensor([t for t in range(config.vocab_size) if t not in special])
    ids = allowed[torch.randint(len(allowed), (batch, context), generator=torch.Generator().manual_seed(0))].to(device)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1::2, : min(3, context - 1)] = 0
    kw = dict(attention_mask=mask, temperature=0.0, do_sample=False, low_acceptance_warning=None,
              adaptive_block_size=False, return_dict_in_generate=True, output_timings=True,
              block_size=1 if width == 1 else width)

    def decode(new):
        out = spec_generate(draft, target, ids, max_new_tokens=new, **kw)
        return out.timings["decode_s"], out.num_target_forwards - 1

    short, short_steps = decode(2)
    long, long_steps = decode(3 * width + 10)
    return max(long - short, 0.0) / max(long_steps - short_steps, 1)


def measure(seconds, widths, rounds: int) -> dict:
    """The old ``verify_policy.measure`` without its rounding: per round the widths in turn, the median over
    rounds of each width's ratio to that round's plain step; also the median seconds of each width."""
    seconds(min(2, widths[-1]))  # warm-up
    table = [[max(seconds(w), 1e-9) for w in widths] for _ in range(rounds)]
    return {"ratio": {w: statistics.median(r[i] / r[0] for r in table) for i, w in enumerate(widths)},
            "seconds": {w: statistics.median(r[i] for r in table) for i, w in enumerate(widths)}}


def load():
    from convert.loading import load_pair

    return load_pair(os.path.join(PAIR, "target"), os.path.join(PAIR, "drafter"), torch.device("cpu"),
                     torch.float32, check=False)


def run_measure(args) -> None:
    from generation_utils import spec_generate

    draft, target, _ = load()
    out = json.load(open(args.measure)) if os.path.exists(args.measure) else {}
    for batch in args.batches:
        for context in args.contexts:
            key = f"{batch}x{context}"
            if key in out:
                continue
            t0 = time.perf_counter()
            with torch.inference_mode():
                cell = measure(lambda w: seconds_per_step(spec_generate, draft, target, torch.device("cpu"), w,
                                                          batch, context), args.widths, args.rounds)
            out[key] = cell
            print(f"batch {batch:>2} context {context:>4}: {time.perf_counter() - t0:6.1f} s  "
                  + " ".join(f"w{w}={cell['ratio'][w]:.2f}" for w in args.widths), flush=True)
            with open(args.measure, "w") as f:
                json.dump(out, f, indent=1)


def run_compare(args) -> None:
    import verify_cost

    draft, target, _ = load()
    speed = verify_cost.device_speed(torch.device("cpu"), torch.float32)
    print(f"device constants: {speed}")
    data = json.load(open(args.compare))
    ratios = []
    for key, cell in data.items():
        batch, context = (int(x) for x in key.split("x"))
        widths = sorted(int(w) for w in cell["ratio"])
        # the old table's context: the prompt plus about half of the 3 w + 10 tokens it generated
        cost = verify_cost.model_step_cost(target, draft, speed, batch, context + 8, max(widths), 16)
        plain_s = verify_cost.step_seconds(target, draft, speed, batch, context + 8, 1, 16)
        print(f"batch {batch:>2} context {context:>4}: plain step measured {cell['seconds']['1'] * 1e3:7.2f} ms, "
              f"modelled {plain_s * 1e3:7.2f} ms")
        row = []
        for w in widths:
            m, p = cell["ratio"][str(w)], cost.verify_cost(w)
            row.append(f"w{w}: {m:5.2f}/{p:5.2f} ({p / m:4.2f})")
            if w >= 2:
                ratios.append(p / m)
        print("   measured/modelled (modelled/measured): " + "  ".join(row))
    within = sum(abs(r - 1) <= 0.25 for r in ratios)
    print(f"widths 2..: {within} of {len(ratios)} within 25%; modelled/measured median "
          f"{statistics.median(ratios):.2f}, min {min(ratios):.2f}, max {max(ratios):.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", help="time the cells with the old loop timing, into this JSON file")
    ap.add_argument("--compare", help="compare the model against this JSON file")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 2048])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.measure:
        run_measure(args)
    if args.compare:
        run_compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
