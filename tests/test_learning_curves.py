"""learning_curves.py on a synthetic layout: table values by hand, the PNG, old files'
missing keys, and which oni_appo.py commands the resumable runner builds (no training)."""
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import learning_curves as lc


def write_episodes(path, episodes):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in episodes)


def synthetic(tmp_path):
    """cfg: 2 seeds, score = episode index (+10 on seed 2), new keys (seed 1's last 3 episodes without the
    intrinsic ones, which are left out of means, not counted as 0); run: a bare run dir of an old
    file (no env_steps, no intrinsic_return), 7 steps per episode, score = 2 x index, no summary."""
    for seed, offset in ((1, 0), (2, 10)):
        episodes = [{"return": 1.0, "steps": 10, "score": i + offset, "kills": 1, "depth": 1, "explored": 50,
                     "intrinsic_return": 0.5, "intrinsic_rewarded_fraction": 0.1, "xlvl": seed,
                     "env_steps": 1000 * (i + 1) + seed} for i in range(300)]
        for e in episodes[-3:] if seed == 1 else []:  # a run's last episodes, which no update trained on
            del e["intrinsic_return"], e["intrinsic_rewarded_fraction"]
        write_episodes(tmp_path / "cfg" / f"seed{seed}" / "episodes.jsonl", episodes)
    write_episodes(tmp_path / "run" / "episodes.jsonl", [
        {"return": 1.0, "steps": 7, "score": 2 * i, "kills": 0, "depth": 2, "explored": 30}
        for i in range(300)])
    # seed 1 resumed once at another commit, with uncommitted changes; seed 2 and run from before the record
    sessions = [{"commit": c * 40, "uncommitted_changes": dirty} for c, dirty in (("a", False), ("a", False),
                                                                                  ("b", True))]
    cfg = tmp_path / "cfg"
    (cfg / "seed1" / "summary.json").write_text(json.dumps({"env_steps": 1, "sessions": sessions}))
    (cfg / "seed2" / "summary.json").write_text(json.dumps({"env_steps": 2}))
    return [str(tmp_path / "cfg"), str(tmp_path / "run")]


def no_training(*args):
    raise AssertionError("a usage error let the call through to training")


def rows(text, table=0):
    """{config: {column: cell}} from one of the markdown file's tables (the first by default)."""
    first = text.strip().split("\n\n")[table]
    lines = [[c.strip() for c in line.strip("|").split("|")] for line in first.splitlines()]
    return {cells[0]: dict(zip(lines[0], cells)) for cells in lines[2:]}


