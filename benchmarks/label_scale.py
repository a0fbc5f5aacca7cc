"""Memory and stalls at scale: 1e6 captions and 1e5 pairs through the real LabelClient, Manager, annotator
process and IntrinsicReward, as the learner thread of oni_appo.learn() drives them.

    python benchmarks/label_scale.py  # 100k captions, 10k pairs (a few minutes)
    python benchmarks/label_scale.py --captions 1000000 --pairs 100000 --baseline e6b0946

Each case runs in a process of its own (its peak RSS is its own) and prints the peak RSS (VmHWM) of the
learner process, the Manager and the annotator; the learner thread's time per update: `intrinsic.rewards()` on
a batch of synthetic messages (32 x 32 steps, --new-per-update of them new distinct messages, the rest 50
common ones) and the label exchange of learn() (intrinsic.exchange(client): client.check(),
add_labels(client.new_records()), client.request(*label_requests())); and a checkpoint of the reward model
(torch.save of intrinsic.state_dict()). The cases:

- `captions`: --captions distinct captions, classification (--captions-reward), each answered before the next
  update: the LLM's answers go into the Manager's LabelTable as the annotator's loop puts them (a fast LLM;
  the annotator runs, its own server unreachable). Then the classifier's lock, held by its trainer thread
  while the learner waits for it: per training step (minibatch_loss), per idle poll (ready()) and per
  publication.
- `unanswered`: --captions captions never answered (the LLM unreachable): then one re-ask sweep
  (label_requests() and request() once RETRY_S is past, the pickled size of what it sends), and what a
  restarted annotator is sent.
- `pairs`: --pairs pairs drawn by ranking (--pairs-per-update a batch instead of 8), each answered through the
  table.
- `http`: --http-captions captions answered by tests/fake_openai.py over HTTP through the annotator (the
  whole real path, at the rate this machine gives; the learner waits for the annotator to keep up, untimed).

--baseline REV runs the same cases on a git worktree of commit REV (this script, that tree's modules),
alternating with this tree, and prints both side by side. Only the learner thread's own work is timed;
everything runs on the machine's cores together, so figures from a shared machine are noisy.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(ROOT, "tests"))  # tests/fake_openai.py, after this folder
import fake_openai  # noqa: E402

CASES = ("captions", "unanswered", "pairs", "http")
T, B, COMMON = 32, 32, 50  # a learner batch of 1,024 steps (oni_appo's default), 50 common messages
OUTSTANDING = 2000  # http: captions asked and not yet answered before the learner waits


def caption(i):  # distinct, about a third of them helpful by the fake LLM's judgement ("kill", "gold")
    return (f"You kill the newt number {i}!", f"You hear a door open {i} times.",
            f"There are {i} gold pieces here.")[i % 3]


def vm(pid, key="VmHWM"):  # MB
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024
    except (OSError, StopIteration):
        return float("nan")


class TimedLock:
    """The trainer's lock, timing how long each holder keeps it."""

    def __init__(self, lock):
        self.lock, self.held = lock, []

    def __enter__(self):
        self.lock.acquire()
        self.since = time.perf_counter()

    def __exit__(self, *exc):
        self.held.append(time.perf_counter() - self.since)
        self.lock.release()


