"""Where the learner thread's time goes in a real training run, per update: `--reward-type none` and
`ranking` (its LLM an instant stub server in a process of its own, benchmarks/fake_openai.py), one after the other.

    python benchmarks/learner_time.py --steps 50000

Each function of the learner's loop (oni_appo.py: next_batch - waiting for rollouts -, take_batch,
the intrinsic reward, add_intrinsic_episodes, update_policy; the label intake: LabelClient.check,
new_records, request, IntrinsicReward.add_labels, label_requests) is wrapped with a timer; the table
is ms per update. What ranking adds to none there is ONI's cost on the learner's critical path.
"""
import argparse
import collections
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import annotator  # noqa: E402
import fake_openai  # noqa: E402
import oni_appo  # noqa: E402
import reward_models  # noqa: E402

SPENT = collections.defaultdict(float)
TIMED = [(oni_appo, name) for name in ("next_batch", "take_batch", "add_intrinsic_episodes", "update_policy")] + [
    (annotator.LabelClient, name) for name in ("check", "new_records", "request")] + [
    (reward_models.IntrinsicReward, name) for name in ("rewards", "add_labels", "label_requests")]


def timed(function, key):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            SPENT[key] += time.perf_counter() - start
    return wrapper


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50_000)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--oni-args", default="", help="more flags of oni_appo.py, e.g. '--num-envs-per-worker 16 "
                        "--batch-size 1024' (on a GPU its defaults are 64 and 4096)")
    args = parser.parse_args()
    for owner, name in TIMED:
        setattr(owner, name, timed(getattr(owner, name), f"{getattr(owner, '__name__', '')}.{name}".lstrip(".")))
    stub, url = fake_openai.serve_apart()  # not on the learner's GIL
    columns = {}
    for kind, extra in (("none", []), ("ranking", ["--llm-url", url])):
        SPENT.clear()
        summary = oni_appo.train(oni_appo.parse_args(
            ["--reward-type", kind, *extra, "--total-env-steps", str(args.steps), "--num-workers", str(args.num_workers),
             "--run-dir", tempfile.mkdtemp(prefix="oni-learner-time-"), "--checkpoint-every-s", "1e9",
             *args.oni_args.split()]))
        columns[kind] = {key: 1e3 * value / summary["updates"] for key, value in SPENT.items()}
        columns[kind]["steps/s"] = summary.get("session_sps", summary["sps"])  # collected a second
    stub.stdin.close()
    stub.wait()
    print(f"| ms per update | none | ranking |\n|---|---|---|")
    for key in sorted(set(columns["none"]) | set(columns["ranking"]), key=lambda k: -columns["ranking"].get(k, 0)):
        print(f"| {key} | {columns['none'].get(key, 0):.1f} | {columns['ranking'].get(key, 0):.1f} |")


if __name__ == "__main__":
    main()
