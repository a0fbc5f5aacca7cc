"""Learning curves: train a few configurations of oni_appo.py over seeds, then plot and tabulate them.

    python learning_curves.py                                  # the first five configs, seed 1
    python learning_curves.py --configs free_none free_ranking --seeds 1 2 3
    python learning_curves.py --steps 2e9 -- --llm-url http://gpu:8000/v1   # the paper's scale
    python learning_curves.py --plot results/curves/free_none runs/some_run  # only plot
    python learning_curves.py --plot results/five_2m/free_ranking --until 1e6   # its tables at 1M steps
    python learning_curves.py --plot results/five_2m/free_* --until 1e6 --eval-from earlier_1  # + 1M evals
    python learning_curves.py --plot results/five_2m/free_* --since 1e6   # the episodes of its second million
    python learning_curves.py --eval results/curves/score_extrinsic results/curves/free_ranking
    python learning_curves.py --eval results/curves/free_retrieval --record   # + first episode's replay

Configurations (steps by default; the first five by default):
    score_extrinsic  --task NetHackScoreExtendedActions-v1 --reward-type none           1,000,000
    free_none        --extrinsic-coef 0 --reward-type none                                500,000
    free_retrieval   --extrinsic-coef 0 --reward-type retrieval                           500,000
    free_ranking     --extrinsic-coef 0 --reward-type ranking                             500,000
    free_classification --extrinsic-coef 0 --reward-type classification                   500,000
    stairs_task, stairs_retrieval, stairs_classification, stairs_ranking, stairs_ellm
                     --task NetHackStaircaseExtendedActions-v1 --reward-type none|...|ellm  1,000,000
    lvl3_task, lvl3_retrieval, ..., lvl3_ellm: the same on NetHackStaircaseLvl3ExtendedActions-v1
Each run goes to OUT/CONFIG/seedS (console.log holds its output). Runs are resumable: a run whose
summary.json reached the steps is skipped, one with a checkpoint.pt is continued with --resume; a committed
run (its episodes gzipped, episodes.jsonl.gz, as results/ keeps them) is skipped too.
Everything after `--` goes verbatim to oni_appo.py. OUT/wall_times.json holds each run's wall time.

Plotting takes config dirs (holding seed*/episodes.jsonl or .gz) or run dirs (holding episodes.jsonl or .gz).
OUT/curves.png: score and success (where some episode succeeded) per episode and per step, episode length,
depth, kills, explored and intrinsic return against env steps; per seed the value over the episodes that
ended in each of 25 equal bins of env steps, per config the mean over seeds (line) and their min-max (shaded).
OUT/curves.md: per config the last-100-episode means (mean ± std over seeds) and the
commits that made each seed (its summary.json's sessions; "+": with uncommitted changes); below it, each
config against its baselines (on the Score task its score against the control and the score-trained agent, on
a sparse task its success in percent against its task reward alone), over the last 100 episodes of training
and, once every seed has its eval.json, over all the evaluated games: "beats" only beyond the larger std
(ddof 1) over seeds, and whether the seeds overlap. --until STEPS: the same tables of the episodes that ended
by STEPS (a longer run as it stood then), with the evaluations in each run's --eval-from folder if given;
--since STEPS: of those that ended after STEPS (a resumed run's new leg), with the final evaluations; both:
those that ended between, with no evaluation but --eval-from's.
--eval-after N evaluates each run as soon as it is complete (and a complete one not yet evaluated), while its
checkpoint, which is not committed, is still there. --eval --record also writes the replay of each run's first
evaluated episode (evaluate.py --record) to RUN/replay and RUN/replay_random: episode0.html and NLE's
episode0.ttyrec3.bz2.
"""
import argparse
import fcntl
import functools
import glob
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
import warnings

import numpy as np

import llm_server
from run_files import LOCK_FILE, rewrite

ROOT = os.path.dirname(os.path.abspath(__file__))
SCORE = "NetHackScoreExtendedActions-v1"
SPARSE = {"stairs": "NetHackStaircaseExtendedActions-v1",  # Config name prefix: its task.
          "lvl3": "NetHackStaircaseLvl3ExtendedActions-v1"}
# name: (task, reward type, extrinsic coef (None: oni_appo's default), default env steps)
CONFIGS = {
    "score_extrinsic": (SCORE, "none", None, 1_000_000),
    "free_none": (SCORE, "none", 0, 500_000),
    "free_retrieval": (SCORE, "retrieval", 0, 500_000),
    "free_ranking": (SCORE, "ranking", 0, 500_000),
    "free_classification": (SCORE, "classification", 0, 500_000),
    # The sparse tasks, their reward at the paper's coefficient (c_ext 10): alone, with each ONI reward, ELLM.
    **{f"{prefix}_{name}": (task, "none" if name == "task" else name, None, 1_000_000)
       for prefix, task in SPARSE.items()
       for name in ("task", "retrieval", "classification", "ranking", "ellm")},
}


