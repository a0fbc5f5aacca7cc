"""Replays runs' labels through ONI-Classification's reward model: does it pay what its own labels say?

    python benchmarks/classifier_replay.py results/five_1m/free_classification/seed{1,2,3} \
        --baseline f57417e

Each run's labels go in as the LLM gave them (labels.jsonl order, 25 at a time), the trainer keeps its own
schedule (`train_now()`), every burst is published and judged by the gate. Each message's steps and pay
weight (tests/runs.py: what R = 1 would have paid under the count normalization, ~ the episodes it was
seen in) are the run's final ones from the start, given as a learner batch would (see()). "Pay" weighs each
labelled message by its pay weight times the R the classifier gives it, "steps" by its steps. Printed per run
and tree:
- run avg: the labels known so far, paid by the model of their time, each model held for the env steps the
  run's LLM took to give the next 25 labels (console.log): what the run would have paid for and against its
  labels. It takes each message's pay as spread evenly over the run; pay before a message's label is not
  judged.
- end: the last model on all the run's labels; hand: the last model on the run's messages that label_sets.tsv
  labels (LLM-labelled or not), by the hand labels.
- its accuracy on its own training labels (distinct messages), the share of publications the gate was on, and
  the unhelpful messages it paid most over the run (their share of the run average's pay).
No LLM, no env, no policy; labels arrive 25 at a time, not at the run's times; the trainer is never
rate-limited by a share; no learner batches are seen, so beyond 25,000 labels (one step a batch) it would
train no more. `--baseline REV` replays the same on a git worktree of commit REV (that tree's
reward_models.py); `--set NAME=VALUE` sets a constant of reward_models.py (a candidate); `--weigh steps` gives
the classifier steps as pay weights."""
import argparse
import functools
import gzip
import itertools
import json
import os
import re
import shutil
import sys
import tempfile

import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 25


def label_times(run):
    """[(labels given, env step)] from console.log; without one the labels are spread evenly."""
    path = os.path.join(run, "console.log")
    pattern = re.compile(r"steps\s+([\d,]+) .*llm labels ([\d,]+)")
    found = [(int(m[2].replace(",", "")), int(m[1].replace(",", ""))) for line in open(path)
             if (m := pattern.match(line))] if os.path.exists(path) else []
    return found


def replay(run, seed, sets, weigh, hand_path, top=5):
    import numpy as np
    import torch

    import annotator
    import reward_models as rm
    import runs
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    for name, value in sets:  # a module's constant, or a class's (Classification.steps_per_label)
        *path, attr = name.split(".")
        owner = functools.reduce(getattr, path, rm)
        setattr(owner, attr, type(getattr(owner, attr))(value))
    messages = runs.read_messages(run)
    records = [r for r in annotator.read_labels(os.path.join(run, annotator.LABELS_FILE))
               if r.get("label") is not None]
    shown = {r["caption"]: messages.get(" ".join(r["caption"].split()))  # (tsv: spaces folded)
             for r in records}
    steps = {t: m.steps if m else 0 for t, m in shown.items()}
    pay = steps if weigh == "steps" else {t: m.weight if m else 0.0 for t, m in shown.items()}
    args = argparse.Namespace(reward_type="classification", seed=seed, labels_from=None)
    piece = rm.Classification(args, "cpu")
    texts = list(steps)
    try:
        piece.see(texts, np.array([steps[t] for t in texts]), np.array([pay[t] for t in texts]))
    except TypeError:  # a tree from before issue 33 weighs steps
        piece.see(texts, np.array([steps[t] for t in texts]))

    def called(texts):  # the published model's R (the gate aside) and p(helpful), per message
        with torch.no_grad():
            p = torch.cat([torch.zeros(0)] + [rm.outputs(piece.published["model"], texts[i:i + 2048], "cpu")
                                              .softmax(-1)[:, 1] for i in range(0, len(texts), 2048)]).numpy()
        return p > 0.5, p

    times = label_times(run)
    at = lambda n: next((step for given, step in times if given >= n), times[-1][1]) if times else n
    sums = np.zeros((2, 2, 2))  # [pay, steps][unhelpful, helpful][paid, all]
    against, fitted = {}, []
    for i in range(0, len(records), CHUNK):
        piece.add_labels(records[i:i + CHUNK])
        if piece.train_now():
            fitted.append(bool(piece.published["fitted"]))
        span = at(i + 2 * CHUNK) - at(i + CHUNK) if i + CHUNK < len(records) else 0
        texts = list(piece.labels)
        label = np.array([piece.labels[t] for t in texts], dtype=int)
        R = called(texts)[0] * fitted[-1] if fitted else np.zeros(len(texts))
        for k, weight in enumerate((pay, steps)):
            w = span * np.array([weight[t] for t in texts])
            for c in (0, 1):
                sums[k, c] += (w * R)[label == c].sum(), w[label == c].sum()
        for t in np.array(texts)[R.astype(bool) & (label == 0)]:
            against[t] = against.get(t, 0.0) + span * pay[t]
    kept = lambda s: s[1, 0] / max(s[1, 1], 1e-12)
    share = lambda s: s[0, 0] / max(s[0, 0] + s[1, 0], 1e-12)
    texts = list(piece.labels)
    label, (helpful, _) = np.array([piece.labels[t] for t in texts], dtype=int), called(texts)
    end, w = np.zeros((2, 2)), np.array([pay[t] for t in texts])
    for c in (0, 1):
        end[c] = (w * helpful)[label == c].sum() * fitted[-1], w[label == c].sum()
    hand, hand_sums = runs.hand_labels(hand_path), np.zeros((2, 2))
    for t in (texts := [t for t in messages if t in hand]):
        hand_sums[hand[t][0], 1] += messages[t].weight
    for t, r in zip(texts, called(texts)[0] * fitted[-1]):
        hand_sums[hand[t][0], 0] += messages[t].weight * r
    total = sums[0, :, 0].sum()
    return {"model_steps": piece.model_steps, "on": float(np.mean(fitted)), "publications": len(fitted),
            "accuracy": float((helpful == label).mean()), "wrong_labels": int((helpful != label).sum()),
            "pay_kept": kept(sums[0]), "pay_against": share(sums[0]), "steps_kept": kept(sums[1]),
            "steps_against": share(sums[1]), "end_kept": kept(end), "end_against": share(end),
            "hand_kept": kept(hand_sums), "hand_against": share(hand_sums),
            "most_paid_against": [(t, round(v / total, 4)) for t, v in
                                  sorted(against.items(), key=lambda item: -item[1])[:top]]}


