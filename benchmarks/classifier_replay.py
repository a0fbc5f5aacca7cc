"""Replays a run's labels through ONI-Classification's reward model: is it right, per step, on the run's own messages?

    python benchmarks/classifier_replay.py results/free_1m/free_classification_c5c1d3c/seed1 --seeds 1 2 --baseline db69739

The run's labels go in as the LLM gave them (labels.jsonl order, 25 at a time), the trainer keeps its own schedule
(`train_now()`: a first fit of 32 steps, then 0.32 steps a label), every burst is published and judged by the gate.
The step counts are the run's final ones (messages.tsv) from the start, an approximation: in the run they grew. Other
approximations: labels arrive 25 at a time, not at the run's times, and the trainer is never rate-limited by a share;
no learner batches are seen, so beyond 25,000 labels (one step a batch) it would train no more; both trees replay the
labels one run's policy met. No LLM, no env, no policy: it isolates the classifier and its gate.
Printed per tree and seed: the share of publications the gate was on (paying), how often it switched, the first
publication it was on; then, for the last published model, the share of the run's unhelpful and helpful labelled
steps it calls helpful (what it would pay were the gate on, before count normalization) and its p(helpful) for the
run's most frequent messages. `--baseline REV` replays the same on a git worktree of commit
REV (that tree's reward_models.py), one case at a time."""
import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def replay(run, seed, top=6):
    import numpy as np
    import torch

    import annotator
    import reward_models as rm
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    steps = {}
    with open(os.path.join(run, "messages.tsv")) as f:
        for line in itertools.islice(f, 1, None):
            text, n, *_ = line.rstrip("\n").split("\t")
            steps[text] = int(n)
    shown = lambda text: steps.get(" ".join(text.split()), 0)  # messages.tsv folds whitespace
    records = [r for r in annotator.read_labels(os.path.join(run, annotator.LABELS_FILE)) if r.get("label") is not None]
    args = argparse.Namespace(reward_type="classification", seed=seed, labels_from=None)
    piece = rm.Classification(args, "cpu")
    piece.steps.update({r["caption"]: shown(r["caption"]) for r in records})
    fitted = []
    for i in range(0, len(records), 25):
        piece.add_labels(records[i:i + 25])
        if piece.train_now():
            fitted.append(piece.published["fitted"])
    texts = sorted(piece.labels)
    with torch.no_grad():
        p = torch.cat([rm.outputs(piece.published["model"], texts[i:i + 2048], "cpu").softmax(-1)[:, 1]
                       for i in range(0, len(texts), 2048)]).numpy()
    weight, label = np.array([shown(t) + 1 for t in texts]), np.array([piece.labels[t] for t in texts])
    paid = lambda c: float((weight * (p > 0.5))[label == c].sum() / weight[label == c].sum())
    return {"model_steps": piece.model_steps, "publications": len(fitted), "on": float(np.mean(fitted)),
            "switches": sum(a != b for a, b in zip([False] + fitted, fitted)),
            "first_on": fitted.index(True) + 1 if True in fitted else None,  # 1: the first
            "unhelpful_steps_paid": paid(0.0), "helpful_steps_paid": paid(1.0),
            "most_frequent": [(texts[i], int(label[i]), round(float(p[i]), 3)) for i in np.argsort(-weight)[:top]]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", help="a classification run's directory (labels.jsonl, messages.tsv)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--baseline", default=None, help="a commit to replay side by side (a git worktree)")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # TREE:SEED, in a subprocess
    args = parser.parse_args()
    if args.case:
        tree, seed = args.case.rsplit(":", 1)
        sys.path.insert(0, tree)
        print(json.dumps(replay(args.run, int(seed))))
        return
    trees = {"now": ROOT}
    if args.baseline:
        tree = os.path.join(tempfile.gettempdir(), f"oni-baseline-{args.baseline}")  # shared with the other benchmarks
        if not os.path.isdir(tree):
            subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, args.baseline], check=True,
                           capture_output=True)
        trees = {f"before ({args.baseline})": tree, **trees}
    print("| code | seed | model steps | gate on (share of publications) | switches | first on | unhelpful steps "
          "it would pay | helpful steps it would pay |\n|---|---|---|---|---|---|---|---|", flush=True)
    for seed, (name, tree) in itertools.product(args.seeds, trees.items()):
        out = subprocess.run([sys.executable, __file__, os.path.abspath(args.run), "--case", f"{tree}:{seed}"],
                             check=True, stdout=subprocess.PIPE, text=True, cwd=tree).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {name} | {seed} | {r['model_steps']} | {r['on']:.2f} of {r['publications']} | {r['switches']} | "
              f"{r['first_on']} | {r['unhelpful_steps_paid']:.3f} | {r['helpful_steps_paid']:.3f} |", flush=True)
        print("    " + "; ".join(f"{t!r} ({label}) p={p}" for t, label, p in r["most_frequent"]), flush=True)


if __name__ == "__main__":
    main()
