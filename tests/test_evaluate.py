"""evaluate.py --record on short real episodes, one cut at its step limit and one ending in death: the page
holds each step's screen after that step and what the learner would pay (both recomputed here on the same game
replayed, by NLE and the project's reward code), opens in a real headless chromium, and NLE's ttyrec reader
reads NLE's recording, every step's screen among its frames. Recording changes no action."""
import dataclasses
import errno
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from nle import _pyconverter

import envs
import evaluate
import oni_appo
import reward_models

STEPS, SEED = 40, 3
HELPFUL = "Unknown command '^M'."  # MORE with no --More-- up: a random policy shows it often, with growing N
# the praying policy's death at SEED
SMITTEN = "Suddenly, a bolt of lightning strikes you!  You fry to a crisp!"


def save_run(run_dir, args, agent, labels=()):
    """A run dir as oni_appo.py leaves it: the checkpoint and the LLM's labels."""
    torch.save({"format": 1, "model": agent.state_dict(), "args": dataclasses.asdict(args), "counters": {}},
               run_dir / "checkpoint.pt")
    (run_dir / "labels.jsonl").write_text("".join(json.dumps({"caption": c, "label": 1}) + "\n"
                                                  for c in labels))
    return str(run_dir)


def page_data(run_dir):
    page = open(run_dir / "replay" / "episode0.html").read()
    return json.loads(
        re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S).group(1))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A retrieval run with one label and an untrained policy; its first episode (of two) recorded."""
    run_dir = tmp_path_factory.mktemp("run")
    args = oni_appo.Args(reward_type="retrieval", extrinsic_coef=0.1, max_episode_steps=STEPS, seed=SEED)
    torch.manual_seed(0)
    evaluate.evaluate(evaluate.Args(save_run(run_dir, args, oni_appo.Agent(), [HELPFUL]), episodes=2,
                                    record=str(run_dir / "replay"), record_episodes=1, device="cpu"))
    return run_dir, args, page_data(run_dir)


@pytest.fixture(scope="module")
def died(tmp_path_factory):
    """A policy that only prays or answers y: its god strikes it down at step 24, a step the LLM labelled
    helpful."""
    run_dir = tmp_path_factory.mktemp("died")
    args = oni_appo.Args(reward_type="retrieval", extrinsic_coef=0.1, max_episode_steps=200, seed=SEED)
    agent = oni_appo.Agent()
    with torch.no_grad():
        agent.actor.weight.zero_()
        agent.actor.bias.fill_(-1e9)
        agent.actor.bias[[envs.ACTIONS.index(envs.nethack.Command.PRAY), envs.CONFIRM_ACTION]] = 0
    evaluate.evaluate(evaluate.Args(save_run(run_dir, args, agent, [SMITTEN]), episodes=1,
                                    record=str(run_dir / "replay"), device="cpu"))
    return run_dir, args, page_data(run_dir)


def replayed(args, data, labels):
    """The page's game played again by NLE with its actions (evaluate.py's first env's seed): each step's
    message, N, env reward, end, screen after it, and what the learner's reward code pays it."""
    env = envs.make_env(args.task, seed=10_000_019 * (SEED + 1), max_episode_steps=args.max_episode_steps,
                        extra_keys=evaluate.TTY_KEYS)
    env.reset()
    messages, counts, env_rewards, terminal, screens = [], [], [], [], []
    for action in data["action"]:
        obs, reward, terminated, truncated, info = env.step(action)
        messages.append(obs["message"].copy())
        counts.append(info["message_count"])
        env_rewards.append(reward)
        terminal.append(terminated)
        screens.append(np.stack([obs["tty_chars"], obs["tty_colors"].view(np.uint8)]))
    env.close()
    intrinsic = reward_models.IntrinsicReward(args, torch.device("cpu"))
    intrinsic.add_labels([{"caption": c, "label": 1} for c in labels])
    reward, paid, _ = intrinsic.rewards(torch.tensor(env_rewards)[:, None],
                                        torch.from_numpy(np.stack(messages))[:, None],
                                        torch.tensor(counts)[:, None], torch.tensor(terminal)[:, None])
    texts = [envs.message_bytes(m).decode("latin-1") for m in messages]
    return dict(texts=texts, counts=counts, env_rewards=env_rewards, terminated=terminated,
                truncated=truncated, screens=screens, reward=evaluate.rounded(reward[:, 0].tolist()),
                paid=evaluate.rounded(paid[:, 0].tolist()))


