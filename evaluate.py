"""Evaluate a checkpoint of oni_appo.py: play episodes with its policy and report their statistics.

    python evaluate.py runs/NAME --episodes 20            # the trained policy -> runs/NAME/eval.json
    python evaluate.py runs/NAME --episodes 20 --random   # the same games, uniformly random actions
    python evaluate.py runs/NAME --episodes 3 --record runs/NAME/replay   # and each episode's replay

The games come from the run's seed but from a stream no training run plays, so a policy and the
random baseline are compared on the same episodes. Actions are sampled, as in training.
(Its own file, as CleanRL keeps its evals apart from the training scripts.)

--record DIR writes, per episode, NLE's own ttyrec (episodeK.ttyrec3.bz2, for any ttyrec player) and
episodeK.html: a self-contained page (the template replay.html, no server, no network) with the terminal
of every step, its action, message, the message's count N in the episode, its LLM label, R and the paid
R/N^beta under the checkpoint's reward model (the learner's own code: what it would pay), and the env reward.
K numbers the episodes in the order they start, as eval.json lists them.
"""
import collections
import contextlib
import glob
import json
import os
import shutil
import tempfile
from dataclasses import dataclass

import numpy as np
import torch
import tyro
from nle import nethack

import annotator
import envs
import reward_models
from oni_appo import OBS_FIELDS, Agent, fail, load_checkpoint, pick_device


@dataclass
class Args:
    checkpoint: tyro.conf.Positional[str]
    """a checkpoint file of oni_appo.py or its run dir"""
    episodes: int = 10
    """episodes to play (16 at a time)"""
    random: bool = False
    """play the same episodes with uniformly random actions instead (a baseline)"""
    device: str = "auto"
    """torch device: auto (cuda if there is one), cpu, cuda, cuda:1..."""
    record: str | None = None
    """write each episode's replay here: NLE's ttyrec and an HTML page"""
    record_episodes: int | None = None
    """with --record: only the first this many episodes (default: all)"""


TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "replay.html")
TTY_KEYS = ("tty_chars", "tty_colors")  # the terminal, asked of NLE only when recording (it slows every step)
BLANK = np.stack([np.full(24 * 80, ord(" "), np.uint8), np.zeros(24 * 80, np.uint8)])  # chars, colours
ACTION_NAMES = [f"{a.name} {chr(a)!r}" for a in envs.ACTIONS]  # with the key: N 'k' and the far N 'K' differ
TTYREC = f".ttyrec{nethack.TTYREC_VERSION}.bz2"  # NLE's own suffix
COLOUR_DIGITS = bytes.maketrans(bytes(range(16)), b"0123456789abcdef")
MERGE_GAP = 4  # changed cells fewer than this apart are one run: a run's own cost is ~10 characters


def reward_model(path, checkpoint, saved, device) -> reward_models.IntrinsicReward:
    """The run's reward model as the checkpoint holds it, built as oni_appo.py's --resume does."""
    intrinsic = reward_models.IntrinsicReward(saved, device)
    labels = os.path.join(os.path.dirname(path), annotator.LABELS_FILE)
    if os.path.exists(labels):
        intrinsic.add_labels(annotator.read_labels(labels))
    intrinsic.load_state_dict(checkpoint.get("intrinsic", {}))
    return intrinsic


def changed_runs(previous, screen) -> list:
    """The cells of screen ([chars, colours] x 1920) that differ from previous, as runs [first cell, chars,
    colours in hex digits]: a 5,000-step page stays small, as a step changes a few cells."""
    changed = np.flatnonzero((previous != screen).any(axis=0))
    if not len(changed):
        return []
    cuts = np.flatnonzero(np.diff(changed) >= MERGE_GAP)
    starts, ends = changed[np.r_[0, cuts + 1]], changed[np.r_[cuts, len(changed) - 1]] + 1
    return [[int(a), screen[0, a:b].tobytes().decode("latin-1"),
             screen[1, a:b].tobytes().translate(COLOUR_DIGITS).decode()]
            for a, b in zip(starts, ends)]


