"""Training throughput beside raw NLE on the same number of processes, in one run.

    python benchmarks/throughput.py --num-workers 2 --steps 30000
    python benchmarks/throughput.py --num-workers 2 --steps 30000 --llm stub      # + ranking, LLM elsewhere
    python benchmarks/throughput.py --num-workers 2 --steps 30000 --llm embedded  # + ranking, LLM on this box
    python benchmarks/throughput.py --num-workers 2 --steps 100000 --llm embedded --reward-free \
        --rewards retrieval classification ranking  # each ONI reward with the embedded LLM, as a user runs it
    python benchmarks/throughput.py --num-workers 2 --steps 60000 --baseline 4123154 --repeats 2
    python benchmarks/throughput.py --num-workers 2 --steps 60000 --collection    # + the pipeline alone

Rows: raw NLE (random actions, the same observation keys and 28 actions) on --num-workers
processes; `oni_appo.py --reward-type none`; and, with --llm, each of --rewards (default ranking;
annotation and reward-model training on), with its steps/s over none's, the labels answered and the
share of the run's pay weight (sum of 1/N^beta over steps with a message) paid with the LLM's judgement
of the message in hand, beside the share that its first batch paid (no label can be there yet).
`stub` answers instantly from this process (tests/fake_openai.py): it stands for an LLM server on
other hardware, so the ratio measures our side of ONI only; `embedded` is oni_appo's default, the
llama.cpp server on these cores. --reward-free runs all with --extrinsic-coef 0 (the paper's setting).
--baseline REV runs `--reward-type none` from a git worktree of commit REV, alternating with this
tree (--repeats times each), and prints steps/s and mean policy lag (tensorboard charts/policy_lag_mean
averaged over the run's logs) side by side.
--collection adds the pipeline alone: oni_appo's own workers, shared buffers and batched inference,
with a learner that takes each batch and does no update, and the share of its wall time spent in
inference (the acting process's `act`): the figure that predicts a GPU node, where learning is nearly free.
"""
import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # the method; tests/fake_openai.py


def raw_nle_worker(seconds, seed, out):
    import numpy as np

    import envs
    from benchmarks.env_throughput import RawNLE
    env, rng, steps = RawNLE(seed), np.random.default_rng(seed), 0
    env.reset()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        _, _, terminated, truncated, _ = env.step(int(rng.integers(len(envs.ACTIONS))))
        steps += 1
        if terminated or truncated:
            env.reset()
    out.put(steps / (time.perf_counter() - start))


def raw_nle(processes, seconds):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=raw_nle_worker, args=(seconds, i, out)) for i in range(processes)]
    for p in procs:
        p.start()
    total = sum(out.get() for _ in procs)
    for p in procs:
        p.join()
    return total


def timed_act_process(args, *rest):
    """The acting process's target: oni_appo's own with act() timed; the seconds go to RUN_DIR/inference_s."""
    import oni_appo
    act, spent = oni_appo.act, [0.0]

    def timed_act(actor, conns, slots):
        start = time.perf_counter()
        act(actor, conns, slots)
        spent[0] += time.perf_counter() - start
    oni_appo.act = timed_act
    try:
        oni_appo.act_process(args, *rest)
    finally:
        with open(os.path.join(args.run_dir, "inference_s"), "w") as f:
            f.write(str(spent[0]))