def assert_the_page_is_the_game(data, game):
    assert [data["messages"][i] for i in data["message"]] == game["texts"]
    assert data["count"] == game["counts"] and data["env_reward"] == game["env_rewards"]
    assert data["paid"] == game["paid"] and data["reward"] == game["reward"]
    for step, (page, nle) in enumerate(zip(screens(data), game["screens"])):  # the screen after each step
        assert (page == nle).all(), f"step {step + 1}'s screen is not NLE's after that step"


def screens(data):
    """Each step's [chars, colours] screen, undoing the page's encoding (runs of changed cells)."""
    screen, out = evaluate.BLANK.copy(), []
    for runs in data["frames"]:
        for at, text, colours in runs:
            screen[0, at:at + len(text)] = np.frombuffer(text.encode("latin-1"), np.uint8)
            screen[1, at:at + len(text)] = [int(c, 16) for c in colours]
        out.append(screen.reshape(2, 24, 80).copy())
    return out


def test_the_page_holds_every_step_and_what_the_learner_would_pay(recorded):
    run_dir, args, data = recorded
    assert sorted(os.listdir(run_dir / "replay")) == ["episode0.html", f"episode0{evaluate.TTYREC}"]
    assert len(data["frames"]) == len(data["action"]) == len(data["paid"]) == STEPS  # truncated at STEPS
    game = replayed(args, data, [HELPFUL])
    assert game["truncated"] and not game["terminated"]
    assert_the_page_is_the_game(data, game)
    helpful = [t for t, i in enumerate(data["message"]) if data["messages"][i] == HELPFUL]
    # the test means something
    assert len(helpful) >= 2 and data["paid"][helpful[1]] == 1 / 2 ** args.count_beta
    assert all(data["value"][t] == 1 for t in helpful) and sum(map(bool, data["value"])) == len(helpful)
    assert data["labels"][data["message"][helpful[0]]] == 1
    assert len(json.dumps(data)) < 400 * STEPS  # the frames are the changed cells, not 1,920 a step


def test_a_death_ends_on_the_games_last_screen_and_its_last_words(died):
    run_dir, args, data = died
    game = replayed(args, data, [SMITTEN])
    assert game["terminated"] and len(data["frames"]) == 24
    assert_the_page_is_the_game(data, game)
    last = screens(data)[-1][0].tobytes().decode("latin-1")
    # the score list, not NLE's error
    assert "Killed by the wrath of" in last and "Cannot open file" not in last
    assert data["messages"][data["message"][-1]] == SMITTEN and data["paid"][-1] == game["paid"][-1] == 1


def test_recording_changes_no_action(tmp_path):
    """A ranking model draws its layers from torch's global random stream: the actions have their own."""
    args = oni_appo.Args(reward_type="ranking", extrinsic_coef=0.1, max_episode_steps=STEPS, seed=SEED)
    torch.manual_seed(0)
    run_dir = save_run(tmp_path, args, oni_appo.Agent())
    played = []
    for record in (None, str(tmp_path / "replay")):
        evaluate.evaluate(evaluate.Args(run_dir, episodes=2, record=record, record_episodes=1, device="cpu"))
        played.append(json.load(open(tmp_path / "eval.json"))["episodes"])
    assert played[0] == played[1]


def test_random_actions_play_the_same_games_whatever_the_policy(tmp_path):
    """learning_curves.py --eval evaluates random actions once per task and seed and shares it among the
    runs."""
    args = oni_appo.Args(reward_type="none", max_episode_steps=STEPS, seed=SEED)
    played = []
    for name, init in (("a", 0), ("b", 1)):  # two different policies
        os.makedirs(tmp_path / name)
        torch.manual_seed(init)
        evaluate.evaluate(evaluate.Args(save_run(tmp_path / name, args, oni_appo.Agent()), episodes=3,
                                        random=True, device="cpu"))
        played.append(json.load(open(tmp_path / name / "eval_random.json"))["episodes"])
    assert played[0] == played[1] and len({json.dumps(e) for e in played[0]}) > 1