def plain_labels(run, tmp):
    """The run dir, or a copy of it in tmp with labels.jsonl plain: results/ keeps it gzipped, and the replay
    reads it with the annotator of its tree, which in a baseline's may read only the plain file."""
    gz = os.path.join(run, "labels.jsonl.gz")
    if os.path.exists(os.path.join(run, "labels.jsonl")) or not os.path.exists(gz):
        return os.path.abspath(run)
    copy = os.path.join(tmp, str(len(os.listdir(tmp))))
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("labels.jsonl.gz"))
    with gzip.open(gz, "rb") as f, open(os.path.join(copy, "labels.jsonl"), "wb") as out:
        shutil.copyfileobj(f, out)
    return copy


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="classification run directories (labels.jsonl, messages.tsv)")
    parser.add_argument("--seed", type=int, default=1, help="the replay's seed (the trainer's and torch's)")
    parser.add_argument("--baseline", default=None, help="a commit to replay side by side (a git worktree)")
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                        help="a reward_models constant")
    parser.add_argument("--weigh", choices=("pay", "steps"), default="pay",
                        help="what the classifier is given")
    parser.add_argument("--hand", default=None, help="hand labels (default: runs.py's label_sets.tsv)")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # the tree to replay a run in
    args = parser.parse_args()
    sets = [item.split("=", 1) for item in args.set]
    if args.case:
        sys.path.insert(0, args.case)
        # The measured tree's reward_models and annotator, imported before tests/runs.py puts this tree first.
        import reward_models  # noqa: F401
        sys.path.insert(1, os.path.join(ROOT, "tests"))
        import runs
        print(json.dumps(replay(args.runs[0], args.seed, sets, args.weigh, args.hand or runs.LABEL_SETS)))
        return
    trees = common.trees(args.baseline)
    print(f"candidate: {' '.join(args.set) or 'as committed'}, weighed by {args.weigh}; pay: helpful "
          f"kept, unhelpful share (run avg / end / by hand labels)\n| code | run | model steps | gate on | "
          "accuracy on its labels | helpful pay kept | unhelpful pay share | helpful steps kept | unhelpful "
          "steps share |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:  # the runs whose labels a baseline needs plain
        plain = {run: plain_labels(run, tmp) for run in args.runs}
        for run, (name, tree) in itertools.product(args.runs, trees.items()):
            case = [sys.executable, __file__, plain[run], "--case", tree, "--seed", str(args.seed),
                    "--weigh", args.weigh, *(["--hand", args.hand] if args.hand else []), "--set", *args.set]
            r = common.run_json(case, tree, run)
            print(f"| {name} | {run} | {r['model_steps']} | {r['on']:.2f} of {r['publications']} | "
                  f"{r['accuracy']:.3f} ({r['wrong_labels']} wrong) | {r['pay_kept']:.3f} / "
                  f"{r['end_kept']:.3f} / {r['hand_kept']:.3f} | {r['pay_against']:.3f} / "
                  f"{r['end_against']:.3f} / {r['hand_against']:.3f} | {r['steps_kept']:.3f} | "
                  f"{r['steps_against']:.3f} |", flush=True)
            paid = "; ".join(f"{t!r} {v:.1%}" for t, v in r["most_paid_against"])
            print(f"    paid most against its label: {paid}", flush=True)


if __name__ == "__main__":
    main()