def per_episode(key, scale=1):  # Episodes whose file predates the key are left out (NaN if all are).
    return lambda episodes: scale * mean([e.get(key, np.nan) for e in episodes])


def per_step(key, scale):  # Over the episodes' steps summed: per step, a longer life is no edge in itself.
    def value(episodes):
        if any(key not in e for e in episodes):  # Not 0: a file that predates the key recorded nothing.
            return float("nan")
        return scale * sum(e[key] for e in episodes) / sum(e["steps"] for e in episodes)
    return value


# The figure's panels: in each bin, a seed's value over the episodes that ended there; per step beside per
# episode, as the tables read them. The success panels only where some episode succeeded.
PANELS = {"score": per_episode("score"), "score / 1,000 steps": per_step("score", 1e3),
          "success (% of episodes)": per_episode("success", 100),
          "successes / 1M steps": per_step("success", 1e6),
          "episode steps": per_episode("steps"), "depth": per_episode("depth"), "kills": per_episode("kills"),
          "explored": per_episode("explored"), "intrinsic return": per_episode("intrinsic_return")}
SUCCESS_PANELS = ("success (% of episodes)", "successes / 1M steps")
TITLES = {"xlvl": "experience level", "intrinsic_rewarded_fraction": "share of an episode's steps paid",
          "steps": "episode steps"}
BINS, WINDOW = 25, 100
# How an episode ended, from what envs.py records (`end`, `end_text`): NetHack's DIED covers monsters, traps
# and gods alike, so a god's wrath is read from the last step's words: its curse, its lightning, its minions
# (the monk's pantheon: the default character). Episodes recorded before `end` existed have none.
# The baselines a config is read against: {baseline: (measure, the configs it applies to by name prefix)}.
BASELINES = {"free_none": ("score", ("free_", "score_")), "score_extrinsic": ("score", ("free_", "score_")),
             **{f"{prefix}_task": ("success", (f"{prefix}_",)) for prefix in SPARSE}}
ENDS = ("killed", "starvation", "prayer", "other", "time limit", "success")
WRATH = ("Thou hast angered me", "bolt of lightning", "fry to a crisp", "disintegrat", "of Shan Lai Ching",
         "of Chih Sung-tzu", "of Huan Ti")


def run_command(run_dir, task, reward, coef, seed, steps, extra):
    """The oni_appo.py command for this run dir, or None when it is complete: its summary reached the steps,
    or it is committed (its episodes gzipped: oni_appo.py would start a plain episodes.jsonl beside them, and
    a new summary.json and messages.tsv)."""
    summary = os.path.join(run_dir, "summary.json")
    if os.path.exists(os.path.join(run_dir, "episodes.jsonl.gz")) or (
            os.path.exists(summary) and read_json(summary).get("env_steps", 0) >= steps):
        return None
    if os.path.exists(os.path.join(run_dir, "checkpoint.pt")):
        return [sys.executable, "oni_appo.py", "--resume", run_dir, "--total-env-steps", str(steps), *extra]
    command = [sys.executable, "oni_appo.py", "--task", task, "--reward-type", reward]
    if coef is not None:
        command += ["--extrinsic-coef", str(coef)]
    return command + ["--seed", str(seed), "--total-env-steps", str(steps), "--run-dir", run_dir, *extra]


def run_file(run_dir, name):
    """The path of run_dir's file name, or of its gzipped copy where only that is there: results/ keeps
    episodes.jsonl, messages.tsv and labels.jsonl gzipped, most of a run's bytes. Without either, the plain
    name: an error reading it names the file a run writes."""
    path = os.path.join(run_dir, name)
    return path + ".gz" if not os.path.exists(path) and os.path.exists(path + ".gz") else path


def open_text(path):  # A text file, read through gzip where its name ends in .gz (run_file).
    return gzip.open(path, "rt") if os.fspath(path).endswith(".gz") else open(path)


def read_json(path):  # A file this driver reads, or one `error:` line that names it.
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: cannot read {path}: {error}")


def in_use(run_dir):  # The pid line of the learner that holds run_dir (run_files.hold), else None.
    try:
        with open(os.path.join(run_dir, LOCK_FILE)) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        with open(os.path.join(run_dir, LOCK_FILE)) as lock:
            return lock.read().strip() or "a learner"
    except OSError:
        pass
    return None


