"""The pipeline's own ceiling: oni_appo's training loop with a null env and a nearly free policy.

    python benchmarks/pipeline_ceiling.py  # 2 workers x 16/64/256 envs x 3 batch sizes
    python benchmarks/pipeline_ceiling.py --num-workers 2 16 --num-envs-per-worker 256 --batch-size 16384 \
        --seconds 10
    python benchmarks/pipeline_ceiling.py --baseline bfa849a --repeats 3  # side by side with that commit

All of `oni_appo.train()` runs as in training (the learner's process: learn, next_batch, take_batch,
IntrinsicReward.rewards() of --reward-type none, add_intrinsic_episodes, the update, the weights' hand-over,
logs, the last checkpoint; the acting process: collect, receive, act, hand_over; its spawned env workers
writing halves of their envs into the shared buffers) but for two pieces: the workers' `envs.make_env` builds
`NullEnv`s, and `oni_appo.Agent` is `FreeAgent`. What is left is the coordination that neither a faster env
nor a GPU can speed up. Each grid point is a fresh train() in a process of its own, measured for --seconds
from --warmup seconds after its first update: env steps/s; CPU us per env step of acting + learning, of acting
alone, of learning alone, and of the env workers (all of them); the cores acting + learning kept busy; the
mean policy lag (in updates) of the steps learned in that window. (Before the learner had a process of its
own, acting was the main thread and learning a thread beside it, under one GIL: each tree is measured by its
own copy of this script, which knows its structure.)

--baseline REV runs the same grid from a git worktree of commit REV (one that has this script: e0b6387 or
later), alternating with this tree point by point (--repeats times each), and prints both and their ratio. The
ESTIMATE at the end scales the measured per-step costs to --cores cores with NLE at --nle-sps steps/s per
worker core, its assumptions printed with it. On a machine shared with other work the figures are noisy.
"""
import argparse
import itertools
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

# as this tree's oni_appo.py sets it before torch loads (not for a baseline's measure)
if "--measure" in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn

import common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLLOUT = 32  # oni_appo's default --rollout, which the grid keeps
FIGURES = (("sps", "steps/s", "{:,.0f}"), ("process_us", "acting + learning us/step", "{:.1f}"),
           ("main_us", "acting us/step", "{:.1f}"), ("learner_us", "learning us/step", "{:.1f}"),
           ("workers_us", "workers us/step", "{:.1f}"), ("cores", "acting + learning cores", "{:.2f}"),
           ("lag", "policy lag", "{:.2f}"))


class NullEnv:
    """envs.NetHackTask at nearly no cost: its observation keys, shapes and dtypes (the arrays filled in
    place, as NLE does), `info["message_count"]` every step, `info["episode"]` at the end, which comes every
    ~1,000 steps (staggered by seed so that envs do not end together). Half the steps show one of 32 distinct
    messages, the others none, so that the learner's distinct-message bookkeeping has work to do."""
    SPEC = {"glyphs": ((21, 79), np.int16), "chars": ((21, 79), np.uint8), "colors": ((21, 79), np.uint8),
            "blstats": ((27,), np.int64), "message": ((256,), np.uint8)}
    MESSAGES = np.frombuffer(b"".join(
        f"You hear the footsteps of a guard on patrol {i}.".encode().ljust(256, b"\0")
        if i % 2 else bytes(256) for i in range(64)), np.uint8).reshape(64, 256)
    EPISODE = {"return": 0.0, "success": 0.0, "score": 0, "depth": 1, "dlvl": 1, "xlvl": 1, "gold": 0,
               "kills": 0, "explored": 0, "end": "died", "end_text": "You die..."}

    def __init__(self, task, seed=0, **kwargs):
        self.obs = {k: np.zeros(shape, dtype) for k, (shape, dtype) in self.SPEC.items()}
        self.seed, self.length = seed, 1000 + seed % 97

    def reset(self, seed=None, options=None):
        self.steps, self.counts = 0, {}
        return self.observe()

    def step(self, action):
        self.steps += 1
        obs, info = self.observe()
        if self.steps >= self.length:
            info["episode"] = dict(self.EPISODE, steps=self.steps)
        return obs, 0.0, self.steps >= self.length, False, info

    def observe(self):
        m = (self.seed + 7 * self.steps) % len(self.MESSAGES)
        self.obs["message"][:] = self.MESSAGES[m]
        self.counts[m] = self.counts.get(m, 0) + 1
        return self.obs, {"message_count": self.counts[m]}

    def close(self):
        pass


