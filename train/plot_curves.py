"""Plot loss curves from one or more training ``.jsonl`` logs into a PNG.

Each log line is a dict; lines with ``loss`` are training points, lines with
``heldout_loss`` are evaluation points (x axis: ``step``).  Works for the target
log and, later, the drafter log (any extra numeric key can be added with --key).

    python -m train.plot_curves pair/target_train_log.jsonl -o pair/target_loss.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from convert.cli import CommandError, add_debug_flag, run_command


def read_log(path) -> list[dict]:
    """Parse a jsonl log, skipping blank lines.

    Raises:
        CommandError: no such file, or a line that is not JSON (named with its number).
    """
    path = Path(path)
    if not path.is_file():
        raise CommandError(f"{path}: no such log file; pass a training log (.jsonl), e.g. runs/<name>/train_log.jsonl")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            out += [json.loads(line)] if line.strip() else []
        except json.JSONDecodeError as err:
            raise CommandError(f"{path}:{n}: not JSON ({err.msg}); expected one JSON object per line") from None
    return out


def plot(logs: list[str], out: str, keys=("loss", "heldout_loss"), baselines: dict | None = None,
         title: str | None = None) -> None:
    """Draw ``keys`` versus ``step`` for every log; ``baselines`` = {label: y} as dashed lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for path in logs:
        recs = read_log(path)
        for k in keys:
            pts = [(r["step"], r[k]) for r in recs if k in r and "step" in r]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if len(pts) < 40 else None, ms=3,
                        label=f"{Path(path).stem}: {k}")
    for label, y in (baselines or {}).items():
        ax.axhline(y, ls="--", lw=1, color="gray")
        ax.annotate(label, (0, y), textcoords="offset points", xytext=(4, 3), fontsize=8, color="gray")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title or "training curves")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    """Command-line entry point: exit status 0, 1 for a missing or unreadable log (one line), 2 for a usage error."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", help="jsonl log files")
    ap.add_argument("-o", "--out", required=True, help="output PNG")
    ap.add_argument("--key", action="append", help="keys to plot (default loss, heldout_loss)")
    ap.add_argument("--summary", help="summary json with unigram_heldout_loss to draw as baseline")
    ap.add_argument("--title")
    add_debug_flag(ap)
    return run_command(_run, ap.parse_args(argv))


def _run(args) -> int:
    base = {}
    if args.summary and Path(args.summary).exists():
        s = json.loads(Path(args.summary).read_text())
        if "unigram_heldout_loss" in s:
            base["unigram baseline (held-out)"] = s["unigram_heldout_loss"]
    plot(args.logs, args.out, tuple(args.key or ("loss", "heldout_loss")), base, args.title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
