"""Offline payouts of ONI-Ranking: what each candidate payout rule pays helpful and unhelpful messages.

    python benchmarks/ranking_payout.py        # the committed runs of results/five_1m

For each committed Ranking run, a Ranking model is trained on a set of pairs as Motif trains on --labels-from
(rm.Motif, the same code: 10 epochs, at least 300 steps), every message the run saw (messages.tsv, deaths and
other last words included) is scored, and each rule gives it an R. Printed per rule, for each run: the share
of helpful and of unhelpful steps with R > 0, and the share of all pay (pay weight x R, runs.py) that goes to
helpful and to unhelpful messages; by hand labels (label_sets.tsv, read now), then by the LLM caption labels
of the committed Retrieval/Classification runs on the messages without a hand label, with each one's coverage.
A rule is kept when, in every run, it pays >= 80% of the helpful steps and <= 5% of the unhelpful ones by
both.

Pairs: `recorded`: the run's labels.jsonl, as its labeler answered them (two scores, a tie only within
TIE_MARGIN). `tie`, SIMULATED: the same pairs, two messages on the same side of THRESHOLD a tie
(annotator.preference()), the side read from the LLM caption labels of the Retrieval/Classification runs (the
same labeler, demonstrations and THRESHOLD); a pair across it, or without both labels, keeps its recorded
answer. `sim: ...`, SIMULATED draws: as many pairs as the run had, drawn over the run's messages that have an
LLM label (the only ones a simulation can answer), both messages by steps (as the run drew), by pay weight (as
the pair pool now fills), or half of them uniformly over distinct messages; answered by the tie rule, a pair
across THRESHOLD won by the helpful one (the scores of messages never compared were not recorded: draws cannot
be simulated under the recorded answers). Statistics (step-weighted mean, std, quantiles; the empty message
left out) over `steps`: the run's own steps (the whole run: recent steps were not recorded); `control`: the
steps of the reward-free control runs (a policy that no reward moves); `sample`: --sample steps drawn from
those (as a run's first REFERENCE_STEPS steps, by a young policy); `pairs`: the messages as often as they are
in the pairs (Motif's). Payout: z = (output - mean) / std at most 5, paid above the step median (the old
rule), a higher step quantile, or a fixed z; `now`: rm.RankingNorm, the rule of the code measured; `raw`: the
model's output (--raw-ranking)."""
import argparse
import collections
import json
import os
import random
import re
import sys
import tempfile
from types import SimpleNamespace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # the method; tests/runs.py
import annotator  # noqa: E402
import runs  # noqa: E402

RULES = {"median": ("q", 0.5), "q90": ("q", 0.9), "q95": ("q", 0.95), "q98": ("q", 0.98),
         "z>0": ("z", 0.0), "z>1": ("z", 1.0), "z>1.5": ("z", 1.5), "z>2": ("z", 2.0)}
DEATH = "You die..."


def fold(text): return " ".join(text.split())


def originals(root):
    """messages.tsv folds whitespace: the text as the env showed it (two spaces between messages), where a
    labels.jsonl of any run holds it, else by NLE's rule (two spaces after a sentence's end)."""
    known = {}
    for run in runs.run_dirs(root):
        path = runs.run_file(run, annotator.LABELS_FILE)
        for record in annotator.read_labels(path) if os.path.exists(path) else []:
            for text in record.get("pair", []) + [record.get("caption")] * ("caption" in record):
                known.setdefault(fold(text), text)
    return lambda text: known.get(text) or re.sub(r"([.!?]) (?=[A-Z])", r"\1  ", text)


def answer(pair, preference, side):
    """The tie rule, simulated: two messages on the same side tie; across, the recorded answer stands, or the
    helpful one wins where there is none (preference None: a pair never asked)."""
    a, b = (side.get(fold(t)) for t in pair)
    if a is None or b is None or a != b and preference is not None:
        return preference
    return None if a == b else 1 if a > b else 2