def execute(command, log):
    """Runs command in ROOT, output to log; returns its exit code. Not subprocess.run: on Ctrl-C (which the
    run gets too) that kills the run at once, while oni_appo.py needs a moment to save its checkpoint. The
    child gets SIGTERM if this driver dies (kill -9 too): it saves and stops, and a restart resumes it."""
    with subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                          preexec_fn=functools.partial(llm_server.die_with_parent, os.getpid())) as process:
        try:
            return process.wait()
        except KeyboardInterrupt:
            process.wait()
            raise


def set_aside(run_dir, names):
    """Moves names out of run_dir into run_dir/earlier_N (the first N free): what one earlier start left stays
    together, and apart from the next start's (tensorboard shows it as a run of its own)."""
    n = 1
    while os.path.exists(os.path.join(run_dir, f"earlier_{n}")):
        n += 1
    os.makedirs(os.path.join(run_dir, f"earlier_{n}"))
    for name in names:
        os.replace(os.path.join(run_dir, name), os.path.join(run_dir, f"earlier_{n}", name))


def run_all(args, extra):
    """Runs every config x seed in turn; returns the number of failed runs."""
    times_path = os.path.join(args.out, "wall_times.json")
    wall_times = read_json(times_path) if os.path.exists(times_path) else {}
    failures = 0
    for name in args.configs:
        task, reward, coef, steps = CONFIGS[name]
        steps = args.steps or steps
        for seed in args.seeds:
            run_dir = os.path.abspath(os.path.join(args.out, name, f"seed{seed}"))  # oni_appo runs in ROOT
            command = run_command(run_dir, task, reward, coef, seed, steps, extra)
            if command is None:
                print(f"{name}/seed{seed}: complete ({steps:,} steps, or committed), skipped", flush=True)
                failures += evaluate_after(run_dir, args.eval_after)
                continue
            os.makedirs(run_dir, exist_ok=True)
            if holder := in_use(run_dir):  # A learner of an earlier driver still saving: not to be moved.
                failures += 1
                print(f"error: {name}/seed{seed}: {run_dir} is in use by another learner ({holder})",
                      flush=True)
                continue
            # A start killed before its first checkpoint left logs that oni_appo.py refuses to append to, and
            # an evaluation is of a policy that now trains on: both are set aside.
            fresh = "--resume" not in command
            stale = sorted(name for name in os.listdir(run_dir) if name == "eval.json" or fresh and (
                name in ("episodes.jsonl", "labels.jsonl") or name.startswith("events.out.tfevents")))
            if stale:
                set_aside(run_dir, stale)
            print(f"{name}/seed{seed}: start {' '.join(command[1:])}", flush=True)
            start = time.time()
            with open(os.path.join(run_dir, "console.log"), "a") as log:
                rc = execute(command, log)
            seconds = time.time() - start
            key = f"{name}/seed{seed}"  # Summed over resumes.
            wall_times[key] = wall_times.get(key, 0.0) + seconds
            rewrite(times_path, [json.dumps(wall_times, indent=1)])
            if rc != 0:
                failures += 1
                print(f"error: {name}/seed{seed} exited with {rc} after {seconds:,.0f} s; "
                      f"see {run_dir}/console.log",
                      flush=True)
            else:
                print(f"{name}/seed{seed}: done in {seconds:,.0f} s", flush=True)
                if run_command(run_dir, task, reward, coef, seed, steps, extra) is None:  # Not stopped.
                    failures += evaluate_after(run_dir, args.eval_after)
    return failures


def evaluate_after(run_dir, episodes):
    """--eval-after: a complete run evaluated at once, while its checkpoint is here (checkpoints are not
    committed). The seed's runs evaluated already are passed along, so that its random actions are played
    once (see evaluate); not one in progress, which a resume leaves with its random actions and without its
    policy's evaluation. Returns the number of evaluations that failed, each said."""
    if not episodes or not os.path.exists(os.path.join(run_dir, "checkpoint.pt")):
        return 0
    seed = glob.glob(os.path.join(os.path.dirname(os.path.dirname(run_dir)), "*", os.path.basename(run_dir)))
    table, failures = evaluate([d for d in seed if d == run_dir or all(os.path.exists(os.path.join(d, name))
                                for name in ("eval.json", "eval_random.json", "checkpoint.pt"))], episodes)
    print(table, flush=True)
    for failure in failures:
        print(f"error: {failure}", flush=True)
    return len(failures)


def load_episodes(path):
    """A file's episodes; older files lack env_steps (-> cumulative steps). A missing intrinsic field or xlvl
    is NaN, left out of means: older files lack them, and a run's last episodes, which end in steps no update
    trained on, have no intrinsic totals."""
    with open_text(path) as f:
        episodes = [json.loads(line) for line in f if line.strip()]
    cumulative = np.cumsum([e["steps"] for e in episodes])
    for e, steps in zip(episodes, cumulative):
        e.setdefault("env_steps", int(steps))
        for key in ("intrinsic_return", "intrinsic_rewarded_fraction", "xlvl"):
            e.setdefault(key, float("nan"))
    return sorted(episodes, key=lambda e: e["env_steps"])  # Written as the learner's totals come.