def test_nle_reads_its_ttyrec_and_every_step_screen_is_one_of_its_frames(recorded):
    run_dir, _, data = recorded
    converter = _pyconverter.Converter(24, 80, 3)
    converter.load_ttyrec(str(run_dir / "replay" / f"episode0{evaluate.TTYREC}"))
    n = 20 * STEPS
    chars, colours = np.zeros((n, 24, 80), np.uint8), np.zeros((n, 24, 80), np.int8)
    frames = n - converter.convert(chars, colours, np.zeros((n, 2), np.int16), np.zeros(n, np.int64),
                                   np.zeros(n, np.uint8), np.zeros(n, np.int32))
    assert STEPS < frames < n  # --More-- pages and the game's end are frames of their own
    j = 0
    for step, screen in enumerate(screens(data)):  # in order
        while j < frames and not ((chars[j] == screen[0]).all()
                                  and (colours[j].view(np.uint8) == screen[1]).all()):
            j += 1
        assert j < frames, f"step {step + 1}'s screen is not in the ttyrec"


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="no chromium: `apt-get install chromium` (Debian's package); CI (.ci/run) "
                           "installs it and runs this test, skipped there only if that install failed")
def test_the_page_opens_in_headless_chromium(recorded):
    run_dir, _, data = recorded
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          f"file://{run_dir}/replay/episode0.html"], capture_output=True, text=True,
                         timeout=60).stdout
    assert f'data-frames="{STEPS}"' in dom  # set by the page's script once it ran
    first = data["messages"][data["message"][0]] or "(none)"
    assert (re.search(r'<td id="message">(.*?)</td>', dom).group(1)
            == first.replace("&", "&amp;").replace("<", "&lt;"))
    assert re.search(r'<span id="at">(.*?)</span>', dom).group(1) == f"step 1 / {STEPS}"


def test_random_records_too_and_an_unwritable_dir_is_one_line(recorded, tmp_path):
    run_dir, _, _ = recorded
    evaluate.evaluate(evaluate.Args(str(run_dir), episodes=1, random=True, record=str(tmp_path / "r"),
                                    device="cpu"))
    assert sorted(os.listdir(tmp_path / "r")) == ["episode0.html", f"episode0{evaluate.TTYREC}"]
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match=r"^error: cannot write replays to .*/file/replay: "):
        evaluate.evaluate(evaluate.Args(str(run_dir), record=str(tmp_path / "file" / "replay"), device="cpu"))


def test_each_episode_starts_from_a_fresh_state_and_reports_its_own_statistics(tmp_path, monkeypatch):
    """evaluate.py plays 16 episodes at a time; the 17th and 18th start in envs 0 and 1 after their first
    games end. Each episode must start from a zero GRU state (one carried over would make it depend on the
    game before), and eval.json must list the games played, in the order they started, with their means."""
    args = oni_appo.Args(reward_type="none", max_episode_steps=6, seed=SEED)
    torch.manual_seed(0)
    run_dir = save_run(tmp_path, args, oni_appo.Agent())
    states, games, real_step, real_make = [], [], oni_appo.Agent.step, envs.make_env

    def step(self, obs, h):  # the states the policy acts from, call by call
        states.append(h.clone())
        return real_step(self, obs, h)

    class Recorded:  # a game's own sums, kept as NLE steps it
        def __init__(self, env):
            self.env = env

        def reset(self):
            games.append({"return": 0.0, "steps": 0})  # games start in the order of these calls
            self.game = games[-1]
            return self.env.reset()

        def step(self, action):
            obs, reward, terminated, truncated, info = self.env.step(action)
            self.game["return"] += reward
            self.game["steps"] += 1
            if terminated or truncated:
                self.game["explored"] = info["episode"]["explored"]
            return obs, reward, terminated, truncated, info

        def close(self):
            self.env.close()

    monkeypatch.setattr(oni_appo.Agent, "step", step)
    monkeypatch.setattr(envs, "make_env", lambda *a, **kw: Recorded(real_make(*a, **kw)))
    summary = evaluate.evaluate(evaluate.Args(run_dir, episodes=18, device="cpu"))
    saved = json.load(open(tmp_path / "eval.json"))
    assert [{k: e[k] for k in ("return", "steps", "explored")} for e in saved["episodes"]] == games
    assert len({json.dumps(g) for g in games}) > 9  # games told apart: one listed in another's place shows
    assert saved["mean"] == summary == {k: float(np.mean([e[k] for e in saved["episodes"]])) for k in summary}
    # every game ran its 6 steps: calls 0-5 act for the first 16 episodes, calls 6-11 for the 17th and 18th
    assert [len(h) for h in states] == [16] * 6 + [2] * 6 and all(g["steps"] == 6 for g in games)
    assert not states[0].any() and not states[6].any(), states[6].abs().sum()
    assert all(states[t].abs().sum(-1).min() > 0 for t in (1, 5, 7, 11))  # within an episode it goes on


