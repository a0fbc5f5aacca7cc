"""Label throughput: can the annotator keep up with the new messages of a 30k steps/s run?

    python benchmarks/label_throughput.py          # latency 2 s; --llm-concurrency 4, then 64; 80 s each
    python benchmarks/label_throughput.py --concurrency 512 1024 --messages RUN_DIR/messages.tsv  # or .tsv.gz

An LLM server is stood in for by tests/fake_openai.py with a fixed latency per request (--latency,
2 s: an 8B instruct model reasoning before it answers, on a vLLM that batches all the requests it
gets). The distinct messages of a recorded run (messages.tsv: message, steps, ...; by default the
reward-free 1M-step runs of learning_curves.py under results/five_1m/) arrive as they
would in a run at --steps-per-s: (distinct messages / steps of the recorded run) x steps-per-s new
ones a second, evenly spaced, in a random order (once all were shown they come again, made new by a
suffix). A real run finds new messages faster at first and slower later: this is its average rate.
Without a messages.tsv the messages are synthetic, at --distinct-per-step, and the output says so. The
learner's side is the real one: a LabelClient (the annotator subprocess and its Manager) is asked each new
message once and again after 60 s while unanswered, as reward_models.py does, and its labels are read with
new_records() every 0.1 s.

For each --concurrency it prints labels/s over the run, and for the messages first seen in the first
(seconds - 60) s (each one watched for a full minute): the share labelled within 60 s of first sight
and the p50/p95 of the time from first sight to label. The goal (issue 9): every one within 60 s.
"""
import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # the method; tests/fake_openai.py

import annotator  # noqa: E402
from fake_openai import FakeOpenAI  # noqa: E402
from learning_curves import open_text, run_file  # noqa: E402

RETRY_S = 60.0  # reward_models.RETRY_S: a message still unanswered after this long is asked again
WINDOW_S = 60.0  # the goal: labelled within a minute of first sight
RECORDED = ("results/five_1m/free_retrieval/seed1", "results/five_1m/free_ranking/seed1")  # messages.tsv(.gz)


def recorded_messages(path):
    """(distinct non-empty messages, steps of the run) from a messages.tsv or its .gz."""
    messages, steps = [], 0
    with open_text(path) as f:
        next(f)
        for line in f:
            message, count = line.rstrip("\n").split("\t")[:2]
            steps += int(count)
            if message != "(none)":
                messages.append(message)
    return messages, steps


def run(concurrency, messages, rate, seconds, url):
    """Replays `messages` at `rate` new ones a second for `seconds`; returns (the annotator's stats, its
    start, when each message was first seen, when each was labelled)."""
    client = annotator.LabelClient(SimpleNamespace(prompt_file=None, llm_url=[url], llm_model=None,
                                                   llm_concurrency=concurrency))
    run_dir = tempfile.mkdtemp(prefix="label_throughput-")
    client.start(run_dir, set())
    first_seen, labelled, asked, last_retry, shown = {}, {}, {}, 0.0, 0
    start = time.time()
    try:
        while (now := time.time()) - start < seconds:
            new = []
            while shown <= (now - start) * rate:  # the messages first seen since the last learner update
                n, k = divmod(shown, len(messages))
                new.append(messages[k] if n == 0 else f"{messages[k]} ({n})")
                shown += 1
            first_seen.update(dict.fromkeys(new, now))
            asked.update(dict.fromkeys(new, now))
            again = []
            if now - last_retry > RETRY_S:  # as reward_models.LabelRequests.label_requests
                again = [m for m, at in asked.items() if now - at > RETRY_S]
                random.shuffle(again)
                asked.update(dict.fromkeys(again, now))
                last_retry = now
            client.request(dict.fromkeys(new + again, 1.0), {})  # each seen once: all worth the same
            for record in client.new_records():
                if record["label"] is not None:
                    labelled.setdefault(record["caption"], time.time())
                    asked.pop(record["caption"], None)
            client.check()
            time.sleep(max(0.0, 0.1 - (time.time() - now)))
    finally:
        stats = client.stats()
        client.close()
        shutil.rmtree(run_dir)
    return stats, start, first_seen, labelled


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", default=None,
                        help=f"a messages.tsv or its .gz (default: that of the first of {RECORDED})")
    parser.add_argument("--distinct-per-step", type=float, default=0.008,
                        help="the synthetic stream's rate, without a messages.tsv (default: a recorded "
                             "run's)")
    parser.add_argument("--steps-per-s", type=float, default=30_000)
    parser.add_argument("--latency", type=float, default=2.0,
                        help="seconds the fake server takes per request")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 64],
                        help="--llm-concurrency values")
    parser.add_argument("--seconds", type=float, default=80.0, help="length of each run (> 60)")
    args = parser.parse_args()
    path = args.messages or next(filter(os.path.exists, (run_file(os.path.join(ROOT, r), "messages.tsv")
                                                         for r in RECORDED)), None)
    if path:
        messages, steps = recorded_messages(path)
        source = f"{len(messages):,} distinct messages in {steps:,} steps of {os.path.relpath(path, ROOT)}"
    else:
        messages = [f"You see here {i} gold pieces." for i in range(100_000)]
        steps = round(len(messages) / args.distinct_per_step)
        source = (f"SYNTHETIC messages (no messages.tsv): an assumed {args.distinct_per_step} distinct "
                  "messages a step")
    random.seed(0)
    random.shuffle(messages)
    rate = len(messages) / steps * args.steps_per_s
    print(f"{source}\n-> {rate:.1f} new distinct messages/s at {args.steps_per_s:,.0f} steps/s; fake LLM "
          f"server: {args.latency:.1f} s a request, chat prompts; {args.seconds:.0f} s a run", flush=True)
    print(f"   (by Little's law, keeping up needs >= {rate * args.latency:.0f} requests in flight)",
          flush=True)
    server = FakeOpenAI(model="fake-instruct").start()
    server.delay = args.latency
    try:
        for concurrency in args.concurrency:
            stats, start, first_seen, labelled = run(concurrency, messages, rate, args.seconds, server.url)
            cohort = [m for m, t in first_seen.items() if t - start <= args.seconds - WINDOW_S]
            waits = sorted(labelled[m] - first_seen[m] if m in labelled else float("inf") for m in cohort)
            within = sum(w <= WINDOW_S for w in waits) / len(waits)
            fmt = lambda w: f"{w:.1f} s" if w != float("inf") else "not labelled"
            print(f"--llm-concurrency {concurrency}: {len(labelled) / args.seconds:.1f} labels/s (request "
                  f"latency p50 {stats.get('latency_p50', 0):.2f} s, {stats.get('failures', 0)} failures, "
                  f"{stats.get('dropped', 0)} dropped from the backlog)\n"
                  f"    of the {len(cohort):,} messages first seen in its first "
                  f"{args.seconds - WINDOW_S:.0f} s: "
                  f"{within:.1%} labelled within {WINDOW_S:.0f} s; first sight to label p50 "
                  f"{fmt(waits[len(waits) // 2])}, p95 {fmt(waits[int(len(waits) * 0.95)])} -> goal "
                  f"{'MET' if within == 1.0 else 'not met'}", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