def seed_dirs(config_dir):  # Its seed*/ run dirs that hold episodes (plain or gzipped: run_file).
    return sorted(d for d in glob.glob(os.path.join(config_dir, "seed*"))
                  if os.path.exists(run_file(d, "episodes.jsonl")))


def run_dirs(dirs):
    """{config name: its seeds' run dirs} of config dirs (seed*/episodes.jsonl) or run dirs."""
    runs = {}
    for d in dirs:
        d = os.path.normpath(d)
        seeds = [d] if os.path.exists(run_file(d, "episodes.jsonl")) else seed_dirs(d)
        if not seeds:
            raise SystemExit(f"error: no episodes.jsonl(.gz) in {d} nor in {d}/seed*/")
        runs[os.path.basename(d) if os.path.basename(d) not in runs else d] = seeds
    return runs


def load_runs(dirs):
    """{config name: [episodes of each seed]} from config dirs (seed*/episodes.jsonl) or run dirs."""
    return {name: [load_episodes(run_file(d, "episodes.jsonl")) for d in seeds]
            for name, seeds in run_dirs(dirs).items()}


def load_evaluations(dirs, under=""):
    """{config name: [evaluated episodes of each seed]} for the configs whose every seed has its eval.json
    (`under`: in that folder of each run, e.g. earlier_1 for the evaluation before a resume)."""
    paths = {name: [os.path.join(d, under, "eval.json") for d in seeds]
             for name, seeds in run_dirs(dirs).items()}
    return {name: [read_json(p)["episodes"] for p in files] for name, files in paths.items()
            if all(os.path.exists(p) for p in files)}


def without_success(run_dir):
    """Whether the run's task has no success to count (the Score task, as its summary.json's last session
    says): its success columns print "—", not a zero that reads as measured."""
    path = os.path.join(run_dir, "summary.json")
    sessions = read_json(path).get("sessions", []) if os.path.exists(path) else []
    return bool(sessions) and sessions[-1].get("flags", {}).get("task", "").startswith("NetHackScore")


def commits(run_dir):
    """The commits of a run's sessions as its summary.json records them, in order, each once (short; "+" where
    the code had uncommitted changes); "not recorded" for a run before the record or with no summary yet."""
    path = os.path.join(run_dir, "summary.json")
    sessions = read_json(path).get("sessions", []) if os.path.exists(path) else []
    named = [s["commit"][:7] + "+" * (s["uncommitted_changes"] is True) for s in sessions]
    return " ".join(dict.fromkeys(named)) or "not recorded"


def end_kind(episode):
    """One of ENDS for an episode with a recorded end, else None."""
    end = episode.get("end")
    if end is None or end in ("time limit", "success"):
        return end
    if end == "died":
        return "prayer" if any(w in episode.get("end_text", "") for w in WRATH) else "killed"
    return "starvation" if end == "starving" else "other"


def mean(values):
    """The mean of the values that are not NaN; NaN if none is."""
    values = np.asarray(values, dtype=float)
    return values[~np.isnan(values)].mean() if (~np.isnan(values)).any() else float("nan")


def across_seeds(values):
    """'mean ± std' over seeds (std with numpy's ddof=0), or the value alone for one seed."""
    return f"{np.mean(values):.2f}" + (f" ± {np.std(values):.2f}" if len(values) > 1 else "")


def best_window(values):
    """The highest mean over WINDOW consecutive values (over all of them when there are fewer)."""
    n = min(WINDOW, len(values))
    return np.convolve(values, np.ones(n) / n, "valid").max()


def per_seed(seeds, value, window=WINDOW):
    """'mean ± std' over seeds of value(a seed's last `window` episodes)."""
    return across_seeds([value(s[-window:]) for s in seeds])


def share(episodes, key, level):
    """The share of the episodes whose `key` reached `level`, in percent; NaN where one lacks it."""
    values = np.array([e.get(key, np.nan) for e in episodes], dtype=float)
    return float("nan") if np.isnan(values).any() else 100 * np.mean(values >= level)