def collection_run(oni_argv):
    """oni_appo's training loop with a learner that does no update; summary.json gets inference_share."""
    import oni_appo

    def no_update(run, batch, rewards):
        run.tally.counters["updates"] += 1
        run.weights.push(run.agent, run.tally.counters["updates"])  # the versions that the policy lag counts
        return {}
    oni_appo.act_process, oni_appo.update_policy = timed_act_process, no_update
    args = oni_appo.parse_args(oni_argv)
    summary = oni_appo.train(args)
    with open(os.path.join(args.run_dir, "inference_s")) as f:
        summary["inference_share"] = float(f.read()) / summary["session_wall_time_s"]
    with open(os.path.join(args.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f)


def train(extra, steps, workers, envs_per_worker, root=ROOT, collection=False, batch_size=None):
    """One oni_appo.py run; envs_per_worker and batch_size None: oni_appo's defaults (on a GPU 64 and
    4096)."""
    run_dir = tempfile.mkdtemp(prefix="oni-bench-")
    extra = [*extra, *(["--batch-size", str(batch_size)] if batch_size else []),
             *(["--num-envs-per-worker", str(envs_per_worker)] if envs_per_worker else [])]
    program = [os.path.abspath(__file__), "--collection-run"] if collection else [
        os.path.join(root, "oni_appo.py")]
    command = [sys.executable, *program, "--total-env-steps", str(steps), "--num-workers", str(workers),
               "--run-dir", run_dir, "--checkpoint-every-s", "1e9", *extra]
    result = subprocess.run(command, capture_output=True, text=True, cwd=root)
    if result.returncode:
        raise SystemExit(f"error: {' '.join(command)} failed:\n{result.stderr[-2000:]}")
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    # steps collected a second (as before it was named)
    summary["sps"] = summary.get("session_sps", summary["sps"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(run_dir)
    events.Reload()
    summary["lag_mean"] = sum(e.value for e in events.Scalars("charts/policy_lag_mean")) / len(
        events.Scalars("charts/policy_lag_mean"))
    return summary


def compare(baseline, args, configs):
    """A git worktree of commit `baseline` against this tree, runs alternated, each of `configs`."""
    # both trees run this tree's configuration: the defaults of envs and batch changed in 53085a2
    import oni_appo
    resolved = oni_appo.parse_args(["--num-workers", str(args.num_workers)])
    envs_per_worker, batch_size = (args.num_envs_per_worker or resolved.num_envs_per_worker,
                                   args.batch_size or resolved.batch_size)
    trees = common.trees(baseline)
    results = {(name, config): [] for config in configs for name in trees}
    for _ in range(args.repeats):
        for config, extra in configs.items():
            for name, root in trees.items():
                at = extra.index("--llm-share") if root != ROOT and "--llm-share" in extra else len(extra)
                s = train(extra[:at] + extra[at + 2:],  # --llm-share: a flag of this tree's alone
                          args.steps, args.num_workers, envs_per_worker, root, batch_size=batch_size)
                results[name, config].append(s)
                print(f"  {config:12s} {name:18s} {s['sps']:8,.0f} steps/s  policy lag {s['lag_mean']:.2f}"
                      f"{judged(s)}", flush=True)
    mean = {k: {m: sum(s[m] for s in v) / len(v) for m in ("sps", "lag_mean")} for k, v in results.items()}
    for (name, config), m in mean.items():
        print(f"{config + ', ' + name:48s} {m['sps']:10,.0f} steps/s  mean policy lag {m['lag_mean']:.2f} "
              f"updates  ({m['sps'] / mean[name, 'none']['sps']:.3f} of none)")
    for config in configs:
        before, now = (mean[name, config] for name in trees)
        print(f"{config}: ratio now / before: {now['sps'] / before['sps']:.3f} steps/s, "
              f"{now['lag_mean'] / before['lag_mean']:.2f} policy lag")


def judged(summary) -> str:  # labels and the share of pay weight judged when paid, where the run has them
    if summary.get("llm_labels") is None or summary["sessions"][0]["flags"]["reward_type"] == "none":
        return ""
    if "judged_pay_share" not in summary:
        return f", {summary['llm_labels']:,} labels"
    return (f", {summary['llm_labels']:,} labels, {summary['judged_pay_share']:.1%} of pay weight judged "
            f"when paid, {summary['first_seen_pay_share']:.1%} in first batches")


def main():
    if sys.argv[1:2] == ["--collection-run"]:
        return collection_run(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-workers", type=int, default=os.cpu_count())
    parser.add_argument("--num-envs-per-worker", type=int, default=None,
                        help="default: oni_appo's (16; 64 on a GPU)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="oni_appo's --batch-size (default: its own)")
    parser.add_argument("--steps", type=int, default=50_000, help="env steps per training run")
    parser.add_argument("--raw-seconds", type=float, default=10.0)
    parser.add_argument("--llm", default=None, help="also run --rewards with: stub | embedded | a base URL")
    parser.add_argument("--rewards", nargs="+", default=["ranking"], help="the reward types run with --llm")
    parser.add_argument("--reward-free", action="store_true", help="every run with --extrinsic-coef 0")
    parser.add_argument("--llm-share", type=float, default=None,
                        help="oni_appo's --llm-share (default: its own)")
    parser.add_argument("--baseline", default=None,
                        help="compare each run with this git commit's, alternated")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side with --baseline")
    parser.add_argument("--collection", action="store_true", help="also run the pipeline with no learning")
    args = parser.parse_args()
    free = ["--extrinsic-coef", "0"] if args.reward_free else []
    stub, url_args = None, []
    if args.llm == "stub":
        from fake_openai import FakeOpenAI
        stub = FakeOpenAI().start()
        url_args = ["--llm-url", stub.url]
    elif args.llm not in (None, "embedded"):
        url_args = ["--llm-url", args.llm]
    share = ["--llm-share", str(args.llm_share)] if args.llm_share else []
    configs = {"none": ["--reward-type", "none", *free], **{
        reward: ["--reward-type", reward, *url_args, *share, *free]
        for reward in (args.rewards if args.llm else [])}}
    try:
        if args.baseline:
            return compare(args.baseline, args, configs)
        measure(args, configs)
    finally:
        if stub is not None:
            stub.stop()


def measure(args, configs):
    rows = [("raw NLE, random actions", raw_nle(args.num_workers, args.raw_seconds), {})]
    print(f"{rows[0][0]:48s} {rows[0][1]:10,.0f} steps/s", flush=True)
    run = lambda extra, **kw: train(extra, args.steps, args.num_workers, args.num_envs_per_worker,
                                    batch_size=args.batch_size, **kw)
    none = run(configs["none"])
    rows.append(("oni_appo --reward-type none", none["sps"], none))
    print(f"{rows[1][0]:48s} {none['sps']:10,.0f} steps/s  ({none['sps'] / rows[0][1]:.3f} of raw; "
          f"mean policy lag {none['lag_mean']:.2f} updates)", flush=True)
    if args.collection:
        alone = run(configs["none"], collection=True)
        print(f"{'collection alone (learner does no update)':48s} {alone['sps']:10,.0f} steps/s  "
              f"({alone['sps'] / rows[0][1]:.3f} of raw; {alone['inference_share']:.0%} of its wall time in "
              f"inference, {1e6 * alone['inference_share'] * alone['wall_time_s'] / alone['env_steps']:.0f} "
              "us per env step)", flush=True)
    for reward, extra in list(configs.items())[1:]:
        oni = run(extra)
        label = f"oni_appo --reward-type {reward} (LLM: {args.llm})"
        print(f"{label:48s} {oni['sps']:10,.0f} steps/s  ({oni['sps'] / none['sps']:.3f} of "
              f"none{judged(oni)})", flush=True)


if __name__ == "__main__":
    main()