def test_table_and_figure(tmp_path, capsys):
    dirs = synthetic(tmp_path)
    runs = lc.load_runs(dirs)
    assert list(runs) == ["cfg", "run"] and [len(s) for s in runs.values()] == [2, 1]
    assert runs["run"][0][-1]["env_steps"] == 2100 and math.isnan(runs["run"][0][0]["intrinsic_return"])

    out = tmp_path / "out"
    assert lc.main(["--plot", *dirs, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert open(out / "curves.md").read() in printed
    text = open(out / "curves.md").read()
    table, reached, ends = rows(text), rows(text, 1), rows(text, 2)
    cfg, run = {**table["cfg"], **reached["cfg"]}, {**table["run"], **reached["run"]}
    assert cfg["seeds"] == "2" and cfg["env steps"] == "300,001"  # min over seeds of the last env_steps
    assert cfg["score (last 100)"] == "254.50 ± 5.00"  # seeds: mean(200..299) = 249.5 and 259.5
    assert cfg["score (first 100)"] == "54.50 ± 5.00" and cfg["score (best 100)"] == "254.50 ± 5.00"
    assert (cfg["intrinsic_return (last 100)"] == "0.50 ± 0.00"
            and cfg["episode steps (last 100)"] == "10.00 ± 0.00")
    assert cfg["score / 1,000 steps (last 100)"] == "25450.00 ± 500.00"  # per step: 254.5 a 10-step episode
    assert (cfg["median score (last 100)"] == "254.50 ± 5.00"
            and cfg["kills / 1,000 steps (last 100)"] == "100.00 ± 0.00")
    assert (cfg["XL ≥ 2 % (last 100)"] == "50.00 ± 50.00"
            and cfg["Dlvl ≥ 2 % (last 100)"] == "0.00 ± 0.00")
    assert (run["Dlvl ≥ 2 % (last 100)"] == "100.00"
            and run["XL ≥ 2 % (last 100)"] == "nan")  # not recorded
    assert ends["cfg"]["killed %"] == "not recorded"  # no recorded end in these files
    assert cfg["experience level (last 100)"] == "1.50 ± 0.50"
    paid = "share of an episode's steps paid (last 100)"
    assert cfg[paid] == "0.10 ± 0.00"
    assert run["experience level (last 100)"] == "nan" and run[paid] == "nan"
    assert run["seeds"] == "1" and run["env steps"] == "2,100"  # 300 episodes x 7 steps, summed
    assert run["score (last 100)"] == "499.00" and run["score (first 100)"] == "99.00"
    assert run["depth (last 100)"] == "2.00" and run["intrinsic_return (last 100)"] == "nan"
    assert cfg["commit"] == "aaaaaaa bbbbbbb+ / not recorded" and run["commit"] == "not recorded"

    png = (out / "curves.png").read_bytes()
    assert len(png) > 1000 and png[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_figure_reads_success_and_score_per_step_beside_per_episode():
    """A bin's per-step value is its episodes' successes (score) over their steps summed: one success in a
    10-step and a 30-step episode is 25,000 a million steps, not the 50,000 of a mean of each episode's
    ratio; per episode it is 50%. An episode from before the key: no value, not 0. Without any success (the
    Score task) no success panels; with some, none for a config whose task has no success."""
    seed = [{"steps": 10, "score": 4, "success": 1, "env_steps": 40 * k + 10} for k in range(lc.BINS)]
    seed += [{"steps": 30, "score": 0, "success": 0, "env_steps": 40 * k + 20} for k in range(lc.BINS)]
    seed.sort(key=lambda e: e["env_steps"])  # two episodes in each of the bins
    values = {title: lc.binned([seed], value)[1][0] for title, value in lc.PANELS.items()}
    assert np.allclose(values["successes / 1M steps"], 25_000)
    assert np.allclose(values["success (% of episodes)"], 50)
    assert np.allclose(values["score / 1,000 steps"], 100) and np.allclose(values["score"], 2)
    assert np.allclose(values["episode steps"], 20) and np.isnan(values["depth"]).all()
    old = [{k: v for k, v in e.items() if k != "success"} for e in seed]  # a file from before `success`
    assert np.isnan(lc.binned([old], lc.PANELS["successes / 1M steps"])[1]).all()
    assert not set(lc.SUCCESS_PANELS) & set(lc.panels({"score_x": [old]}))
    shown = lc.panels({"stairs_x": [seed], "score_x": [old]}, unsuccessful={"score_x"})
    assert list(shown) == list(lc.PANELS)
    assert all(list(shown[t]) == (["stairs_x"] if t in lc.SUCCESS_PANELS else ["stairs_x", "score_x"])
               for t in shown)


def test_until_reads_the_runs_as_they_stood_at_that_step_and_writes_no_figure(tmp_path, capsys, monkeypatch):
    """A 2M-step run's tables at 1M: the last 100 episodes ended by then (one ending at the step included),
    not the run's last 100, and no evaluation, which is of the policy at the run's end, unless --eval-from
    names the folder of the one made at that step (earlier_1: the evaluation before a resume)."""
    dirs = synthetic(tmp_path)
    for seed in (1, 2):
        run = tmp_path / "cfg" / f"seed{seed}"
        (run / "eval.json").write_text(json.dumps({"episodes": [{"success": 1}]}))
    for name in ("stairs_task", "stairs_ranking"):  # A config and its baseline: their evaluations compare.
        shutil.copytree(tmp_path / "cfg", tmp_path / name)
    pair, out = [str(tmp_path / "stairs_task"), str(tmp_path / "stairs_ranking")], tmp_path / "pair"
    assert lc.main(["--plot", *pair, "--out", str(out)]) == 0
    assert "evaluated games" in open(out / "curves.md").read()
    assert lc.main(["--plot", *pair, "--out", str(out), "--until", "2e5"]) == 0
    assert "evaluated games" not in open(out / "curves_until_0.2M.md").read()
    for name, success in (("stairs_task", 1), ("stairs_ranking", 0)):  # at 0.2M: the ranking lost them all
        for seed in (1, 2):
            (tmp_path / name / f"seed{seed}" / "earlier_1").mkdir()
            (tmp_path / name / f"seed{seed}" / "earlier_1" / "eval.json").write_text(
                json.dumps({"episodes": [{"success": success}]}))
    for name in ("stairs_task", "stairs_ranking"):  # Its name as given: another folder than earlier_1.
        for seed in (1, 2):
            run = tmp_path / name / f"seed{seed}"
            os.rename(run / "earlier_1", run / "at_1m")
    assert lc.main(["--plot", *pair, "--out", str(out), "--until", "2e5", "--eval-from", "at_1m"]) == 0
    text = open(out / "curves_until_0.2M.md").read()
    assert "the evaluated games: each run's at_1m/eval.json" in text
    assert rows(text.split("against the baselines:\n\n")[2])["stairs_ranking"]["gap of means"] == "-100.00"
    os.remove(tmp_path / "stairs_ranking" / "seed2" / "at_1m" / "eval.json")  # A seed without: no reading.
    with pytest.raises(SystemExit, match=r"no at_1m/eval.json in .*stairs_ranking/seed2$"):
        lc.main(["--plot", *pair, "--out", str(out), "--until", "2e5", "--eval-from", "at_1m"])
    capsys.readouterr()
    out = tmp_path / "out"
    assert lc.main(["--plot", *dirs, "--out", str(out), "--until", "150001"]) == 0
    text = open(out / "curves_until_0.150001M.md").read()
    assert text in capsys.readouterr().out and not (out / "curves.png").exists()
    cfg, run = rows(text, 1)["cfg"], rows(text, 1)["run"]  # table 0: the line that names the step
    # cfg's episode i ends at 1000 (i + 1) + seed: seed 1's 150th ends at 150,001; the last 100 of seed 1 are
    # i = 50..149 (mean 99.5), of seed 2 i = 49..148 (+10: 108.5).
    assert cfg["env steps"] == "149,002" and cfg["score (last 100)"] == "104.00 ± 4.50"
    assert run["score (last 100)"] == "499.00"  # its 2,100 steps are all before the cut
    assert rows(text, 3)["cfg"]["episodes (by 150,001 steps)"] == "149.50 ± 0.50"
    assert lc.main(["--plot", *dirs, "--out", str(out), "--until", "1.5e6"]) == 0
    assert (out / "curves_until_1.5M.md").exists()
    with pytest.raises(SystemExit, match="no episode by 500 steps"):
        lc.main(["--plot", *dirs, "--out", str(out), "--until", "500"])
    monkeypatch.setattr(lc, "run_all", no_training)  # A usage check that lets a call through trains.
    for argv in (["--until", "1e6"], ["--plot", *dirs, "--until", "1e6", "--figure", "x.png"],
                 ["--plot", *dirs, "--until", "inf"], ["--plot", *dirs, "--eval-from", "earlier_1"],
                 ["--plot", *dirs, "--until", "1e6", "--eval-from", "/abs"],
                 ["--plot", *dirs, "--until", "1e6", "--eval-from", "."]):
        with pytest.raises(SystemExit):  # argparse's usage error, not a traceback
            lc.main(argv)
        assert "usage" in capsys.readouterr().err


def test_since_reads_a_runs_later_leg_with_its_final_evaluations(tmp_path, capsys, monkeypatch):
    """--since 1e6: a 2M-step run's second million, its episodes that ended after the step (one ending at it
    left out), with the evaluations of the final policy, which ends that leg; with --until too, between the
    two, and no evaluation."""
    synthetic(tmp_path)
    cfg, out = str(tmp_path / "cfg"), tmp_path / "out"
    assert lc.main(["--plot", cfg, "--out", str(out), "--since", "150001"]) == 0
    text = open(out / "curves_since_0.150001M.md").read()
    assert text in capsys.readouterr().out and not (out / "curves.png").exists()
    assert text.startswith("The runs' episodes that ended after 150,001 steps")
    # cfg's episode i ends at 1000 (i + 1) + seed: after 150,001, seed 1's from i = 150, seed 2's from 149.
    row = rows(text, 1)["cfg"]
    assert row["score (first 100)"] == "204.00 ± 4.50" and row["score (last 100)"] == "254.50 ± 5.00"
    assert rows(text, 3)["cfg"]["episodes (after 150,001 steps)"] == "150.50 ± 0.50"
    assert lc.main(["--plot", cfg, "--out", str(out), "--since", "1e5", "--until", "2e5"]) == 0
    assert rows(open(out / "curves_since_0.1M_until_0.2M.md").read(), 3)["cfg"][
        "episodes (after 100,000 steps, by 200,000 steps)"] == "100.00 ± 0.00"
    with pytest.raises(SystemExit, match="has no episode after 300,002 steps"):
        lc.main(["--plot", cfg, "--out", str(out), "--since", "300002"])
    for seed in (1, 2):
        run = tmp_path / "cfg" / f"seed{seed}"
        (run / "eval.json").write_text(json.dumps({"episodes": [{"success": 1}]}))
    for name in ("stairs_task", "stairs_ranking"):  # A config and its baseline: their evaluations compare.
        shutil.copytree(tmp_path / "cfg", tmp_path / name)
    pair = [str(tmp_path / "stairs_task"), str(tmp_path / "stairs_ranking")]
    assert lc.main(["--plot", *pair, "--out", str(out), "--since", "1e5"]) == 0
    assert "evaluated games (1 a seed)" in open(out / "curves_since_0.1M.md").read()
    assert lc.main(["--plot", *pair, "--out", str(out), "--since", "1e5", "--until", "2e5"]) == 0
    assert "evaluated games" not in open(out / "curves_since_0.1M_until_0.2M.md").read()
    capsys.readouterr()
    monkeypatch.setattr(lc, "run_all", no_training)
    for argv in (["--since", "1e6"], ["--plot", cfg, "--since", "1e6", "--figure", "x.png"],
                 ["--plot", cfg, "--since", "1e6", "--eval-from", "earlier_1"],
                 ["--plot", cfg, "--since", "2e5", "--until", "2e5"], ["--plot", cfg, "--since", "-5"]):
        with pytest.raises(SystemExit):  # argparse's usage error, not a traceback
            lc.main(argv)
        assert "usage" in capsys.readouterr().err


def test_tables_and_figures_load_no_torch(tmp_path):
    """Reading runs needs no torch (it takes seconds to import): run_files imports it only for checkpoints."""
    code = ("import sys, learning_curves as lc; lc.main(['--plot', *sys.argv[1:]]); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code, *synthetic(tmp_path), "--out",
                             str(tmp_path / "out")], cwd=lc.ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "out" / "curves.md").exists()


def test_comparisons_claim_beats_only_beyond_the_larger_std_and_read_seed_overlap(tmp_path):
    def runs(**scores):  # config -> each seed's last-100 score
        return {name: [[{"score": x}] * lc.WINDOW for x in seeds] for name, seeds in scores.items()}

    def readings(text):
        lines = [[c.strip() for c in line.strip("|").split("|")] for line in text.strip().splitlines()[2:]]
        return {(cells[0], cells[1]): cells[3:] for cells in lines}

    got = readings(lc.comparisons(runs(free_none=[5, 9], score_extrinsic=[10, 14], free_ranking=[30, 32],
                                       free_retrieval=[8, 24], free_classification=[1, 3], free_x=[12, 16])))
    std = f"{np.std([8, 24], ddof=1):.2f}"  # 11.31: ddof 0 would say 8.00, and "beats" the control by 11
    assert got[("free_ranking", "free_none")] == ["+24.00", "2.83", "beats", "no"]
    assert got[("free_retrieval", "free_none")] == ["+9.00", std, "within the std", "yes"]
    assert got[("free_retrieval", "score_extrinsic")] == ["+4.00", std, "within the std", "yes"]
    assert got[("free_classification", "free_none")] == ["-5.00", "2.83", "below", "no"]
    assert got[("score_extrinsic", "free_none")] == ["+5.00", "2.83", "beats", "no"]
    assert got[("free_x", "free_none")] == ["+7.00", "2.83", "beats", "no"]
    assert got[("free_x", "score_extrinsic")] == ["+2.00", "2.83", "within the std", "yes"]  # 12 < 14
    assert ("free_none", "score_extrinsic") not in got and len(got) == 9  # the control is not compared back
    edge = readings(lc.comparisons(runs(free_none=[1, 2, 3], free_x=[3, 3, 3])))  # gap 1 = std 1; 3 = 3
    assert edge == {("free_x", "free_none"): ["+1.00", "1.00", "within the std", "yes"]}
    one = readings(lc.comparisons(runs(free_none=[5, 9], score_extrinsic=[11], free_ranking=[30])))
    assert one[("score_extrinsic", "free_none")] == ["+4.00", "—", "no claim (one seed)", "—"]
    assert one[("free_ranking", "score_extrinsic")] == ["+19.00", "—", "no claim (one seed)", "—"]
    assert lc.comparisons(runs(free_ranking=[30, 32])) == ""  # no baseline: no table

    for config, scores in {"free_none": [1, 2], "free_ranking": [50, 60]}.items():
        for seed, score in enumerate(scores, 1):
            episode = {"return": 0.0, "steps": 1, "score": score, "kills": 0, "depth": 1, "explored": 1}
            write_episodes(tmp_path / config / f"seed{seed}" / "episodes.jsonl", [episode] * 3)
    assert lc.main(["--plot", str(tmp_path / "free_none"), str(tmp_path / "free_ranking"), "--out",
                    str(tmp_path / "out")]) == 0
    written = open(tmp_path / "out" / "curves.md").read().split("\n\n")
    assert readings(written[-1]) == {("free_ranking", "free_none"): ["+53.50", "7.07", "beats", "no"]}
    # The evaluated games are read by the same rule, all of them (not the last 100), once every seed has them.
    for config, scores in {"free_none": [3, 3], "free_ranking": [[4] * 140 + [9] * 60, [4] * 200]}.items():
        for seed, score in enumerate(scores, 1):
            games = [{"score": x} for x in (score if isinstance(score, list) else [score] * 200)]
            (tmp_path / config / f"seed{seed}" / "eval.json").write_text(json.dumps({"episodes": games}))
            assert lc.main(["--plot", str(tmp_path / "free_none"), str(tmp_path / "free_ranking"), "--out",
                            str(tmp_path / "out")]) == 0
            written = open(tmp_path / "out" / "curves.md").read().split("\n\n")
            evaluated = "The evaluated games (200 a seed) against the baselines:" in written[-2]
            assert evaluated == (config == "free_ranking" and seed == 2)  # Not before every seed has its own.
    assert readings(written[-1]) == {("free_ranking", "free_none"): ["+1.75", "1.06", "beats", "no"]}


def test_how_episodes_end_comes_from_the_recorded_end_and_the_staircase_is_read_by_success(tmp_path):
    """Guards issue 43: the tables said nothing of how episodes end (starvation and a god's anger ended a
    third of the ONI agents'), and a sparse task's configs must be read by their success, against the task
    reward alone."""
    wrath = ('The voice of Chih Sung-tzu booms out: "Thou hast angered me." Suddenly, a bolt of lightning '
             'strikes you! You fry to a crisp!')
    episodes = [{"end": "died", "end_text": "The jackal bites! You die..."},
                {"end": "died", "end_text": wrath},
                {"end": "died", "end_text": "The earth elemental of Chih Sung-tzu hits! You die..."},
                {"end": "starving", "end_text": "You die from starvation."},
                {"end": "choking", "end_text": ""}, {"end": "time limit"}, {"end": "success"}, {}]
    assert [lc.end_kind(e) for e in episodes] == ["killed", "prayer", "prayer", "starvation", "other",
                                                  "time limit", "success", None]
    base = {"return": 0.0, "steps": 10, "score": 1, "kills": 0, "depth": 1, "explored": 1, "xlvl": 1}
    for seed, ends in ((1, ["died", "starving", "starving", "time limit"]), (2, ["starving"] * 4)):
        write_episodes(tmp_path / "stairs_x" / f"seed{seed}" / "episodes.jsonl",
                       [dict(base, end=end, env_steps=i) for i, end in enumerate(ends)])
    assert lc.main(["--plot", str(tmp_path / "stairs_x"), "--out", str(tmp_path / "out")]) == 0
    ends = rows(open(tmp_path / "out" / "curves.md").read(), 2)["stairs_x"]
    # seeds: 50% and 100%
    assert ends["starvation %"] == "75.00 ± 25.00" and ends["killed %"] == "12.50 ± 12.50"
    # Seed 1 succeeds twice in 1M steps, seed 2 twice in 0.5M: per step they differ (2 and 4 a million steps),
    # per episode they would not. The steps are the episodes' own: env_steps also counts the other envs'
    # episodes still going (here twice as many). A Score run's success columns say "—": no success to count.
    for seed, successes in ((1, [1, 0, 1, 0]), (2, [1, 1])):
        write_episodes(tmp_path / "stairs_y" / f"seed{seed}" / "episodes.jsonl",
                       [dict(base, success=x, steps=250_000, env_steps=500_000 * (i + 1))
                        for i, x in enumerate(successes)])
        write_episodes(tmp_path / "free_y" / f"seed{seed}" / "episodes.jsonl", [dict(base, success=0.0)])
        (tmp_path / "free_y" / f"seed{seed}" / "summary.json").write_text(json.dumps(
            {"sessions": [{"commit": "c" * 40, "uncommitted_changes": False,
                           "flags": {"task": "NetHackScoreExtendedActions-v1"}}]}))
    assert lc.main(["--plot", str(tmp_path / "stairs_y"), str(tmp_path / "free_y"), "--out",
                    str(tmp_path / "out")]) == 0
    text = open(tmp_path / "out" / "curves.md").read()
    assert rows(text, 2)["stairs_y"]["successes / 1M steps"] == "3.00 ± 1.00"
    assert rows(text, 2)["free_y"]["successes / 1M steps"] == "—"
    assert rows(text)["free_y"]["success % (last 100)"] == "—"
    assert rows(text)["stairs_y"]["success % (last 100)"] == "75.00 ± 25.00"

    def runs(**success):  # config -> each seed's last-100 success rate
        return {name: [[{"success": x, "score": 0}] * lc.WINDOW for x in seeds]
                for name, seeds in success.items()}
    # each sparse task's configs against its own task reward alone (Lvl3 against Staircase would compare
    # two tasks' success rates)
    text = lc.comparisons(runs(stairs_task=[0.1, 0.2], stairs_ranking=[0.5, 0.6], free_none=[0.0, 0.0],
                               lvl3_task=[0.0, 0.1], lvl3_ranking=[0.0, 0.2]))
    lines = [[c.strip() for c in line.strip("|").split("|")] for line in text.strip().splitlines()[2:]]
    assert lines == [["stairs_ranking", "stairs_task", "success %", "+40.00", "7.07", "beats", "no"],
                     ["lvl3_ranking", "lvl3_task", "success %", "+5.00", "14.14", "within the std", "yes"]]
    assert lc.CONFIGS["lvl3_ranking"] == (lc.SPARSE["lvl3"], "ranking", None, 1_000_000)
    assert lc.SPARSE["lvl3"] == "NetHackStaircaseLvl3ExtendedActions-v1"


def test_a_gzipped_run_reads_as_the_plain_one_and_is_never_run_again(tmp_path, monkeypatch, capsys):
    """results/ keeps episodes.jsonl gzipped (episodes.jsonl.gz): the tables read it as the plain file, and
    the runner counts such a committed run complete, whatever its summary says: a resume or a fresh start
    would write a plain episodes.jsonl beside it, and a new summary and messages over the committed ones."""
    dirs = synthetic(tmp_path)
    assert lc.main(["--plot", *dirs, "--out", str(tmp_path / "plain")]) == 0
    for run_dir in ("cfg/seed1", "cfg/seed2", "run"):
        subprocess.run(["gzip", "-n", "-9", str(tmp_path / run_dir / "episodes.jsonl")], check=True)
    assert lc.main(["--plot", *dirs, "--out", str(tmp_path / "gzipped")]) == 0
    plain = (tmp_path / "plain" / "curves.md").read_text()
    assert (tmp_path / "gzipped" / "curves.md").read_text() == plain

    out = tmp_path / "out"
    shutil.copytree(tmp_path / "cfg", out / "free_none")  # summaries of 1 and 2 steps
    (out / "free_none" / "seed1" / "checkpoint.pt").write_bytes(b"")  # it would be resumed
    (out / "free_none" / "seed2" / "labels.jsonl").write_text("")  # set aside for a fresh start
    committed = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    calls = []
    monkeypatch.setattr(lc, "execute", lambda command, log: calls.append(command) or 0)
    capsys.readouterr()
    assert lc.main(["--configs", "free_none", "--seeds", "1", "2", "--out", str(out)]) == 0
    assert calls == [] and capsys.readouterr().out.count("or committed), skipped") == 2
    assert {p: p.read_bytes() for p in (out / "free_none").rglob("*") if p.is_file()} == committed
    assert rows((out / "curves.md").read_text())["free_none"] == dict(rows(plain)["cfg"], config="free_none")


def test_execute(tmp_path):
    with open(tmp_path / "console.log", "a") as log:
        assert lc.execute(
            [sys.executable, "-c", "import os; print(os.getcwd()); raise SystemExit(3)"], log) == 3
    assert open(tmp_path / "console.log").read().strip() == lc.ROOT  # runs in the repo root, output logged


def test_runner_commands(tmp_path, monkeypatch):
    out = tmp_path / "out"
    os.makedirs(out / "free_none" / "seed1")
    (out / "free_none" / "seed1" / "summary.json").write_text(json.dumps({"env_steps": 500_123}))  # complete
    os.makedirs(out / "free_none" / "seed2")
    (out / "free_none" / "seed2" / "checkpoint.pt").write_bytes(b"")  # interrupted
    write_episodes(out / "free_none" / "seed2" / "episodes.jsonl",  # the resume goes on with it
                   [dict.fromkeys(("score", "kills", "depth", "explored", "steps"), 1)])
    write_episodes(out / "free_ranking" / "seed1" / "episodes.jsonl",
                   [{"steps": 1}])  # a start that saved nothing
    (out / "free_ranking" / "seed1" / "labels.jsonl").write_text('{"caption": "It\'s a wall.", "label": 0}\n')
    calls = []

    def fake_execute(command, log):
        calls.append(command)
        return 1 if "--resume" in command else 0  # the resume fails

    monkeypatch.setattr(lc, "execute", fake_execute)
    argv = ["--configs", "free_none", "free_ranking", "--seeds", "1", "2", "--out", str(out), "--num-workers",
            "2", "--", "--llm-url", "http://gpu:8000/v1"]
    assert lc.main(argv) == 1  # a run failed, the others still ran
    run_dirs = [c[c.index("--resume") + 1] if "--resume" in c else c[c.index("--run-dir") + 1] for c in calls]
    assert run_dirs == [str(out / "free_none" / "seed2"), str(out / "free_ranking" / "seed1"),
                        str(out / "free_ranking" / "seed2")]
    resume, fresh = calls[0], calls[1]
    assert resume[1:] == ["oni_appo.py", "--resume", str(out / "free_none" / "seed2"), "--total-env-steps",
                          "500000", "--num-workers", "2", "--llm-url", "http://gpu:8000/v1"]
    assert fresh[1:] == ["oni_appo.py", "--task", "NetHackScoreExtendedActions-v1", "--reward-type",
                         "ranking", "--extrinsic-coef", "0", "--seed", "1", "--total-env-steps", "500000",
                         "--run-dir", str(out / "free_ranking" / "seed1"), "--num-workers", "2",
                         "--llm-url", "http://gpu:8000/v1"]
    assert set(json.load(open(out / "wall_times.json"))) == {"free_none/seed2", "free_ranking/seed1",
                                                              "free_ranking/seed2"}
    assert os.path.exists(out / "free_ranking" / "seed1" / "console.log")
    assert sorted(os.listdir(out / "free_none" / "seed2")) == ["checkpoint.pt", "console.log",
                                                               "episodes.jsonl"]
    seed1 = out / "free_ranking" / "seed1"
    assert sorted(os.listdir(seed1)) == ["console.log", "earlier_1"]  # set aside, not appended to
    assert sorted(os.listdir(seed1 / "earlier_1")) == ["episodes.jsonl", "labels.jsonl"]
    # killed early again, with its tensorboard events
    write_episodes(seed1 / "episodes.jsonl", [{"steps": 2}])
    (seed1 / "events.out.tfevents.2").write_bytes(b"")
    assert lc.main(["--configs", "free_ranking", "--seeds", "1", "--out", str(out)]) == 0
    assert sorted(os.listdir(seed1 / "earlier_2")) == ["episodes.jsonl", "events.out.tfevents.2"]
    assert lc.load_episodes(seed1 / "earlier_1" / "episodes.jsonl")[0]["steps"] == 1  # the first start's kept

    # --steps overrides every config (2e9 parses); the summary's 500,123 steps are no longer complete
    calls.clear()
    assert lc.main(["--configs", "score_extrinsic", "free_none", "--seeds", "1", "--out", str(out),
                    "--steps", "2e9"]) == 0
    assert calls[0][1:] == ["oni_appo.py", "--task", "NetHackScoreExtendedActions-v1", "--reward-type",
                            "none", "--seed", "1", "--total-env-steps", "2000000000",
                            "--run-dir", str(out / "score_extrinsic" / "seed1")]  # default extrinsic coef
    assert "--run-dir" in calls[1] and "2000000000" in calls[1]  # summary but no checkpoint: a fresh start

    # a finished run with its checkpoint is extended to --steps (the resume applies the flag:
    # test_whole_runs.py)
    calls.clear()
    (out / "free_none" / "seed1" / "checkpoint.pt").write_bytes(b"")
    assert lc.main(["--configs", "free_none", "--seeds", "1", "--out", str(out), "--steps", "1e6"]) == 1
    assert calls[0][1:] == ["oni_appo.py", "--resume", str(out / "free_none" / "seed1"), "--total-env-steps",
                            "1000000"]


def test_eval_table_and_commands(tmp_path, monkeypatch):
    """--eval: each seed dir gets evaluate.py (trained) and evaluate.py --random unless its json exists."""
    run_dir = tmp_path / "cfg" / "seed1"
    os.makedirs(run_dir)
    episodes = [{"score": s, "kills": 1, "depth": 1, "explored": 10, "steps": 100} for s in (2, 4)]
    calls = []

    def fake_execute(command, log):  # evaluate.py writes eval.json / eval_random.json
        calls.append(command)
        name = "eval_random.json" if "--random" in command else "eval.json"
        (run_dir / name).write_text(
            json.dumps({"episodes": [dict(e, score=e["score"] * 10) for e in episodes]}))
        return 0

    (run_dir / "eval.json").write_text(json.dumps({"episodes": episodes}))  # already evaluated: reused
    monkeypatch.setattr(lc, "execute", fake_execute)
    out = tmp_path / "out"
    assert lc.main(["--eval", str(tmp_path / "cfg"), "--out", str(out), "--eval-episodes", "7"]) == 0
    assert [c[1:] for c in calls] == [["evaluate.py", str(run_dir), "--episodes", "7", "--random"]]
    lines = open(out / "eval.md").read().strip().splitlines()
    assert len(lines) == 4
    trained, random = ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])
    assert trained[1:4] == ["trained", "2", "3.00 ± 1.00"] and random[1:4] == [
        "random actions", "2", "30.00 ± 10.00"]