def table(runs, made, unsuccessful=frozenset(), span="whole run"):
    """Markdown tables, means over each seed's last 100 episodes, then 'mean ± std' across seeds: per episode
    and per step, with the commits that made each seed (made: {config: [commits() of each seed]}, "/" between
    seeds); what the agents reached (depth and experience level, shares reaching 2 and 3); and how the
    episodes of the `span` given (the whole run) ended, in percent (from the recorded end; "not recorded" for
    runs from before it), with their successes per million steps ("—" for the configs in `unsuccessful`,
    whose task has no success)."""
    score = lambda s: [e["score"] for e in s]
    columns = {"score": per_episode("score"), "median score": lambda s: np.median(score(s)),
               "score / 1,000 steps": per_step("score", 1e3), "kills / 1,000 steps": per_step("kills", 1e3),
               "steps": per_episode("steps"), "success %": per_episode("success", 100)}
    reached = {"depth": per_episode("depth"),
               "Dlvl ≥ 2 %": lambda s: share(s, "depth", 2),
               "Dlvl ≥ 3 %": lambda s: share(s, "depth", 3),
               "experience level": per_episode("xlvl"),
               "XL ≥ 2 %": lambda s: share(s, "xlvl", 2),
               "XL ≥ 3 %": lambda s: share(s, "xlvl", 3),
               **{key: per_episode(key) for key in ("kills", "explored", "intrinsic_return",
                                                    "intrinsic_rewarded_fraction")}}
    title = lambda c: f"{TITLES.get(c, c)} (last {WINDOW})"
    first = ["| config | seeds | env steps | " + " | ".join(map(title, columns))
             + f" | score (first {WINDOW}) | score (best {WINDOW}) | commit |",
             "|---" * (len(columns) + 6) + "|"]
    second = ["| config | " + " | ".join(map(title, reached)) + " |",
              "|---" * (len(reached) + 1) + "|"]
    third = [f"| config | episodes ({span}) | " + " | ".join(f"{end} %" for end in ENDS)
             + " | successes / 1M steps |", "|---" * (len(ENDS) + 3) + "|"]
    for name, seeds in runs.items():
        env_steps = min(s[-1]["env_steps"] for s in seeds)
        none = name in unsuccessful
        first.append(f"| {name} | {len(seeds)} | {env_steps:,} | "
                     + " | ".join("—" if none and c.startswith("success") else per_seed(seeds, f)
                                  for c, f in columns.items())
                     + f" | {across_seeds([np.mean(score(s[:WINDOW])) for s in seeds])}"
                     + f" | {across_seeds([best_window(score(s)) for s in seeds])}"
                     + f" | {' / '.join(made[name])} |")
        second.append(f"| {name} | " + " | ".join(per_seed(seeds, f) for f in reached.values()) + " |")
        ends = [[end_kind(e) for e in s] for s in seeds]
        cells = (["not recorded"] * len(ENDS) if any(None in kinds for kinds in ends) else
                 [across_seeds([100 * kinds.count(end) / len(kinds) for kinds in ends]) for end in ENDS])
        # Per step, not per episode: an agent that lives longer has fewer episodes to succeed in.
        successes = "—" if none else across_seeds([per_step("success", 1e6)(s) for s in seeds])
        third.append(f"| {name} | {across_seeds([len(s) for s in seeds])} | " + " | ".join(cells)
                     + f" | {successes} |")
    return "\n\n".join("\n".join(t) for t in (first, second, third)) + "\n"