class FreeAgent(nn.Module):
    """oni_appo.Agent's interface (step, unroll, gru.hidden_size) at nearly no cost: the logits and the value
    are two parameters, whatever the observation, and the GRU state passes through."""

    def __init__(self):
        import envs  # the measured tree's (on sys.path by now)
        super().__init__()
        self.logits, self.value = nn.Parameter(torch.zeros(len(envs.ACTIONS))), nn.Parameter(torch.zeros(()))
        self.gru = SimpleNamespace(hidden_size=512)  # the state size oni_appo's buffers keep h0 in

    def step(self, obs, h):
        # repeat, not expand: a view of a parameter, even under no_grad, would carry its graph into the
        # buffers (as act's log-probs)
        return self.logits.repeat(len(h), 1), self.value.repeat(len(h)), h

    fast_step = step  # oni_appo.act's entry (a CUDA graph of step there)

    def unroll(self, obs, h0, cuts):
        steps, batch = obs["chars"].shape[:2]
        return self.logits.repeat(steps, batch, 1), self.value.repeat(steps, batch)


def null_env_worker(*args):
    """The target of each spawned worker: oni_appo's own env_worker, in a process where envs.make_env builds
    NullEnvs. A patch in the parent does not reach a spawned process; this function, pickled by name, runs in
    it."""
    import envs
    import oni_appo
    envs.make_env = NullEnv
    oni_appo.env_worker(*args)


def null_act_process(*args):
    """The acting process's target: oni_appo's own, acting with FreeAgent, its workers spawned as
    null_env_worker."""
    import oni_appo
    oni_appo.Agent, oni_appo.env_worker = FreeAgent, null_env_worker
    oni_appo.act_process(*args)


def process_cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        utime, stime = f.read().rsplit(")", 1)[1].split()[11:13]
    return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")


def children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def measure(workers, envs_per_worker, batch_size, opts):
    """One grid point: oni_appo.train() in this process (the learner's) with NullEnv and FreeAgent; its
    figures."""
    if opts["threads"]:
        torch.set_num_threads(opts["threads"])
    import oni_appo
    figures, learn = {}, oni_appo.learn

    def snapshot(run):
        acting = run.acting.pid
        return np.array([time.perf_counter(), run.tally.counters["collected_steps"],
                         run.tally.sums["lag_sum"], run.tally.sums["lag_steps"],
                         time.process_time(), process_cpu_s(acting),
                         sum(map(process_cpu_s, children(acting)))])

    def window(run):  # steady state: from --warmup seconds after the first update, for --seconds
        while run.tally.counters["updates"] < 1 and not run.stop.value:
            time.sleep(0.05)
        time.sleep(opts["warmup"])
        first = snapshot(run)
        time.sleep(opts["seconds"])
        wall, steps, lag_sum, lag_steps, learner, acting, workers_cpu = snapshot(run) - first
        run.stop.value = 1
        us = lambda seconds: 1e6 * seconds / max(steps, 1)
        figures.update(sps=steps / wall, process_us=us(learner + acting), main_us=us(acting),
                       learner_us=us(learner), workers_us=us(workers_cpu), cores=(learner + acting) / wall,
                       lag=lag_sum / lag_steps if lag_steps else None, processes=2)

    def learn_here(run):
        threading.Thread(target=window, args=(run,), daemon=True).start()
        learn(run)

    oni_appo.Agent, oni_appo.act_process, oni_appo.learn = FreeAgent, null_act_process, learn_here
    with tempfile.TemporaryDirectory(prefix="pipeline-ceiling-") as run_dir:
        oni_appo.train(oni_appo.parse_args([
            "--reward-type", "none", "--num-workers", str(workers), "--num-envs-per-worker",
            str(envs_per_worker), "--batch-size", str(batch_size), "--rollout", str(ROLLOUT), "--device",
            opts["device"], "--checkpoint-every-s", "1e9", "--run-dir", run_dir]))
    return figures


def run_point(tree, point, opts):
    # the tree's own: it knows its processes
    script = os.path.join(tree, "benchmarks", os.path.basename(__file__))
    command = [sys.executable, script, "--measure", json.dumps([tree, *point, opts])]
    return common.run_json(command, tree, "x".join(map(str, point)))


def show(value, form):
    return "n/a" if value is None else form.format(value)


def mean(runs, key):
    values = [r.get(key, 1) for r in runs if r.get(key, 1) is not None]  # "processes": 1 unless said
    return sum(values) / len(values) if values else None