def record_step(episode, obs, action, reward, terminated, info):
    """One step into the episode's record: its screen (as the cells changed), action, message, N, env
    reward."""
    screen = np.stack([obs["tty_chars"].ravel(), obs["tty_colors"].ravel().view(np.uint8)])
    episode["frames"].append(changed_runs(episode["screen"], screen))
    episode["screen"] = screen
    episode["steps"].append((action, obs["message"].copy(), info["message_count"], reward, terminated))


def rounded(values) -> list:
    """6 significant digits: the page shows 4 decimals, and 17-digit floats made a page 10% larger."""
    return [float(f"{v:.6g}") for v in values]


def write_replay(path, episode, intrinsic, title, summary):
    """episodeK.html: the template with the episode's data, its rewards from the learner's own code."""
    actions, messages, counts, env_rewards, terminal = zip(*episode["steps"])
    # one batch [T, B = 2]: the episode at its counts N, and again at N = 1, where what is paid is R itself
    counts = torch.tensor(counts)[:, None]
    reward, paid, _ = intrinsic.rewards(torch.tensor(env_rewards)[:, None].expand(-1, 2),
                                        torch.from_numpy(np.stack(messages))[:, None].expand(-1, 2, -1),
                                        torch.cat([counts, torch.ones_like(counts)], 1),
                                        torch.tensor(terminal)[:, None].expand(-1, 2))
    texts = [envs.message_bytes(m).decode("latin-1") for m in messages]
    distinct = {text: i for i, text in enumerate(dict.fromkeys(texts))}
    data = {"title": title, "summary": summary, "actions": ACTION_NAMES, "frames": episode["frames"],
            "action": list(actions), "messages": list(distinct),
            "labels": [intrinsic.piece.labels.get(t) for t in distinct],
            "message": [distinct[t] for t in texts], "count": counts[:, 0].tolist(),
            "value": rounded(paid[:, 1].tolist()), "paid": rounded(paid[:, 0].tolist()),
            "env_reward": rounded(env_rewards), "reward": rounded(reward[:, 0].tolist())}
    with open(TEMPLATE) as f:
        page = f.read().replace("REPLAY_DATA", json.dumps(data, separators=(",", ":")).replace("</", "<\\/"))
    with open(path, "w") as f:
        f.write(page)


