"""The measurement scripts still run against the code they measure (their figures: benchmarks/README.md)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_learner_time_update_times_every_stage_of_a_real_update():
    result = subprocess.run([sys.executable, "benchmarks/learner_time.py", "--update", "--batch-size", "64",
                             "--updates", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.strip("|").split("|") for line in result.stdout.splitlines()
            if line.startswith("| ") and "ms" not in line]
    assert [r[0].strip() for r in rows] == ["encoder forward (inside forward + loss)",
                                            "GRU unroll + V-trace + loss (forward)", "backward",
                                            "clip + Adam step", "weights to the acting agent"]
    stages_ms = [float(r[1]) for r in rows]
    update_ms = float(result.stdout.split("median of 2: ")[1].split(" ms")[0])
    # the stages make the update; the second is a difference of two timings (forward + loss minus the
    # encoder's own forward, timed apart), which a loaded box can make negative, so only the timed ones must
    # be >= 0
    assert all(ms >= 0 for i, ms in enumerate(stages_ms) if i != 1) and abs(sum(stages_ms) - update_ms) < 1


def test_learner_time_update_counts_the_update_arithmetic_and_times_bf16():
    result = subprocess.run([sys.executable, "benchmarks/learner_time.py", "--update", "--batch-size", "64",
                             "--updates", "2", "--bf16"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    counted_gflop = float(result.stdout.split("arithmetic: ")[1].split(" GFLOP")[0])
    # by hand: multiply-adds of one forward step (crop convs on 12x12 and 6x6, the linear layers, GRU 512,
    # heads)
    sys.path.insert(0, ROOT)
    import envs
    convs = 12 * 12 * 64 * 32 * 9 + 6 * 6 * 64 * 64 * 9
    linears = (2304 * 256 + 27 * 64 + 64 * 64 + envs.MESSAGE_LEN * 128 + 128 * 128 + 448 * 512
               + 512 * (len(envs.ACTIONS) + 1))
    gru = 3 * 512 * (512 + 512)
    # FLOPs of 33 observations (rollout 32 + bootstrap) x 2 envs
    forward = 2 * (convs + linears + gru) * 33 * 2
    # backward: a gradient for the weights and one for the inputs of every layer (3x the forward pass in all),
    # except the inputs of the stats and message MLPs' first layers and the GRU's state at t = 0 (h0), which
    # need none
    no_input_grad = 2 * (27 * 64 + envs.MESSAGE_LEN * 128) * 33 * 2 + 2 * 512 * 3 * 512 * 2
    assert abs(counted_gflop - (3 * forward - no_input_grad) / 1e9) < 1e-3
    per_step = dict(
        item.split(": ")
        for item in result.stdout.split("us per env step by batch size: ")[1].split("\n")[0].split(", "))
    assert list(per_step) == ["8", "16", "32", "64"] and all(float(us) > 0 for us in per_step.values())
    off_by = float(result.stdout.split("loss off by ")[1].split(",")[0])
    grad_off_by = float(result.stdout.split("gradient off by ")[1].split()[0])
    assert 0 < off_by < 0.1 and 0 < grad_off_by < 0.5  # bf16 autocast ran (a different loss), and is close


def test_label_quality_weighs_by_steps_and_pay_and_keeps_the_test_and_goal_sets_out_of_dev():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import label_quality
    # asserts that no test or goal message nor a test near-copy is in the dev split
    sets = label_quality.load_sets()
    assert (min(len(sets["dev"]), len(sets["test"])) >= 190 and len(sets["old50"]) == 50
            and len(sets["goal"]) >= 40)
    for name in ("dev", "test"):  # both sides hold helpful messages and the frequent unhelpful kinds
        assert {r.label for r in sets[name]} == {0, 1} and max(r.steps for r in sets[name]) > 100_000
        # a pay weight is at most the steps
        assert all(0 < r.firsts <= r.steps for r in sets[name] if r.steps)
    kinds = {r.kind for r in sets["goal"]}  # the goal's events and the near-misses that must not pay
    assert {"descend by stairs", "pet picks up", "pet kills", "gold picked up",
            "player dies or starves"} <= kinds
    Row = label_quality.Row
    rows = [Row("It's a wall.", 90, 0, "a", 2.0, ""), Row("Never mind.", 10, 0, "b", 8.0, ""),
            Row("You kill the newt!", 3, 1, "c", 3.0, ""), Row("$ - 2 gold pieces.", 1, 1, "d", 1.0, "")]
    # one label in four wrong, on the message that showed on 90 of 100 unhelpful steps but on 2 of 10 first
    # sightings
    assert label_quality.figures(rows, [1, 0, 1, 1]) == (0.75, 0.9, 1.0, 0.2, 1.0)
    assert label_quality.figures(rows, [0, 0, 0, 1]) == (0.75, 0.0, 0.25, 0.0, 0.25)
    # pairs (helpful, unhelpful) by score: 3-(-1) and 0.2-(-1) prefer the helpful one; 0.2-0.1 is a tie
    assert label_quality.pair_figures(rows, [0.1, -1.0, 3.0, 0.2], tie_margin=0.5) == (0.75, 0.25, 0.0)
    pool = [("You kill the newt!", 1, None), ("It's a wall.", 0, None), ("It's solid stone.", 0, None)]
    pool = [(m, label, label_quality.annotator.trigrams(m)) for m, label, _ in pool]
    asked = [Row("You kill the jackal!", 1, 1, "e", 1.0, ""), Row("It's a wall!", 1, 0, "f", 1.0, "")]
    assert label_quality.nearest_labels(pool, asked, k=1)[0] == [1, 0]  # the lookup copies its nearest label
    assert label_quality.nearest_labels(pool, asked, k=3)[0] == [0, 0]  # ... or the majority of the three
    # a sample of more messages than a label has takes them all (it raised ValueError)
    assert sorted(label_quality.calibration_sample(rows, per_label=3)) == sorted(rows)


def test_runs_reads_the_labels_of_a_run_still_writing_them(tmp_path):
    """A run killed mid-write, or still running, cut the last line of labels.jsonl: runs.llm_labels raised."""
    import annotator
    import runs
    (tmp_path / "labels.jsonl").write_text('{"caption": "You kill the newt!", "label": 1}\n'
                                           '{"caption": "It\'s a wall.", "label": 0}\n{"caption": "You see')
    assert runs.llm_labels(str(tmp_path)) == {"You kill the newt!": 1, "It's a wall.": 0}
    # results/ keeps it gzipped (labels.jsonl.gz): read as the plain one, by every reader of a run's labels
    subprocess.run(["gzip", "-n", "-9", str(tmp_path / "labels.jsonl")], check=True)
    assert runs.llm_labels(str(tmp_path)) == {"You kill the newt!": 1, "It's a wall.": 0}
    assert annotator.load_demos(str(tmp_path / "labels.jsonl.gz"))[0][:2] == ("You kill the newt!", 1)
    cut = tmp_path / "cut" / "labels.jsonl.gz"  # a gzipped copy cut short: one error line, no traceback
    cut.parent.mkdir()
    cut.write_bytes((tmp_path / "labels.jsonl.gz").read_bytes()[:30])
    with pytest.raises(SystemExit, match="cannot read labels from .*labels.jsonl.gz: Compressed file ended"):
        runs.llm_labels(str(cut.parent))
    data = bytearray((tmp_path / "labels.jsonl.gz").read_bytes())  # ... or damaged
    data[12:15] = b"\xff\xff\xff"
    cut.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="cannot read labels from .*labels.jsonl.gz: "):
        runs.llm_labels(str(cut.parent))


def test_label_scale_prints_each_figure_of_each_case():
    result = subprocess.run([sys.executable, "benchmarks/label_scale.py", "--captions", "1500", "--pairs",
                             "300", "--http-captions", "300"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.strip("|").split("|") for line in result.stdout.splitlines()
            if line.startswith("| ") and "figure" not in line]
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import label_scale
    assert [(case.split()[0], label.strip()) for case, label, _ in rows] == [
        (c, label) for c, _, label in label_scale.ROWS]
    figures = {(case.split()[0], label.strip()): float(value.replace(",", "")) for case, label, value in rows}
    assert all(value >= 0 for value in figures.values())  # every figure measured, none "n/a"
    assert (figures["captions", "learner process peak RSS, MB"] > 0
            and figures["http", "labels/s over HTTP (fake LLM)"] > 0)
    assert figures["unanswered", "captions it sends"] == 1550  # the synthetic captions and the 50 common ones
    assert figures["pairs", "pairs trained on"] == 300


def test_pipeline_ceiling_measures_the_pipeline_on_a_null_env_shaped_like_the_real_one():
    result = subprocess.run([sys.executable, "benchmarks/pipeline_ceiling.py", "--num-workers", "1",
                             "--num-envs-per-worker", "4", "--batch-size", "256", "--seconds", "2",
                             "--warmup", "0.5"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    row = next(line.strip("|").split("|") for line in result.stdout.splitlines()
               if line.startswith("| 1x4x256 | now |"))
    sps, process_us, main_us, learner_us, workers_us, cores, lag = (
        float(value.replace(",", "")) for value in row[2:])
    assert (min(sps, process_us, main_us, learner_us, cores) > 0
            and workers_us >= 0 and lag >= 0)  # /proc: 10 ms ticks
    assert "ESTIMATE for 16 cores" in result.stdout
    # the null env gives what envs.NetHackTask gives: observation keys, shapes, dtypes, the info and episode
    # keys
    sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
    import envs
    from pipeline_ceiling import NullEnv
    task = "NetHackScoreExtendedActions-v1"
    real, null = envs.make_env(task, seed=1, max_episode_steps=2), NullEnv(task, seed=1, max_episode_steps=2)
    spec = {k: (space.shape, space.dtype) for k, space in real.observation_space.spaces.items()}
    for env in (real, null):
        obs, info = env.reset()
        assert {k: (v.shape, v.dtype) for k, v in obs.items()} == spec and set(info) == {"message_count"}
    real_infos = [real.step(0)[-1] for _ in range(2)]  # the second ends the episode (its time limit)
    null_infos = [null.step(0)[-1] for _ in range(1100)]  # an end every ~1,000 steps
    null_end = next(info for info in null_infos if "episode" in info)
    assert set(null_infos[0]) == set(real_infos[0]) and set(null_end) == set(real_infos[1])
    assert set(null_end["episode"]) == set(real_infos[1]["episode"])
    real.close()


def write_classifier_run(path):  # 60 labels, wall-like messages on most steps
    labels = [(f"You kill the thing {i}!", 1, 3) for i in range(20)] + [
        (f"It's wall {i}.", 0, 500) for i in range(40)]
    with open(path / "labels.jsonl", "w") as f:
        f.writelines(f'{{"caption": "{text}", "label": {label}}}\n' for text, label, _ in labels)
    with open(path / "messages.tsv", "w") as f:
        f.write("message\tsteps\tlabel\treward_now\tpaid\tfirsts\n" + "".join(
            f"{t}\t{n}\t{label}\t0\t0\t{n / 10}\n" for t, label, n in labels))
    (path / "summary.json").write_text('{"episodes": 10}')


def test_classifier_replay_replays_a_run_s_labels_through_the_classifier_and_its_gate(tmp_path):
    """A run dir of 60 labels (wall-like messages on most steps) replayed: the trainer's schedule, a gate
    verdict per burst, and the shares of pay and steps the classifier gives each class of its labels."""
    write_classifier_run(tmp_path)
    subprocess.run(["gzip", "-n", "-9", str(tmp_path / "labels.jsonl")], check=True)  # as results/ keeps it
    result = subprocess.run([sys.executable, "benchmarks/classifier_replay.py", str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    row = next(line.strip("|").split("|") for line in result.stdout.splitlines()
               if line.startswith("| now |"))
    steps, publications = int(row[2]), int(row[3].split(" of ")[1])
    # a first fit of 32 at 25 labels; 1.28 a label after
    assert steps == 32 + int(35 * 1.28) and publications == 3
    shares = [float(x) for cell in row[5:9] for x in cell.split("/")]
    assert len(shares) == 8 and all(0 <= share <= 1 for share in shares)
    assert shares[0] > 0  # with no console.log the labels are spread evenly (every run average was 0)
    assert "paid most against its label" in result.stdout


def test_classifier_replay_s_baseline_side_replays_on_the_baseline_tree_s_code(tmp_path):
    """tests/runs.py puts this tree first on sys.path: --baseline replayed this tree's reward_models twice.
    A copy of the method whose bursts are half as long must train half as many steps."""
    run, tree = tmp_path / "run", tmp_path / "tree"
    run.mkdir()
    write_classifier_run(run)
    shutil.copytree(ROOT, tree, ignore=lambda folder, names: [n for n in names if folder != ROOT or not (
        n.endswith(".py") or n == "label_sets.tsv")])
    code = (tree / "reward_models.py").read_text()
    assert "SMALL_SET, BURST = 25_000, 32" in code
    (tree / "reward_models.py").write_text(code.replace("BURST = 25_000, 32", "BURST = 25_000, 16"))
    script = os.path.join(ROOT, "benchmarks", "classifier_replay.py")
    result = subprocess.run([sys.executable, script, str(run), "--case", str(tree)], cwd=tree,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1])["model_steps"] == 16 + int(35 * 0.64)
    # A baseline's annotator may read labels.jsonl only plain: a gzipped run goes to it as a plain copy.
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import classifier_replay
    plain = (run / "labels.jsonl").read_bytes()
    subprocess.run(["gzip", "-n", "-9", str(run / "labels.jsonl")], check=True)
    copy = classifier_replay.plain_labels(str(run), str(tmp_path))
    assert sorted(os.listdir(copy)) == ["labels.jsonl", "messages.tsv", "summary.json"]
    assert open(os.path.join(copy, "labels.jsonl"), "rb").read() == plain


def test_learner_time_refuses_a_flag_of_the_other_mode_instead_of_ignoring_it():
    result = subprocess.run([sys.executable, "benchmarks/learner_time.py", "--update", "--batch-size", "64",
                             "--updates", "1", "--steps", "5"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.endswith("error: --steps: only without --update\n")


def test_a_baseline_git_does_not_know_stops_the_benchmark_with_a_one_line_error():
    result = subprocess.run([sys.executable, "benchmarks/classifier_replay.py", "no-run", "--baseline",
                             "no-such-rev"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stdout == ""  # before any measurement
    assert result.stderr.startswith("error: --baseline no-such-rev: not a commit git knows: ")
    assert result.stderr.count("\n") == 1


def test_pay_shares_splits_a_run_s_pay_by_its_own_labels_and_the_hand_labels(tmp_path):
    """A set of two configs, one of two seeds: pay by the run's LLM label (helpful, unhelpful, never
    labelled), by the hand labels of label_sets.tsv, to deaths, and the message paid most; a row with each
    config's seeds' mean (none for one seed), never one mixing the configs."""
    rows = [("You kill the newt!", 1, 60.0),  # hand-labelled helpful
            ("It's a wall.", 1, 20.0),  # hand-labelled unhelpful, which this run's LLM called helpful
            ("You die...", 0, 10.0), ("You die from starvation.", 0, 10.0),  # deaths: every "You die"
            ("Never mind.", 0, -10.0),  # older Ranking runs paid negative rewards: they count
            ("Some message in no set at all.", "", 10.0), ("(none)", "", 0.0)]
    for config, seed in (("cfg", 1), ("cfg", 2), ("other", 3)):
        run = tmp_path / config / f"seed{seed}"
        run.mkdir(parents=True)
        (run / "summary.json").write_text('{"episodes": 10}')
        with open(run / "messages.tsv", "w") as f:
            f.write("message\tsteps\tlabel\treward_now\tpaid\tfirsts\n" + "".join(
                f"{m}\t5\t{label}\t0\t{paid * seed}\t1\n" for m, label, paid in rows))
        if seed == 2:  # as results/ keeps it: read as the plain one
            subprocess.run(["gzip", "-n", "-9", str(run / "messages.tsv")], check=True)
    result = subprocess.run([sys.executable, "benchmarks/pay_shares.py", str(tmp_path), "--top", "1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    table = [[c.strip() for c in line.strip("|").split("|")] for line in result.stdout.splitlines()[2:]]
    assert [row[1:8] for row in table] == [["100", "80.0%", "10.0%", "10.0%", "60.0%", "30.0%", "20.0%"],
                                           ["200", "80.0%", "10.0%", "10.0%", "60.0%", "30.0%", "20.0%"],
                                           ["150", "80.0%", "10.0%", "10.0%", "60.0%", "30.0%", "20.0%"],
                                           ["300", "80.0%", "10.0%", "10.0%", "60.0%", "30.0%", "20.0%"]]
    assert table[0][8] == "'You kill the newt!' 60%" and "mean of 2" in table[2][0]
    empty = subprocess.run([sys.executable, "benchmarks/pay_shares.py", str(tmp_path / "nothing")], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert empty.returncode != 0 and empty.stderr.strip().startswith("error: no run")


def test_reward_model_cost_times_a_step_and_a_publication_on_the_run_s_own_labels(tmp_path):
    """Each reward type that trains a model, on a run's labels.jsonl and messages.tsv; a run of another type
    is one error line, not a timing of nothing."""
    kills, bites = [f"You kill the {m}!" for m in ("newt", "jackal")], ["The newt bites!", "It's a wall."]
    for reward_type, records in (
            ("ranking", [{"pair": [k, b], "preference": 1} for k in kills for b in bites]),
            ("classification", [{"caption": m, "label": int(m in kills)} for m in kills + bites]),
            ("retrieval", [])):
        run = tmp_path / reward_type
        run.mkdir()
        (run / "summary.json").write_text(json.dumps({"sessions": [{"flags": {"reward_type": reward_type}}],
                                                      "reward_model_steps": 300, "wall_time_s": 600.0}))
        (run / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        if reward_type == "ranking":  # as results/ keeps it
            subprocess.run(["gzip", "-n", "-9", str(run / "labels.jsonl")], check=True)
        (run / "messages.tsv").write_text("message\tsteps\tlabel\treward_now\tpaid\tfirsts\n" + "".join(
            f"{m}\t{10 * (i + 1)}\t\t0\t0\t{i + 1}\n" for i, m in enumerate(kills + bites)))
        result = subprocess.run([sys.executable, "benchmarks/reward_model_cost.py", str(run), "--steps", "2"],
                                cwd=ROOT, capture_output=True, text=True, timeout=300)
        if reward_type == "retrieval":
            assert result.returncode == 1 and result.stdout == "" and result.stderr.count("\n") == 1
            assert result.stderr.startswith(f"error: {run} is a retrieval run: only ranking and")
            continue
        assert result.returncode == 0, result.stderr[-2000:]
        lines = result.stdout.splitlines()
        assert lines[0] == f"{run}: {reward_type}, {len(records)} labels, 4 messages shown"
        assert lines[1].startswith("one step: ") and "one publication: " in lines[1]
        assert lines[2].startswith("the run's 300 steps: ~") and lines[2].endswith("over its 600 s")