def estimate(point, figures, args):
    """(env workers, their bound, acting + learning's bound, steps/s, policy lag) on --cores cores. Steps/s:
    the lesser bound. Acting + learning: a tree that runs them in one process under one GIL gets one core and
    their costs add up; one with a process each gets a core each and the slower bounds. The lag: the measured
    one plus the added workers' steps in flight (half a rollout each, on average) over the batch."""
    workers, envs_per_worker, batch_size = point
    split = figures["processes"] == 2
    env_workers = args.cores - 1 - split
    worker_sps = env_workers * 1e6 / (1e6 / args.nle_sps + figures["workers_us"])
    main_sps = 1e6 / (max if split else sum)((figures["main_us"], figures["learner_us"]))
    added = ROLLOUT * (env_workers - workers) * envs_per_worker / (2 * batch_size)
    return (env_workers, worker_sps, main_sps, min(worker_sps, main_sps),
            None if figures["lag"] is None else figures["lag"] + added)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-workers", type=int, nargs="+", default=[2])
    parser.add_argument("--num-envs-per-worker", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1024, 4096, 16384],
                        help="points where it is no multiple of rollout * envs per worker / 2 are skipped")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=1.0,
                        help="seconds after the first update before measuring")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the main process (default: torch's)")
    parser.add_argument("--device", default="cpu",
                        help="oni_appo's --device (cuda: the copies to the GPU count)")
    parser.add_argument("--baseline", default=None, help="a commit to measure side by side (a git worktree)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each tree per point (figures: their mean)")
    parser.add_argument("--cores", type=int, default=16, help="cores of the machine the ESTIMATE is for")
    parser.add_argument("--nle-sps", type=float, default=16_000,
                        help="NLE steps/s of one worker core, for the ESTIMATE")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        tree, *point, opts = json.loads(args.measure)
        sys.path.insert(0, tree)
        print(json.dumps(measure(*point, opts)))
        return
    trees = common.trees(args.baseline)
    grid = [p for p in itertools.product(args.num_workers, args.num_envs_per_worker, args.batch_size)
            if p[2] % (ROLLOUT * p[1] // 2) == 0]
    opts = {k: getattr(args, k) for k in ("seconds", "warmup", "threads", "device")}
    print(f"{os.cpu_count()} cores; null env, free policy, --reward-type none, rollout {ROLLOUT}; "
          f"{args.seconds:g} s a point; grid (workers x envs per worker x batch): "
          + ", ".join("x".join(map(str, p)) for p in grid), flush=True)
    results = {}
    # the trees alternate
    for point, _, (name, tree) in itertools.product(grid, range(args.repeats), trees.items()):
        figures = run_point(tree, point, opts)
        results.setdefault((point, name), []).append(figures)
        print(f"  {'x'.join(map(str, point)):12s} {name:18s} " +
              " ".join(f"{k}={show(figures[k], form)}" for k, _, form in FIGURES), flush=True)
    print("\n| workers x envs x batch | tree | " + " | ".join(label for _, label, _ in FIGURES)
          + " |\n|---|---|" + "---|" * len(FIGURES))
    means = {key: {k: mean(runs, k) for k in [k for k, _, _ in FIGURES] + ["processes"]}
             for key, runs in results.items()}
    for point in grid:
        label = "x".join(map(str, point))
        for name in trees:
            print(f"| {label} | {name} | "
                  + " | ".join(show(means[point, name][k], form) for k, _, form in FIGURES) + " |")
        if args.baseline:
            before, now = (means[point, name] for name in trees)
            print(f"| {label} | now / before | " + " | ".join(
                show(now[k] / before[k] if now[k] and before[k] else None, "{:.2f}")
                for k, _, _ in FIGURES) + " |")
    print(f"\nESTIMATE for {args.cores} cores, not a measurement. Assumes: the cores not left for acting and "
          f"learning run env workers, one core each, NLE at {args.nle_sps:,.0f} steps/s per core plus the "
          "workers' measured us/step; acting and learning at their measured us/step, on one core where one "
          "process does both (one GIL), on one core each where each has its process; host cores as fast as "
          "this machine's; per-step costs as measured here with fewer workers; the policy's own time (a real "
          "network's inference and update, on a GPU or not) not counted; the learner keeps up, so the lag "
          "only grows by the added workers' steps in flight.")
    print("\n| workers x envs x batch | tree | env workers' bound | acting + learning bound | estimate "
          "steps/s | policy lag |\n|---|---|---|---|---|---|")
    for (point, name), figures in means.items():
        env_workers, *bounds, lag = estimate(point, figures, args)
        print(f"| {env_workers}x{point[1]}x{point[2]} (measured at {point[0]} workers) | {name} | "
              + " | ".join(f"{b:,.0f}" for b in bounds) + f" | {show(lag, '{:.1f}')} |")


if __name__ == "__main__":
    main()