def comparisons(runs, window=WINDOW):
    """Markdown table: each config's mean over its last `window` episodes (None: all, as for the evaluated
    games) against the baselines of its task (BASELINES: the score against the control and the score-trained
    agent; a sparse task's success rate against its own task reward alone; a baseline is not compared back
    with the control), read by the rule the results are read with:
    "beats" only where the gap of the means exceeds the larger sample std over seeds (ddof 1: the main table's
    ± is ddof 0, which understates the spread of 2-3 seeds), "below" where it falls short by more than it,
    else "within the std"; the seeds overlap unless every seed of one lies above every seed of the other.
    With one seed on one side or both there is no std: no claim, "—"."""
    lines = ["| config | against | measure | gap of means | larger std (ddof 1) | reading | seeds overlap |",
             "|---" * 7 + "|"]
    for reference, (measure, prefix) in BASELINES.items():
        scale, label = (100, "success %") if measure == "success" else (1, measure)  # As in the tables.
        last = (lambda s: s) if window is None else (lambda s: s[-window:])
        value = {name: [scale * np.mean([e.get(measure, np.nan) for e in last(s)]) for s in seeds]
                 for name, seeds in runs.items() if name.startswith(prefix)}
        for name, a in value.items():
            if reference not in value or name in (reference, "free_none"):  # the control: not compared back
                continue
            b, gap = value[reference], np.mean(value[name]) - np.mean(value[reference])
            if min(len(a), len(b)) < 2:
                lines.append(f"| {name} | {reference} | {label} | {gap:+.2f} | — | no claim (one seed) "
                             "| — |")
                continue
            std = max(np.std(a, ddof=1), np.std(b, ddof=1))
            reading = "beats" if gap > std else "below" if -gap > std else "within the std"
            overlap = "no" if min(a) > max(b) or max(a) < min(b) else "yes"
            lines.append(f"| {name} | {reference} | {label} | {gap:+.2f} | {std:.2f} | {reading} "
                         f"| {overlap} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def binned(seeds, value):
    """Bin centers and a [seed, bin] array of value(the episodes that ended in a bin), NaN where none did."""
    edges = np.linspace(0, max(e["env_steps"] for s in seeds for e in s), BINS + 1)
    values = np.full((len(seeds), BINS), np.nan)
    for i, s in enumerate(seeds):
        ends = [e["env_steps"] for e in s]
        which = np.clip(np.searchsorted(edges, ends, side="right") - 1, 0, BINS - 1)
        for b in np.unique(which):
            values[i, b] = value([e for e, w in zip(s, which) if w == b])
    return (edges[:-1] + edges[1:]) / 2, values


def panels(runs, unsuccessful=frozenset()):
    """{title: {config: its seeds}} of the figure: the success panels only where some episode succeeded,
    without the configs in `unsuccessful` (whose task has no success: no line of zeros read as measured)."""
    succeeded = any(e.get("success") for seeds in runs.values() for episodes in seeds for e in episodes)
    return {title: {name: seeds for name, seeds in runs.items()
                    if title not in SUCCESS_PANELS or name not in unsuccessful}
            for title in PANELS if succeeded or title not in SUCCESS_PANELS}


def plot(runs, path, unsuccessful=frozenset()):
    """One PNG: a panel per metric, per config the mean over seeds and their min-max shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = panels(runs, unsuccessful)
    columns = (len(shown) + 2) // 2  # Two rows, the legend in the last cell.
    fig, axes = plt.subplots(2, columns, figsize=(4.75 * columns, 8.5))
    for ax in axes.flat[len(shown):]:
        ax.axis("off")
    for ax, (title, configs) in zip(axes.flat, shown.items()):
        for k, (name, seeds) in enumerate(runs.items()):
            if name not in configs:
                continue
            x, values = binned(seeds, PANELS[title])
            color, label = f"C{k}", f"{name} ({len(seeds)} seed{'s' * (len(seeds) > 1)})"
            with warnings.catch_warnings():  # bins no seed reached are NaN: gaps in the line
                warnings.simplefilter("ignore", RuntimeWarning)
                ax.plot(x, np.nanmean(values, axis=0), color=color, label=label)
                if len(seeds) > 1:
                    ax.fill_between(x, np.nanmin(values, axis=0), np.nanmax(values, axis=0), color=color,
                                    alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel("env steps")
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    axes.flat[-1].legend(handles, labels, loc="center",
                         title=f"mean over seeds (min-max shaded), {BINS} bins")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(dirs, out, figure, until=None, eval_from=None, since=None):
    """Writes the figure and OUT/curves.md, prints the table. With `until` or `since` (steps), only the tables
    of the episodes that ended by `until` and after `since`, in OUT/curves_since_<M>M_until_<M>M.md (M: the
    steps in millions; the parts given); no figure, and with `until` no evaluation but those of each run's
    `eval_from` folder (eval.json is of its last policy)."""
    os.makedirs(out, exist_ok=True)
    runs, markdown, span = load_runs(dirs), os.path.join(out, "curves.md"), None
    if until is not None or since is not None:
        runs = {name: [[e for e in s if (since is None or e["env_steps"] > since)
                        and (until is None or e["env_steps"] <= until)] for s in seeds]
                for name, seeds in runs.items()}
        # In millions, exact: 1.5e6 -> 1.5, 50 -> 0.00005.
        millions = lambda n: np.format_float_positional(n / 1e6, trim="-")
        given = [(word, n) for word, n in (("since", since), ("until", until)) if n is not None]
        parts = [f"{word}_{millions(n)}M" for word, n in given]
        span = ", ".join(f"{'after' if word == 'since' else 'by'} {n:,} steps" for word, n in given)
        if not all(s for seeds in runs.values() for s in seeds):
            raise SystemExit(f"error: a run of {', '.join(runs)} has no episode {span}")
        markdown = os.path.join(out, f"curves_{'_'.join(parts)}.md")
    figure = figure or os.path.join(out, "curves.png")
    seeds_of = run_dirs(dirs)
    made = {name: [commits(d) for d in seeds] for name, seeds in seeds_of.items()}
    unsuccessful = {name for name, seeds in seeds_of.items() if all(map(without_success, seeds))}
    if span is None:
        plot(runs, figure, unsuccessful)
    if eval_from and (missing := [d for seeds in seeds_of.values() for d in seeds
                                  if not os.path.exists(os.path.join(d, eval_from, "eval.json"))]):
        raise SystemExit(f"error: no {eval_from}/eval.json in {', '.join(missing)}")
    evaluations = load_evaluations(dirs, eval_from or "") if until is None or eval_from else {}
    against, evaluated = comparisons(runs), comparisons(evaluations, window=None)
    games = "/".join(map(str, sorted({len(g) for seeds in evaluations.values() for g in seeds})))
    evaluated_from = (f"; the evaluated games: each run's {eval_from}/eval.json, taken to be of the policy "
                      f"at {until:,} steps (an eval.json records no step)") if eval_from else ""
    text = "" if span is None else (f"The runs' episodes that ended {span} (the commits: those of the "
                                    f"whole run){evaluated_from}.\n\n")
    text += table(runs, made, unsuccessful, span or "whole run")
    text += f"\nThe last {WINDOW} episodes of training against the baselines:\n\n{against}" if against else ""
    if evaluated:
        text += f"\nThe evaluated games ({games} a seed) against the baselines:\n\n{evaluated}"
    with open(markdown, "w") as f:
        f.write(text)
    print(text + (f"figure: {figure}; " if span is None else "") + f"table: {markdown}")


def random_games(run_dir):
    """What evaluate.py --random plays for this run: the games and the actions come from the run's task, seed
    and episode limit, not from its policy (tests/test_evaluate.py), so the runs that share them share one
    evaluation.
    None without a checkpoint."""
    path = os.path.join(run_dir, "checkpoint.pt")
    if not os.path.exists(path):
        return None
    from oni_appo import read_checkpoint  # only here: plotting and training need no torch in this process

    args = read_checkpoint(path)["args"]  # One that needs pickle is refused, as evaluate.py refuses it.
    return args["task"], args["seed"], args.get("max_episode_steps")


def evaluate(dirs, episodes, record=False):
    """`evaluate.py` on each run's final checkpoint and `--random` on the same episodes (their seeds come
    from the run's seed; done once for the runs of one task and seed), unless done (with record: and their
    first episode's replay); returns one markdown table of the means +- std over episodes, and a line for each
    evaluate.py that failed (its output is in RUN/eval.log)."""
    rows = ["| run | policy | episodes | score | kills | depth | explored | steps | median score "
            "| score / 1,000 steps | success % | Dlvl ≥ 2 % | experience level | XL ≥ 2 % | "
            + " | ".join(f"{end} %" for end in ENDS) + " |", "|---" * (14 + len(ENDS)) + "|"]
    failures = []
    run_dirs = sorted(d for path in dirs for d in glob.glob(os.path.join(path, "seed*")) or [path])
    shared = {}  # (task, seed, episode limit) -> an eval_random.json of those games (see random_games)
    for d in run_dirs:  # those played already, first: a run sorted before them must not play them again
        path = os.path.join(d, "eval_random.json")
        if not record and os.path.exists(path) and len(read_json(path)["episodes"]) == episodes:
            shared.setdefault(random_games(d), path)
    shared.pop(None, None)  # a run without its checkpoint cannot say which games it played
    for run_dir in run_dirs:
        for random, name in ((False, "eval.json"), (True, "eval_random.json")):
            flags = ["--random"] * random
            replay = os.path.join(run_dir, "replay_random" if random else "replay")
            if record:
                flags += ["--record", replay, "--record-episodes", "1"]
            games = random and not record and random_games(run_dir)
            if games in shared and not os.path.exists(os.path.join(run_dir, name)):
                shutil.copy(shared[games], os.path.join(run_dir, name))  # It names the checkpoint it played.
            if not os.path.exists(os.path.join(run_dir, name)) or (
                    record and not os.path.exists(os.path.join(replay, "episode0.html"))):
                with open(os.path.join(run_dir, "eval.log"), "a") as log:
                    command = [sys.executable, "evaluate.py", run_dir, "--episodes", str(episodes), *flags]
                    rc = execute(command, log)
                if rc:
                    with open(os.path.join(run_dir, "eval.log")) as log:
                        failures.append(f"{' '.join(['evaluate.py', *flags])} on {run_dir} exited with {rc}: "
                                        f"{(log.read().strip().splitlines() or [''])[-1]}")
            if os.path.exists(os.path.join(run_dir, name)):
                results = read_json(os.path.join(run_dir, name))["episodes"]
                if games and len(results) == episodes:
                    shared.setdefault(games, os.path.join(run_dir, name))
                cells = [f"{np.mean([e[k] for e in results]):.2f} ± {np.std([e[k] for e in results]):.2f}"
                         for k in ("score", "kills", "depth", "explored", "steps")]
                kinds = [end_kind(e) for e in results]
                cells += [f"{np.median([e['score'] for e in results]):.1f}",
                          f"{1000 * sum(e['score'] for e in results) / sum(e['steps'] for e in results):.1f}",
                          "—" if without_success(run_dir) else
                          f"{100 * mean([e.get('success', np.nan) for e in results]):.1f}",
                          f"{share(results, 'depth', 2):.1f}",
                          f"{mean([e.get('xlvl', np.nan) for e in results]):.2f}",
                          f"{share(results, 'xlvl', 2):.1f}"]
                cells += (["not recorded"] * len(ENDS) if None in kinds else
                          [f"{100 * kinds.count(end) / len(kinds):.1f}" for end in ENDS])
                policy = "random actions" if random else "trained"
                rows.append(f"| {os.path.relpath(run_dir, ROOT)} | {policy} | "
                            f"{len(results)} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n", failures


def steps_count(text):  # A count of env steps as the flags take it: 2e9, 1000000.
    try:
        steps = int(float(text))
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a number of steps: {text!r}") from None
    if steps < 0:
        raise argparse.ArgumentTypeError(f"not a number of steps: {text!r} is below 0")
    return steps


def run_folder(text):  # A folder's name inside each run dir, as learning_curves names them: earlier_1.
    if text in ("", ".", "..") or os.path.basename(text) != text:
        raise argparse.ArgumentTypeError(f"not the name of a folder inside a run: {text!r}")
    return text


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS)[:5])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--steps", type=steps_count, default=None,
                        help="env steps of every config (accepts 2e9; default: each config's own)")
    parser.add_argument("--num-workers", type=int, default=None, help="passed to oni_appo.py")
    parser.add_argument("--out", default="runs/curves")
    parser.add_argument("--figure", default=None, help="PNG path (default OUT/curves.png)")
    parser.add_argument("--plot", nargs="+", metavar="DIR", help="only plot these config or run dirs")
    parser.add_argument("--until", type=steps_count, default=None, metavar="STEPS",
                        help="with --plot: only the tables of the episodes that ended by STEPS (accepts 1e6) "
                        "into OUT/curves_until_<STEPS in millions>M.md, e.g. a 2M-step run at 1M (with "
                        "--since: curves_since_<..>M_until_<..>M.md)")
    parser.add_argument("--since", type=steps_count, default=None, metavar="STEPS",
                        help="with --plot: only the tables of the episodes that ended after STEPS, e.g. a "
                        "resumed run's second million, with the final evaluations, into OUT/curves_since_"
                        "<STEPS in millions>M.md (with --until: those ended between, no evaluations)")
    parser.add_argument("--eval-from", type=run_folder, default=None, metavar="FOLDER",
                        help="with --until: the evaluations in each run's FOLDER/eval.json, e.g. earlier_1 "
                        "(the evaluation of the policy a resume continued; its step is not checked)")
    parser.add_argument("--eval", nargs="+", metavar="DIR", help="only evaluate these config or run dirs "
                        "(trained policy and random actions, --eval-episodes each) into OUT/eval.md")
    parser.add_argument("--eval-episodes", type=int, default=20)
    parser.add_argument("--eval-after", type=int, default=0, metavar="EPISODES",
                        help="evaluate each run over this "
                        "many episodes once it is complete (eval.json, eval_random.json in its dir; 0: not)")
    parser.add_argument("--record", action="store_true",
                        help="with --eval: also the replay of each run's first "
                        "episode, trained and random, in RUN/replay and RUN/replay_random")
    args = parser.parse_args(argv)
    for flag, value in (("--until", args.until), ("--since", args.since)):
        if value is not None and (not args.plot or args.figure):
            parser.error(f"{flag} goes with --plot, and makes no figure")
    if args.eval_from and args.until is None:
        parser.error("--eval-from goes with --until")
    if args.since is not None and args.until is not None and args.since >= args.until:
        parser.error("--since goes below --until")
    if args.plot or args.eval:
        if args.plot:
            report(args.plot, args.out, args.figure, args.until, args.eval_from, args.since)
        if args.eval:  # The table at the end, whole: a failure halfway keeps the last one.
            os.makedirs(args.out, exist_ok=True)
            table, failures = evaluate(args.eval, args.eval_episodes, args.record)
            rewrite(os.path.join(args.out, "eval.md"), [table])
            print(table)
            for failure in failures:
                print(f"error: {failure}", file=sys.stderr)
            return 1 if failures else 0
        return 0
    if args.num_workers is not None:
        extra = ["--num-workers", str(args.num_workers)] + extra
    failures = run_all(args, extra)
    dirs = [os.path.join(args.out, n) for n in args.configs if seed_dirs(os.path.join(args.out, n))]
    if dirs:
        report(dirs, args.out, args.figure)
    if failures:
        print(f"error: {failures} run(s) failed", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