def test_eval_reports_a_failed_evaluation_and_writes_its_table_whole_at_the_end(
        tmp_path, monkeypatch, capsys):
    """Guards issue 45 item 5: eval.md was opened for writing before anything was evaluated (one refused
    checkpoint left an existing eval.md at 0 bytes), and evaluate.py's failures went to /dev/null: exit 0, an
    empty table."""
    run_dir, out = tmp_path / "cfg" / "seed1", tmp_path / "out"
    os.makedirs(run_dir)
    os.makedirs(out)
    (out / "eval.md").write_text("the last table\n")

    def failing_execute(command, log):
        log.write("error: cannot read checkpoint: cut short\n")
        return 1
    monkeypatch.setattr(lc, "execute", failing_execute)
    assert lc.main(["--eval", str(tmp_path / "cfg"), "--out", str(out), "--eval-episodes", "3"]) == 1
    err = capsys.readouterr().err
    assert f"error: evaluate.py on {run_dir} exited with 1: error: cannot read checkpoint: cut short" in err
    # written whole, after the evaluations
    assert (out / "eval.md").read_text().startswith("| run | policy |")

    def interrupted(command, log):
        raise KeyboardInterrupt
    (out / "eval.md").write_text("the last table\n")
    monkeypatch.setattr(lc, "execute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lc.main(["--eval", str(tmp_path / "cfg"), "--out", str(out), "--eval-episodes", "3"])
    assert (out / "eval.md").read_text() == "the last table\n"  # a stop halfway keeps the last table


def test_eval_plays_random_actions_once_per_task_and_seed(tmp_path, monkeypatch):
    """--eval: runs of one task and seed share one evaluate.py --random (the same games, the same actions);
    another seed gets its own."""
    runs, EVAL_KEYS = {}, ("score", "kills", "depth", "explored", "steps")
    for config, seed in (("a", 1), ("b", 1), ("c", 2)):
        runs[config] = tmp_path / config / "seed1"
        os.makedirs(runs[config])
        torch.save({"args": {"task": lc.SCORE, "seed": seed, "max_episode_steps": 100}},
                   runs[config] / "checkpoint.pt")
        (runs[config] / "eval.json").write_text(json.dumps({"episodes": [{k: seed for k in EVAL_KEYS}] * 2}))
    calls = []

    def fake_execute(command, log):
        calls.append(command[2])
        episodes = [{k: len(calls) for k in EVAL_KEYS}] * 2
        (tmp_path / command[2] / "eval_random.json").write_text(json.dumps({"episodes": episodes}))
        return 0

    monkeypatch.setattr(lc, "execute", fake_execute)
    assert lc.main(["--eval", *(str(tmp_path / c) for c in "abc"), "--out", str(tmp_path / "out"),
                    "--eval-episodes", "2"]) == 0
    assert calls == [str(runs["a"]), str(runs["c"])]
    assert open(runs["b"] / "eval_random.json").read() == open(runs["a"] / "eval_random.json").read()
    assert open(tmp_path / "out" / "eval.md").read().count("random actions") == 3


def test_eval_record_asks_for_the_first_episodes_replay(tmp_path, monkeypatch):
    """--eval --record: evaluate.py records episode 0, trained and random, again where a replay is missing."""
    run_dir = tmp_path / "cfg" / "seed1"
    os.makedirs(run_dir / "replay_random")
    episodes = [{"score": 1, "kills": 1, "depth": 1, "explored": 10, "steps": 100}]
    for name in ("eval.json", "eval_random.json"):  # evaluated, but only the random replay is there
        (run_dir / name).write_text(json.dumps({"episodes": episodes}))
    (run_dir / "replay_random" / "episode0.html").write_text("")
    calls = []
    monkeypatch.setattr(lc, "execute", lambda command, log: calls.append(command) or 0)
    assert lc.main(["--eval", str(tmp_path / "cfg"), "--out", str(tmp_path / "out"), "--eval-episodes", "3",
                    "--record"]) == 0
    assert [c[1:] for c in calls] == [["evaluate.py", str(run_dir), "--episodes", "3", "--record",
                                       str(run_dir / "replay"), "--record-episodes", "1"]]


def test_eval_after_evaluates_each_run_once_complete_while_its_checkpoint_is_there(tmp_path, monkeypatch):
    """--eval-after: results/free_1m's runs lost their checkpoints (not committed) before anyone evaluated
    them; a run is now evaluated as soon as it completes, and a complete one that was not is evaluated on the
    next call. Random actions are played once per seed: the second config's run copies the first's."""
    out, EVAL_KEYS = tmp_path / "out", ("score", "kills", "depth", "explored", "steps")
    calls = []

    def fake_execute(command, log):
        if command[1] == "oni_appo.py":  # a training run: it ends with a checkpoint and a complete summary
            run_dir = command[command.index("--run-dir") + 1]
            torch.save({"args": {"task": lc.SCORE, "seed": 1, "max_episode_steps": 100}},
                       f"{run_dir}/checkpoint.pt")
            open(f"{run_dir}/summary.json", "w").write(json.dumps({"env_steps": 1000}))
        else:
            calls.append((os.path.basename(os.path.dirname(command[2])), "--random" in command))
            name = "eval_random.json" if "--random" in command else "eval.json"
            open(os.path.join(command[2], name), "w").write(
                json.dumps({"episodes": [{k: 1 for k in EVAL_KEYS}] * 5}))
        return 0
    monkeypatch.setattr(lc, "execute", fake_execute)
    monkeypatch.setattr(lc, "report", lambda *a: None)
    assert lc.main(["--configs", "free_none", "--steps", "1000", "--out", str(out), "--eval-after", "5"]) == 0
    assert calls == [("free_none", False), ("free_none", True)]
    # free_none complete and evaluated: only free_retrieval's policy
    assert lc.main(["--configs", "free_none", "free_retrieval", "--steps", "1000", "--out", str(out),
                    "--eval-after", "5"]) == 0
    assert calls[2:] == [("free_retrieval", False)]
    assert os.path.exists(out / "free_retrieval" / "seed1" / "eval_random.json")  # copied from free_none's
    assert lc.main(["--configs", "free_none", "--steps", "1000", "--out", str(out)]) == 0 and len(calls) == 3


def test_eval_after_leaves_a_run_in_progress_alone(tmp_path, monkeypatch):
    """A run still training has a periodic checkpoint: --eval-after of another config must not evaluate it.
    Nor one resumed to more steps, which keeps its random actions' games (five_2m: a restarted driver, on
    the score-trained run it had committed, began to evaluate Ranking halfway through its 2M leg)."""
    out = tmp_path / "out"
    os.makedirs(out / "free_none" / "seed1")
    torch.save({"args": {"task": lc.SCORE, "seed": 1}},
               out / "free_none" / "seed1" / "checkpoint.pt")  # in progress, resumed from an evaluated end
    (out / "free_none" / "seed1" / "eval_random.json").write_text(json.dumps({"episodes": []}))
    done = out / "free_retrieval" / "seed1"
    os.makedirs(done)
    torch.save({"args": {"task": lc.SCORE, "seed": 1}}, done / "checkpoint.pt")
    (done / "summary.json").write_text(json.dumps({"env_steps": 1000}))
    calls = []
    monkeypatch.setattr(lc, "execute", lambda command, log: calls.append(command[2]) or 0)
    monkeypatch.setattr(lc, "report", lambda *a: None)
    assert lc.main(
        ["--configs", "free_retrieval", "--steps", "1000", "--out", str(out), "--eval-after", "5"]) == 0
    assert calls == [str(done), str(done)]  # its policy and random actions, nothing of free_none's


def test_random_actions_played_before_are_reused_whatever_the_order(tmp_path, monkeypatch):
    """A run sorted before one already evaluated played the random games again (free_none after
    free_retrieval)."""
    EVAL_KEYS = ("score", "kills", "depth", "explored", "steps")
    first, evaluated = tmp_path / "free_none" / "seed3", tmp_path / "free_retrieval" / "seed3"
    for run in (first, evaluated):
        os.makedirs(run)
        torch.save({"args": {"task": lc.SCORE, "seed": 3, "max_episode_steps": 100}}, run / "checkpoint.pt")
    for name in ("eval.json", "eval_random.json"):
        (evaluated / name).write_text(json.dumps({"episodes": [{k: 1 for k in EVAL_KEYS}] * 4}))
    calls = []

    def fake_execute(command, log):
        calls.append((command[2], "--random" in command))
        (first / "eval.json").write_text(json.dumps({"episodes": [{k: 2 for k in EVAL_KEYS}] * 4}))
        return 0
    monkeypatch.setattr(lc, "execute", fake_execute)
    lc.evaluate([str(first), str(evaluated)], 4)
    assert calls == [(str(first), False)]  # its policy only
    assert (first / "eval_random.json").read_text() == (evaluated / "eval_random.json").read_text()


def test_eval_after_skips_a_stopped_run_and_a_resume_sets_its_evaluation_aside(tmp_path, monkeypatch):
    """A run stopped by SIGTERM exits 0 with a checkpoint short of its steps: it was evaluated as if final,
    and that evaluation stayed once the resumed run completed."""
    out = tmp_path / "out"
    run = out / "free_none" / "seed1"
    calls = []

    def fake_execute(command, log):
        calls.append(command[1])
        if command[1] == "oni_appo.py":
            torch.save({"args": {"task": lc.SCORE, "seed": 1}}, run / "checkpoint.pt")
            steps = 1000 if "--resume" in command else 400  # the first session is stopped at 400 steps
            (run / "summary.json").write_text(json.dumps({"env_steps": steps}))
        else:
            (run / ("eval_random.json" if "--random" in command else "eval.json")).write_text(json.dumps(
                {"episodes": [dict.fromkeys(("score", "kills", "depth", "explored", "steps"), 1)] * 5}))
        return 0
    monkeypatch.setattr(lc, "execute", fake_execute)
    monkeypatch.setattr(lc, "report", lambda *a: None)
    argv = ["--configs", "free_none", "--steps", "1000", "--out", str(out), "--eval-after", "5"]
    assert lc.main(argv) == 0 and calls == ["oni_appo.py"]  # stopped: not evaluated
    (run / "eval.json").write_text(json.dumps({"episodes": []}))  # as an earlier version evaluated it
    assert lc.main(argv) == 0 and calls[1:] == ["oni_appo.py", "evaluate.py", "evaluate.py"]
    # the earlier evaluation, kept; episodes not (a resume)
    assert os.listdir(run / "earlier_1") == ["eval.json"]


def test_a_run_dir_a_learner_still_holds_is_left_alone(tmp_path):
    """Guards a review finding (issue 45): a driver restarted while its killed predecessor's learner still
    saved moved that learner's episodes and labels aside under it, as from a start killed before its
    checkpoint."""
    import subprocess
    run_dir = tmp_path / "free_none" / "seed1"
    os.makedirs(run_dir)
    holder = subprocess.Popen([sys.executable, "-c",
                               "import run_files, sys, time; lock = run_files.hold(sys.argv[1]); "
                               "print('held', flush=True); time.sleep(600)", str(run_dir)],
                              cwd=lc.ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert lc.in_use(str(run_dir)) == f"pid {holder.pid} on {__import__('socket').gethostname()}"
    finally:
        holder.kill()
        holder.wait()
    assert lc.in_use(str(run_dir)) is None and lc.in_use(str(tmp_path)) is None
