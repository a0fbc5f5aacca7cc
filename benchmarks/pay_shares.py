"""Where each run's intrinsic reward went: shares of its pay by label, and the messages it paid most.

    python benchmarks/pay_shares.py results/five_1m/free_retrieval results/five_1m/free_classification
    python benchmarks/pay_shares.py results/five_1m --top 5 > results/five_1m/pay.md

Reads each run's messages.tsv (`paid`: the intrinsic reward the run paid each message over the whole run,
R/N^beta summed over its steps; `label`: the run's own LLM label) and prints one markdown row per run: the
total paid (net: older Ranking runs paid some negative rewards); the shares of it that went to messages the
run's LLM labelled helpful, unhelpful, or never labelled (Classification may pay what its own labels call
unhelpful; Ranking asks pairs, so its captions are never labelled); the shares to messages hand-labelled
helpful and unhelpful in label_sets.tsv (any split; the rest are in no set; label_quality.py --run also counts
its older 50); the share to the steps that end a life ("You die..." opens NetHack's death message); and the
messages paid most, with their shares. A config directory stands for its seed* runs, and a last row gives
their means."""
import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(ROOT, "tests"))  # tests/runs.py, after this folder
import runs  # noqa: E402

COLUMNS = ("LLM helpful", "LLM unhelpful", "never labelled", "hand helpful", "hand unhelpful", "deaths")


def shares(run_dir, hand, top):
    """(total paid, [the COLUMNS' shares of it], [(message, share)] of the `top` most paid)."""
    messages = runs.read_messages(run_dir)
    hand_label = lambda m: hand.get(m, (None,))[0]  # noqa: E731
    cells = runs.pay_shares(messages, dict(zip(COLUMNS, (
        lambda m, v: v.label == 1, lambda m, v: v.label == 0, lambda m, v: v.label is None,
        lambda m, v: hand_label(m) == 1, lambda m, v: hand_label(m) == 0,
        lambda m, v: m.startswith("You die")))))
    total = sum(v.paid for v in messages.values())
    most = sorted(messages.items(), key=lambda kv: -kv[1].paid)[:top]
    return total, list(cells.values()), [(m, v.paid / (total or 1.0)) for m, v in most if v.paid > 0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="+", help="run dirs, config dirs (seed*) or sets of configs")
    parser.add_argument("--top", type=int, default=3, help="how many of the most paid messages to name")
    args = parser.parse_args()
    hand = runs.hand_labels()
    print("| run | paid | " + " | ".join(COLUMNS) + " | paid most |")
    print("|---" * (len(COLUMNS) + 3) + "|")
    for path in args.dirs:
        found = runs.run_dirs(path)
        if not found:
            raise SystemExit(f"error: no run (messages.tsv and summary.json) under {path}")
        configs = {}
        for run_dir in found:
            configs.setdefault(os.path.dirname(run_dir), []).append(run_dir)
        for config, seeds in configs.items():
            rows = []
            for run_dir in seeds:
                total, cells, most = shares(run_dir, hand, args.top)
                rows.append([total] + cells)
                named = "; ".join(f"{m[:60]!r} {s:.0%}" for m, s in most)
                print(f"| {os.path.relpath(run_dir)} | {total:,.0f} | "  # nothing paid: no shares
                      + " | ".join(f"{c:.1%}" if total else "—" for c in cells) + f" | {named} |")
            if len(seeds) > 1:
                mean = np.mean(rows, axis=0)
                print(f"| **{os.path.relpath(config)}**, mean of {len(seeds)} | {mean[0]:,.0f} | "
                      + " | ".join(f"{c:.1%}" if mean[0] else "—" for c in mean[1:]) + " | |")


if __name__ == "__main__":
    main()