def pair_sets(run, side, seed, original):
    """The pairs of each way of drawing and answering them; the share of recorded answers the tie changes."""
    records = [r for r in annotator.read_labels(runs.run_file(run, annotator.LABELS_FILE)) if "pair" in r]
    tie = [{"pair": r["pair"], "preference": answer(r["pair"], r["preference"], side)} for r in records]
    messages = {t: m for t, m in runs.read_messages(run).items() if t in side}  # those it can answer
    texts, rng = sorted(messages), random.Random(seed)

    def drawn(weights, n):  # as draw_pair(): the second drawn again while it is the first
        pairs = []
        while len(pairs) < n:
            first, second = rng.choices(texts, weights, k=2)
            if first != second:
                pairs.append({"pair": [original(first), original(second)],
                              "preference": answer((first, second), None, side)})
        return pairs
    steps, weights, n = [messages[t].steps for t in texts], [messages[t].weight for t in texts], len(records)
    changed = sum(a["preference"] != b["preference"] for a, b in zip(records, tie)) / n
    return {"recorded": records, "tie": tie, "sim: by steps": drawn(steps, n),
            "sim: by pay weight": drawn(weights, n),
            "sim: half uniform": drawn(steps, n // 2) + drawn([1] * len(texts), n - n // 2)}, changed


def train(records, seed):
    """A Ranking model trained on the pairs as Motif trains (the same code), its frozen copy."""
    import torch
    import reward_models as rm
    torch.manual_seed(seed)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    try:
        args = SimpleNamespace(reward_type="motif", labels_from=f.name, raw_ranking=True, seed=seed)
        return rm.Motif(args, "cpu").published["model"]
    finally:
        os.unlink(f.name)


def outputs(model, texts, original):
    import torch
    import reward_models as rm
    with torch.no_grad():
        return {t: v for i in range(0, len(texts), 2048) for t, v in zip(
            texts[i:i + 2048], model(rm.to_rows([original(t) for t in texts[i:i + 2048]])).tolist())}


def quantile(values, weights, q):  # the step-weighted quantile, as RankingNorm takes its median
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order]) / weights.sum()
    return values[order][min(np.searchsorted(cumulative, q), len(values) - 1)]


def payout(rule, values, reference, ref_weights):
    """R of each message under a rule, statistics over the reference (values, steps)."""
    if rule == "raw":
        return values
    if rule == "now":
        import torch
        import reward_models as rm
        norm = rm.RankingNorm()
        norm.fit(torch.tensor(reference, dtype=torch.float), torch.tensor(ref_weights))
        return norm(torch.tensor(values, dtype=torch.float)).double().numpy()
    w = ref_weights / ref_weights.sum()
    mean = (w * reference).sum()
    std = max(np.sqrt((w * (reference - mean) ** 2).sum()), 1e-6)
    z = np.clip((values - mean) / std, -5.0, 5.0)
    kind, at = RULES[rule]
    bar = quantile(reference, ref_weights, at) + 1e-3 if kind == "q" else mean + at * std
    return np.where(values > bar, z, 0.0)


