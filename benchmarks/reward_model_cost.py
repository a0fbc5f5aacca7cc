"""What a reward model's trainer costs on a CPU: one step and one publication, on a run's own labels.

    python benchmarks/reward_model_cost.py results/stairs_1m/stairs_ranking/seed3 [--steps 20] [--threads 1]

The run's labels.jsonl goes into a fresh model of the run's reward type (Ranking: its pairs; Classification:
its captions), and messages.tsv's messages are shown to it as batches would be: each message's steps and pay
weight, for Ranking a reference of REFERENCE_STEPS steps drawn from the run's messages by their steps (a
publication costs by its distinct messages: drawn from the whole run they are more than in a run's own first
steps, so the figure is high). The trainer then takes --steps steps of the reference's minibatch (256) and
publishes once; a step and a publication are timed in the process's CPU seconds (what they take from the box;
less moved by other load than wall time) and in wall seconds. Times the run's model steps
(summary.json's reward_model_steps, where the run recorded them) it is what its trainer took over the run.
"""
import argparse
import collections
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # the method; tests/runs.py
import numpy as np  # noqa: E402
import torch  # noqa: E402

import annotator  # noqa: E402
import oni_appo  # noqa: E402
import reward_models  # noqa: E402
import runs  # noqa: E402


def timed(function):  # (CPU seconds of the process, all torch threads; wall seconds) of one call
    cpu, wall = time.process_time(), time.perf_counter()
    function()
    return time.process_time() - cpu, time.perf_counter() - wall


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the trainer's on 2 cores: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    summary = json.load(open(os.path.join(args.run_dir, "summary.json")))
    reward_type = summary["sessions"][0]["flags"]["reward_type"]
    if reward_type not in ("ranking", "classification"):
        sys.exit(f"error: {args.run_dir} is a {reward_type} run: only ranking and classification train "
                 "a model")
    piece = reward_models.PIECES[reward_type](oni_appo.Args(reward_type=reward_type, seed=1), "cpu")
    piece.add_labels(annotator.read_labels(runs.run_file(args.run_dir, annotator.LABELS_FILE)))
    messages = runs.read_messages(args.run_dir)
    texts = list(messages)
    steps = [messages[t].steps for t in texts]
    drawn = random.Random(1).choices(texts, steps, k=reward_models.REFERENCE_STEPS)
    shown = collections.Counter(drawn) if reward_type == "ranking" else {t: messages[t].steps for t in texts}
    piece.see(list(shown), np.array(list(shown.values())),
              np.array([messages[t].weight for t in shown]))
    piece.train_now(steps=2)  # warm-up: the first steps allocate
    cpu, wall = timed(lambda: piece.train_now(steps=args.steps))  # the steps and one publication
    publish_cpu, publish_wall = timed(piece.publish)
    step_cpu, step_wall = (cpu - publish_cpu) / args.steps, (wall - publish_wall) / args.steps
    print(f"{args.run_dir}: {reward_type}, {len(piece.data):,} labels, {len(shown):,} messages shown")
    print(f"one step: {step_cpu:.3f} CPU s ({step_wall:.3f} wall); one publication: {publish_cpu:.3f} CPU s "
          f"({publish_wall:.3f} wall); {args.threads} torch thread(s)")
    if "reward_model_steps" in summary:
        total = summary["reward_model_steps"] * step_cpu
        print(f"the run's {summary['reward_model_steps']:,} steps: ~{total:,.0f} CPU s, "
              f"{total / summary['wall_time_s']:.2f} of a core over its {summary['wall_time_s']:,.0f} s")


if __name__ == "__main__":
    main()