def evaluate(args: Args) -> dict:
    if args.episodes < 1 or (args.record_episodes is not None and args.record_episodes < 1):
        fail("--episodes and --record-episodes must be at least 1")
    device = pick_device(args.device)
    agent = Agent().to(device).eval()
    path, checkpoint, saved = load_checkpoint(args.checkpoint, agent)
    out = os.path.join(os.path.dirname(path), "eval_random.json" if args.random else "eval.json")
    try:  # a run dir it cannot write to fails now, not after every episode is played
        tempfile.TemporaryFile(dir=os.path.dirname(out)).close()
    except OSError as error:
        fail(f"cannot write {out}: {error.strerror or error}")
    # the actions' own stream, on the CPU: the same actions each time, with or without --record (whose reward
    # model draws from torch's global one), and the same random ones with --random
    sampler = torch.Generator().manual_seed(saved.seed)
    n = min(args.episodes, 16)
    recorded, nle_kwargs = 0, [{} for _ in range(n)]
    if args.record is not None:
        recorded = min(args.record_episodes or args.episodes, args.episodes)
        try:  # every env its own savedir: NLE names a ttyrec by the process and the env's count of resets
            os.makedirs(args.record, exist_ok=True)
            savedir = tempfile.mkdtemp(prefix=".nle", dir=args.record)
        except OSError as error:
            fail(f"cannot write replays to {args.record}: {error.strerror or error}")
        # env i plays episodes i, i + n, ...: only the first `recorded` envs play one that is recorded
        nle_kwargs = [dict(extra_keys=TTY_KEYS, savedir=os.path.join(savedir, str(i)), save_ttyrec_every=1)
                      if i < recorded else {} for i in range(n)]
        intrinsic = reward_model(path, checkpoint, saved, device)
    first_seed = 10_000_019 * (saved.seed + 1)  # episodes no training run plays
    pool = [envs.make_env(saved.task, seed=first_seed + i, max_episode_steps=saved.max_episode_steps,
                          **nle_kwargs[i])
            for i in range(n)]
    for kwargs in nle_kwargs[:recorded]:
        # with a savedir NLE points the game's score files there as nle.PID.* (nle/env/base.py) but creates
        # only the xlogfile: without these two a death's last screen is "Cannot open file ... Is NetHack
        # installed correctly?"
        for name in ("record", "logfile"):
            open(os.path.join(kwargs["savedir"], f"nle.{os.getpid()}.{name}"), "a").close()
    obs = [env.reset()[0] for env in pool]
    h = torch.zeros(n, agent.gru.hidden_size, device=device)
    results, started, active = [], n, list(range(n))
    # the episodes (numbered as they start) of each env, as NLE numbers its ttyrecs
    played = [[i] for i in range(n)]
    records = [{"screen": BLANK, "frames": [], "steps": []} for _ in range(n)]
    with torch.no_grad():
        while active:
            batch = {k: torch.from_numpy(np.stack([obs[i][k] for i in active])).to(device)
                     for k in OBS_FIELDS}
            logits, _, h[active] = agent.step(batch, h[active])
            if args.random:
                logits = torch.zeros_like(logits)
            actions = torch.multinomial(logits.softmax(-1).cpu(), 1, generator=sampler)[:, 0].tolist()
            for i, action in zip(list(active), actions):
                obs[i], reward, terminated, truncated, info = pool[i].step(action)
                if played[i][-1] < recorded:
                    record_step(records[i], obs[i], action, reward, terminated, info)
                if terminated or truncated:
                    results.append((played[i][-1], info["episode"]))
                    if played[i][-1] < recorded:
                        write_replay(os.path.join(args.record, f"episode{played[i][-1]}.html"), records[i],
                                     intrinsic, f"{saved.task}, {'random actions' if args.random else path}, "
                                     f"episode {played[i][-1]}",
                                     ", ".join(f"{k} {v if isinstance(v, str) else format(v, 'g')}"
                                               for k, v in info["episode"].items()))
                        records[i] = {"screen": BLANK, "frames": [], "steps": []}
                    if started < args.episodes:
                        played[i].append(started)
                        started += 1
                        obs[i], h[i] = pool[i].reset()[0], 0.0
                    else:
                        active.remove(i)
    for env in pool:
        env.close()  # NLE closes an episode's ttyrec at the next reset or here
    results = [episode for _, episode in sorted(results, key=lambda r: r[0])]  # in the order they started
    summary = {k: float(np.mean([r[k] for r in results])) for k, v in results[0].items()
               if not isinstance(v, str)}
    print(f"{len(results)} episodes of {saved.task} with {'random actions' if args.random else path}:")
    for k, v in summary.items():
        print(f"  {k:10s} {v:12.2f} +- {np.std([r[k] for r in results]):.2f}")
    ends = dict(collections.Counter(r["end"] for r in results))  # how they ended
    print(f"  ends       {ends}")
    tmp = f"{out}.{os.getpid()}.tmp"
    try:  # whole or not at all: a reader never finds half of it
        with open(tmp, "w") as f:
            json.dump({"checkpoint": path, "random_actions": args.random, "episodes": results,
                       "mean": summary, "ends": ends}, f, indent=1)
        os.replace(tmp, out)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        fail(f"cannot write {out}: {error.strerror or error}")
    if recorded:
        for i, episodes in enumerate(played):
            for reset, k in enumerate(episodes):
                if k < recorded:
                    (ttyrec,) = glob.glob(os.path.join(savedir, str(i), f"nle.*.{reset}{TTYREC}"))
                    os.replace(ttyrec, os.path.join(args.record, f"episode{k}{TTYREC}"))
        shutil.rmtree(savedir)
        print(f"replays of episodes 0-{recorded - 1}: {args.record}/episodeK.html and episodeK{TTYREC}")
    return summary


if __name__ == "__main__":
    evaluate(tyro.cli(Args))