def accounting(steps, weight, R, label):
    """Shares of helpful and unhelpful steps with R > 0, then of all pay (weight x R) to each; label -1:
    none."""
    pay, total = weight * R, (weight * R).sum() or 1.0
    return ([steps[(label == c) & (R > 0)].sum() / max(steps[label == c].sum(), 1) for c in (1, 0)]
            + [pay[label == c].sum() / total for c in (1, 0)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=os.path.join(runs.ROOT, "results", "five_1m"))
    parser.add_argument("--seed", type=int, default=1, help="the reward model's training and the draws' seed")
    parser.add_argument("--sample", type=int, default=16_384, help="steps of the `sample` reference")
    parser.add_argument("--hand-labels", default=runs.LABEL_SETS, help="the hand labels' label_sets.tsv")
    parser.add_argument("--show", default="sim: by pay weight/sample/now",
                        help="the rule whose most paid messages, and most paid hand-unhelpful ones, are "
                             "printed")
    parser.add_argument("--only", default=None,
                        help="train on this set of pairs only (e.g. 'sim: by pay weight')")
    args = parser.parse_args()
    import torch
    torch.set_num_threads(1)
    found = runs.run_dirs(args.root)
    side = runs.llm_labels(*[r for r in found if "free_retrieval" in r or "free_classification" in r])
    hand = {t: label for t, (label, _) in runs.hand_labels(args.hand_labels).items()}
    control = collections.Counter()
    for run in [r for r in found if "free_none" in r]:
        control.update({t: m.steps for t, m in runs.read_messages(run).items()})
    texts = sorted(control)
    drawn = random.Random(args.seed).choices(texts, [control[t] for t in texts], k=args.sample)
    sample = collections.Counter(drawn)
    table, shown = {}, {}
    for run in [r for r in found if "free_ranking" in r]:
        measure(run, os.path.relpath(run, args.root), hand, side, {"control": control, "sample": sample},
                args, table, shown)
    print_table(table)
    for name, top in shown.items():
        print(f"{name}, {args.show}, most paid: " + "; ".join(
            f"{t!r} R={r:.2f} ({hand.get(t, side.get(t))})" for _, t, r in top))


def measure(run, name, hand, side, fixed, args, table, shown):
    """One run's rows of the table: every set of pairs, statistics and rule."""
    messages = runs.read_messages(run)
    texts, original = list(messages), originals(args.root)
    steps, weight = (np.array([getattr(messages[t], k) for t in texts], dtype=np.float64)
                     for k in ("steps", "weight"))
    labels = {"hand": np.array([hand.get(t, -1) for t in texts]),
              "LLM": np.array([-1 if t in hand else side.get(t, -1) for t in texts])}
    for what, label in labels.items():
        print(f"{name}: {what} labels cover {steps[label >= 0].sum() / steps.sum():.1%} of steps, "
              f"{weight[label >= 0].sum() / weight.sum():.1%} of pay weight")
    sets, changed = pair_sets(run, side, args.seed, original)
    print(f"{name}: {len(sets['recorded'])} pairs; the tie rule changes {changed:.1%} of their answers",
          flush=True)
    for pairs, records in [(k, v) for k, v in sets.items() if args.only in (None, k)]:
        model = train(records, args.seed)
        references = {"steps": dict(zip(texts, steps)), **fixed,
                      "pairs": collections.Counter(fold(t) for r in records for t in r["pair"])}
        scored = outputs(model, sorted(set(texts).union(*references.values())), original)
        values = np.array([scored[t] for t in texts])
        for stats, counts in references.items():
            ref = np.array([scored[t] for t in counts])
            ref_w = np.array(list(counts.values()), dtype=np.float64)
            for rule in list(RULES) + ["now"] + ["raw"] * (stats == "steps"):
                R = payout(rule, values, ref, ref_w)
                key = (pairs, "-" if rule == "raw" else stats, rule)
                table.setdefault(key, {})[name] = (accounting(steps, weight, R, labels["hand"])
                                                   + accounting(steps, weight, R, labels["LLM"])
                                                   + [R[texts.index(DEATH)] if DEATH in messages else 0.0])
                if "/".join(key) == args.show:
                    shown[name] = sorted(zip(weight * R, texts, R), reverse=True)[:8]
                    shown[name + " (hand-unhelpful)"] = sorted(
                        (w * r, t, r) for w, t, r, c in zip(weight, texts, R, labels["hand"])
                        if c == 0)[::-1][:8]


def print_table(table):
    print("\n| pairs | statistics | pays | hand: helpful steps paid | unhelpful steps paid | pay to helpful "
          "| pay to unhelpful | LLM: helpful steps paid | unhelpful steps paid | pay to helpful | "
          f"pay to unhelpful | R of {DEATH!r} | kept |\n|" + "---|" * 13)
    for (pairs, stats, rule), row in table.items():
        cells = list(zip(*row.values()))
        kept = all(min(cells[i]) >= 0.8 and max(cells[i + 1]) <= 0.05 for i in (0, 4))
        print(f"| {pairs} | {stats} | {rule} | " + " | ".join(" ".join(f"{v:.2f}" for v in c) for c in cells)
              + f" | {'yes' if kept else ''} |", flush=True)


if __name__ == "__main__":
    main()