class Played:
    """An env of envs.make_env that keeps the actions it is given, a list per env in `played`."""
    def __init__(self, env, played):
        self.env, self.actions = env, []
        played.append(self.actions)

    def reset(self):
        return self.env.reset()

    def step(self, action):
        self.actions.append(int(action))
        return self.env.step(action)

    def close(self):
        self.env.close()


def test_random_plays_uniform_draws_that_do_not_depend_on_the_policy(tmp_path, monkeypatch):
    """Every "x random" column rests on --random. Untrained policies are near uniform, so the test above
    passes with --random playing the policy: here two policies sure of different actions must play, with
    --random, the very actions a uniform policy draws from the same stream, and without it their own."""
    args, played, real_make = (oni_appo.Args(reward_type="none", max_episode_steps=STEPS, seed=SEED), [],
                               envs.make_env)
    monkeypatch.setattr(envs, "make_env", lambda *a, **kw: Played(real_make(*a, **kw), played))

    def actions(sure_of, random):  # one episode's actions of a policy sure of one action (None: uniform)
        agent, run_dir = oni_appo.Agent(), tmp_path / f"{sure_of}_{random}"
        with torch.no_grad():
            agent.actor.weight.zero_()
            agent.actor.bias.zero_()
            if sure_of is not None:
                agent.actor.bias[sure_of] = 50.0
        os.makedirs(run_dir)
        evaluate.evaluate(evaluate.Args(save_run(run_dir, args, agent), episodes=1, random=random,
                                        device="cpu"))
        return played[-1]
    uniform = actions(None, False)
    assert actions(3, True) == actions(7, True) == uniform and len(set(uniform)) > 5
    assert set(actions(3, False)) == {3}  # the policy itself plays its own


def read_only(path):
    """A command prefix that runs a command with path read-only: root ignores modes, so a read-only bind mount
    in a mount namespace of its own (skipped where there is none); other users get mode 0o555."""
    if os.geteuid():
        os.chmod(path, 0o555)
        return []
    prefix = ["unshare", "-rm", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(path)]
    if not shutil.which("unshare") or subprocess.run([*prefix, "true"], capture_output=True).returncode:
        pytest.skip("root, and no mount namespace to make a directory read-only in")
    return prefix


def test_an_unwritable_run_dir_is_one_line_before_any_episode_is_played(tmp_path):
    """evaluate.py played every episode, then failed to write eval.json with a traceback."""
    args = oni_appo.Args(reward_type="none", max_episode_steps=STEPS, seed=SEED)
    run_dir = save_run(tmp_path, args, oni_appo.Agent())
    done = subprocess.run([*read_only(tmp_path), sys.executable, os.path.abspath(evaluate.__file__), run_dir,
                           "--episodes", "1", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "episodes of" not in done.stdout, done.stdout  # none was played
    said = rf"error: cannot write {re.escape(run_dir)}/eval.json: (Read-only file system|Permission denied)\n"
    assert re.fullmatch(said, done.stderr), done.stderr


def test_eval_json_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A disk that fills while eval.json is written left it cut short, for a driver to read, and a
    traceback."""
    run_dir = save_run(tmp_path, oni_appo.Args(reward_type="none", max_episode_steps=6, seed=SEED),
                       oni_appo.Agent())
    (tmp_path / "eval.json").write_text('{"earlier": true}')

    def dump(value, f, **kwargs):  # half of it, then the disk is full
        f.write(json.dumps(value)[:100])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(evaluate.json, "dump", dump)
    with pytest.raises(SystemExit, match=rf"^error: cannot write .*/eval.json: {os.strerror(errno.ENOSPC)}$"):
        evaluate.evaluate(evaluate.Args(run_dir, episodes=1, device="cpu"))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pt", "eval.json", "labels.jsonl"]  # no partial file
    assert json.loads((tmp_path / "eval.json").read_text()) == {"earlier": True}