def unreachable_url():
    import socket
    with socket.socket() as s:  # a port nothing listens on: every request is refused at once
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def measure(case, n, opts):
    """One case in this process, on the modules of the tree in sys.path[0]; returns its figures."""
    import gc
    import pickle

    import torch

    import annotator
    import reward_models
    from types import SimpleNamespace
    torch.set_num_threads(1)
    good = lambda text: "kill" in text or "gold" in text  # the fake LLM's judgement
    reward_models.RETRY_S = float("inf")  # no sweep while pushing; one is timed at the end
    if case == "pairs":
        reward_models.PAIRS_PER_BATCH = opts["pairs_per_update"]
    fake = None
    if case == "http":
        fake, url = fake_openai.serve_apart(model="fake-instruct")  # this tree's, whichever tree is measured
    else:
        url = unreachable_url()
    reward_type = "ranking" if case == "pairs" else opts["captions_reward"]
    args = SimpleNamespace(reward_type=reward_type, seed=1, labels_from=None, count_beta=3.0,
                           reward_scale=0.1, reward_clip=10.0, extrinsic_coef=1.0, intrinsic_coef=0.4,
                           raw_ranking=False)
    intrinsic = reward_models.IntrinsicReward(args, torch.device("cpu"))
    # the label requests: a piece of their own since 95ec1b5
    requests = getattr(intrinsic, "requests", intrinsic)
    client = annotator.LabelClient(SimpleNamespace(prompt_file=None, llm_url=[url], llm_model=None,
                                                   llm_concurrency=opts["llm_concurrency"], llm_threads=None,
                                                   num_workers=0))
    run_dir = tempfile.mkdtemp(prefix="label_scale-")
    client.start(run_dir, set())
    while not client.shared_stats.copy():  # the annotator is up (its first turn)
        time.sleep(0.05)
    common = reward_models.to_rows([f"You hear the footsteps of a guard on patrol {i}."
                                    for i in range(COMMON)])
    zeros = torch.zeros(T, B)
    counts, terminal = torch.ones(T, B, dtype=torch.int32), torch.zeros(T, B, dtype=torch.bool)
    per_update = opts["new_per_update"]
    updates = -(-n // per_update) if case != "pairs" else -(-n // opts["pairs_per_update"])
    rewards_s, exchange_s, asked, gc_s, since = [], [], 0, [], [0.0]

    # full collections walk every tracked container of the process: the GIL stops them all
    def gc_timer(phase, info):
        if phase == "start":
            since[0] = time.perf_counter()
        elif info["generation"] == 2:
            gc_s.append(time.perf_counter() - since[0])
    gc.callbacks.append(gc_timer)
    started = time.time()
    for u in range(updates):
        new = [caption(i) for i in range(u * per_update, min((u + 1) * per_update,
                                                             n if case != "pairs" else 1 << 62))]
        rows = torch.cat([reward_models.to_rows(new), common[torch.arange(T * B - len(new)) % COMMON]])
        messages = rows[torch.randperm(T * B, generator=torch.Generator().manual_seed(u))].view(T, B, -1)
        if case == "http":  # the learner waits (untimed) while the annotator is far behind
            while (asked - client.stats().get("labels", 0) > OUTSTANDING
                   and time.time() - started < opts["http_timeout"]):
                time.sleep(0.02)
        t0 = time.perf_counter()
        intrinsic.rewards(zeros, messages, counts, terminal)
        t1 = time.perf_counter()
        if hasattr(intrinsic, "exchange"):  # as learn()
            captions, pairs = intrinsic.exchange(client)
        else:  # a --baseline from before the one exchange call: learn()'s calls then
            if client.check() and hasattr(requests, "unanswered"):
                client.request(*requests.unanswered())
            intrinsic.add_labels(client.new_records())
            captions, pairs = requests.label_requests()
            client.request(captions, pairs)
        t2 = time.perf_counter()
        rewards_s.append(t1 - t0)
        exchange_s.append(t2 - t1)
        asked += len(captions) + len(pairs)
        if case in ("captions", "pairs"):  # a fast LLM: every answer in the table before the next update
            entries = [(c, {"caption": c, "label": int(good(c))}) for c in captions] + [
                (annotator.item_key(tuple(p)),
                 {"pair": list(p), "preference": 1 if good(p[0]) else 2 if good(p[1]) else None})
                for p in pairs]
            # as the annotator's loop puts them, a turn's answers at once
            for i in range(0, len(entries), 64):
                client.table.put(entries[i:i + 64])
    gc.callbacks.remove(gc_timer)
    figures = {"updates": updates, "push_s": time.time() - started, "gc_full": len(gc_s),
               "gc_max_ms": 1e3 * max(gc_s, default=0)}
    if case == "http":  # the last answers
        while asked - client.stats().get("labels", 0) > 0 and time.time() - started < opts["http_timeout"]:
            time.sleep(0.05)
        figures["labels_per_s"] = client.stats().get("labels", 0) / (time.time() - started)
    intrinsic.add_labels(client.new_records())
    piece = intrinsic.piece
    figures.update(labels=len(piece.labels), pairs_answered=len(piece.pairs), asked=len(requests.asked),
                   seen=len(intrinsic.seen))
    if case == "unanswered":  # one re-ask sweep, as due every RETRY_S
        reward_models.RETRY_S, requests.last_retry = 0.0, 0.0
        t0 = time.perf_counter()
        captions, pairs = requests.label_requests()
        client.request(captions, pairs)
        figures["sweep_s"] = time.perf_counter() - t0
        figures.update(sweep_captions=len(captions), sweep_mb=len(pickle.dumps((captions, pairs))) / 1e6)
        if hasattr(requests, "unanswered"):  # what a restarted annotator is sent
            t0 = time.perf_counter()
            again = requests.unanswered()
            figures.update(restart_s=time.perf_counter() - t0, restart_captions=len(again[0]))
        time.sleep(2)  # the queue's feeder thread and the annotator take it in
    # holding it all (a publication's forward pass below adds its own)
    figures["learner_mb"] = vm(os.getpid())
    # the trainer's lock at n labels
    if case == "captions" and isinstance(piece, reward_models.Classification):
        piece.lock = lock = TimedLock(piece.lock)
        step_s = []
        for _ in range(3):
            lock.held.clear()
            piece.minibatch_loss(256)
            step_s.append(sum(lock.held))
        lock.held.clear()
        with lock:  # train_now() asks ready() under the lock, every 0.1 s while no training is due
            piece.ready()
        poll_s = sum(lock.held)
        lock.held.clear()
        t0 = time.perf_counter()
        piece.publish()
        figures.update(lock_step_s=max(step_s), lock_poll_s=poll_s, lock_publish_s=sum(lock.held),
                       publish_s=time.perf_counter() - t0)
    path = os.path.join(run_dir, "checkpoint.pt")
    t0 = time.perf_counter()
    torch.save(intrinsic.state_dict(), path)
    figures.update(checkpoint_s=time.perf_counter() - t0, checkpoint_mb=os.path.getsize(path) / 1e6)
    figures.update(rewards_ms=1e3 * statistics.median(rewards_s),
                   exchange_ms=1e3 * statistics.median(exchange_s),
                   exchange_max_ms=1e3 * max(exchange_s),
                   exchange_p99_ms=1e3 * sorted(exchange_s)[int(0.99 * len(exchange_s))])
    figures.update(manager_mb=vm(client.manager._process.pid),
                   annotator_mb=vm(client.process.pid))
    stats = client.stats()
    figures.update(llm_labels=stats.get("labels", 0), dropped=stats.get("dropped", 0))
    client.close()
    if fake is not None:
        fake.stdin.close()
        fake.wait()
    return figures


ROWS = [  # (case, figure, format)
    ("captions", "learner_mb", "learner process peak RSS, MB"),
    ("captions", "manager_mb", "Manager peak RSS, MB"),
    ("captions", "annotator_mb", "annotator peak RSS, MB"),
    ("captions", "rewards_ms", "rewards() per update, median ms"),
    ("captions", "exchange_ms", "label exchange per update, median ms"),
    ("captions", "exchange_max_ms", "label exchange per update, max ms"),
    ("captions", "gc_max_ms", "longest full GC pass in the learner process, ms"),
    ("captions", "checkpoint_mb", "checkpoint (reward model), MB"),
    ("captions", "checkpoint_s", "checkpoint, s"),
    ("captions", "lock_step_s", "classifier lock per training step, ms"),
    ("captions", "lock_poll_s", "classifier lock per idle poll, ms"),
    ("captions", "lock_publish_s", "classifier lock per publication, ms"),
    ("captions", "publish_s", "one publication (copy + gate), s"),
    ("unanswered", "learner_mb", "learner process peak RSS, MB"),
    ("unanswered", "manager_mb", "Manager peak RSS, MB"),
    ("unanswered", "annotator_mb", "annotator peak RSS, MB"),
    ("unanswered", "exchange_ms", "label exchange per update, median ms"),
    ("unanswered", "exchange_max_ms", "label exchange per update, max ms"),
    ("unanswered", "gc_max_ms", "longest full GC pass in the learner process, ms"),
    ("unanswered", "sweep_s", "one re-ask sweep (learner thread), s"),
    ("unanswered", "sweep_captions", "captions it sends"), ("unanswered", "sweep_mb", "...pickled, MB"),
    ("unanswered", "restart_s", "unanswered() for a restarted annotator, s"),
    ("unanswered", "checkpoint_mb", "checkpoint (reward model), MB"),
    ("unanswered", "checkpoint_s", "checkpoint, s"),
    ("pairs", "learner_mb", "learner process peak RSS, MB"), ("pairs", "manager_mb", "Manager peak RSS, MB"),
    ("pairs", "annotator_mb", "annotator peak RSS, MB"),
    ("pairs", "exchange_ms", "label exchange per update, median ms"),
    ("pairs", "exchange_max_ms", "label exchange per update, max ms"),
    ("pairs", "pairs_answered", "pairs trained on"),
    ("pairs", "checkpoint_mb", "checkpoint (reward model), MB"), ("pairs", "checkpoint_s", "checkpoint, s"),
    ("http", "labels_per_s", "labels/s over HTTP (fake LLM)"),
    ("http", "learner_mb", "learner process peak RSS, MB"),
    ("http", "manager_mb", "Manager peak RSS, MB"), ("http", "annotator_mb", "annotator peak RSS, MB"),
    ("http", "exchange_ms", "label exchange per update, median ms"),
    ("http", "exchange_max_ms", "label exchange per update, max ms"),
]


def show(value, key):
    if value is None:
        return "n/a"
    if key.endswith("_s") and key.startswith("lock"):
        return f"{1e3 * value:.1f}"
    if isinstance(value, int) or key in ("sweep_captions", "pairs_answered"):
        return f"{value:,}"
    return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"


def run_case(tree, case, n, args):
    opts = {k: getattr(args, k) for k in ("new_per_update", "pairs_per_update", "captions_reward",
                                          "llm_concurrency", "http_timeout")}
    command = [sys.executable, os.path.abspath(__file__), "--measure", json.dumps([tree, case, n, opts])]
    return common.run_json(command, tree, case)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--captions", type=int, default=100_000,
                        help="distinct captions (captions, unanswered)")
    parser.add_argument("--pairs", type=int, default=10_000, help="pairs asked by ranking")
    parser.add_argument("--http-captions", type=int, default=5_000,
                        help="captions answered over HTTP (0: no http case)")
    parser.add_argument("--new-per-update", type=int, default=512,
                        help="new distinct messages in a batch of 1,024 steps")
    parser.add_argument("--pairs-per-update", type=int, default=100,
                        help="pairs ranking draws a batch (oni_appo: 8)")
    parser.add_argument("--captions-reward", default="classification",
                        choices=("classification", "retrieval"))
    parser.add_argument("--llm-concurrency", type=int, default=256)
    parser.add_argument("--http-timeout", type=float, default=600.0, help="seconds the http case may take")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--baseline", default=None, help="a commit to measure side by side (a git worktree)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        tree, case, n, opts = json.loads(args.measure)
        sys.path.insert(0, tree)
        print(json.dumps(measure(case, n, opts)))
        return
    trees = common.trees(args.baseline)
    sizes = {"captions": args.captions, "unanswered": args.captions, "pairs": args.pairs,
             "http": args.http_captions}
    cases = [c for c in args.cases if sizes[c] > 0]
    print(f"{os.cpu_count()} cores; cases: " + ", ".join(f"{c} {sizes[c]:,}" for c in cases) +
          f"; {args.new_per_update} new messages per update of {T * B:,} steps", flush=True)
    results = {}
    for case in cases:  # the trees alternate case by case
        for name, tree in trees.items():
            started = time.time()
            results[case, name] = figures = run_case(tree, case, sizes[case], args)
            print(f"  {case:10s} {name:18s} {time.time() - started:6.0f} s  " +
                  " ".join(f"{k}={show(v, k)}" for k, v in figures.items()), flush=True)
    print("\n| case | figure | " + " | ".join(trees) + " |\n|---|---|" + "---|" * len(trees))
    for case, key, label in ROWS:
        if case in cases:
            print(f"| {case} {sizes[case]:,} | {label} | " +
                  " | ".join(show(results[case, name].get(key), key) for name in trees) + " |")


if __name__ == "__main__":
    main()
