"""Reward models: the count normalization, the classifier and its step-weighted gate, Bradley-Terry, ranking's
pairs and normalization, resuming labels, the trainer thread, and labels of real NLE messages through the real
embedded LLM server."""
import copy
import json
import random
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from nle import nethack

import annotator
import envs
import llm_server
import reward_models as rm

MONSTERS = ["newt", "jackal", "grid bug", "lichen", "kobold", "gnome", "sewer rat", "fox",
            "goblin", "acid blob", "yellow mold", "hill orc", "dwarf", "giant rat", "gecko", "homunculus"]


def make_args(**overrides):
    args = SimpleNamespace(reward_type="none", extrinsic_coef=0.1, intrinsic_coef=0.4, reward_scale=0.1,
                           reward_clip=10.0, count_beta=3.0, raw_ranking=False, llm_url=[], llm_model=None,
                           prompt_file=None, labels_from=None, resume=None, seed=0, num_workers=1,
                           llm_threads=None)
    args.__dict__.update(overrides)
    return args


def test_count_normalization_and_mix():
    values = torch.tensor([1.0, 1.0, 1.0, 0.5])
    counts = torch.tensor([1, 2, 3, 2])
    torch.testing.assert_close(rm.count_normalized(values, counts, 3.0),
                               torch.tensor([1.0, 1 / 8, 1 / 27, 0.5 / 8]))
    args = make_args()
    paid = rm.count_normalized(torch.tensor([1.0, 0.0]), torch.tensor([2, 1]), args.count_beta)
    total = rm.mix(torch.tensor([500.0, 20.0]), paid, args)
    # 0.1 * clip(500 * 0.1, -10, 10) + 0.4 * 1 / 2^3 ; 0.1 * 2
    torch.testing.assert_close(total, torch.tensor([1.0 + 0.05, 0.2]))


def good_or_bad(rng, monsters):
    """Messages whose label is obvious, with the monster/amount as the varying part."""
    m, n = rng.choice(monsters), int(rng.integers(2, 90))
    templates = [(f"You kill the {m}!", 1), (f"You see here {n} gold pieces.", 1),
                 (f"You destroy the {m}!", 1), (f"The {m} bites!", 0), (f"You miss the {m}.", 0),
                 (f"The {m} misses!", 0)]
    return templates[int(rng.integers(len(templates)))]


def test_classifier_fits_its_labels_and_generalizes_to_new_monsters():
    torch.manual_seed(0)
    random.seed(0)
    rng = np.random.default_rng(0)
    train_monsters, held_out = MONSTERS[:12], MONSTERS[12:]
    model = rm.IntrinsicReward(make_args(reward_type="classification"), "cpu")
    # untrained
    assert model.piece.score(rm.to_rows(["You kill the newt!"]), ["You kill the newt!"]).item() == 0.0
    # a skewed label set (few positives) checks the class balancing
    data = dict(good_or_bad(rng, train_monsters) for _ in range(400))
    positives = [t for t, v in data.items() if v == 1][:15]
    data = {t: v for t, v in data.items() if v == 0 or t in positives}
    model.add_labels([{"caption": t, "label": v} for t, v in data.items()])
    model.piece.train_now(250, batch_size=64)
    texts = list(data)
    train_pred = model.piece.score(rm.to_rows(texts), texts)
    train_acc = (train_pred == torch.tensor([float(data[t]) for t in texts])).float().mean().item()
    assert train_acc > 0.95
    test = dict(good_or_bad(rng, held_out) for _ in range(100))
    test_texts = list(test)
    test_pred = model.piece.score(rm.to_rows(test_texts), test_texts)
    assert (test_pred == torch.tensor([float(test[t]) for t in test_texts])).float().mean().item() > 0.85


def test_bradley_terry_recovers_a_known_order_from_noisy_pairs():
    torch.manual_seed(0)
    random.seed(0)
    messages = ["You die...", "The jackal bites!", "It's a wall.", "You find a hidden door.",
                "You see here 9 gold pieces.", "You kill the newt!", "Welcome to experience level 2."]
    model = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    records = []
    for _ in range(3000):  # true order = list order; 15% of answers flipped, some ties
        i, j = random.sample(range(len(messages)), 2)
        answer = 1 if i > j else 2
        if random.random() < 0.15:
            answer = 3 - answer
        if random.random() < 0.05:
            answer = None
        records.append({"pair": [messages[i], messages[j]], "preference": answer})
    model.add_labels(records)
    model.piece.train_now(300, batch_size=128)
    with torch.no_grad():
        scores = model.piece.model(rm.to_rows(messages)).tolist()
    assert scores == sorted(scores), scores


def test_ranking_reward_is_a_step_weighted_z_score_paid_above_its_bar():
    norm = rm.RankingNorm()
    assert norm(torch.tensor([3.0])).item() == 0.0  # no statistics yet: no reward
    norm.fit(torch.tensor([0.0, 0.2]), torch.ones(2))  # a model that does not tell them apart yet
    assert norm(torch.tensor([0.0, 0.2])).tolist() == [0.0, 0.0]
    values = torch.arange(8.0)
    norm.fit(values, torch.ones(8))
    standardized = (values - values.mean()) / values.std(unbiased=False)
    expected = torch.where(standardized > rm.RANKING_BAR, standardized, torch.zeros(8))  # 7: z 1.53
    torch.testing.assert_close(norm(values), expected)
    # per step, not per distinct message: the mean and std are weighted by steps
    norm.fit(torch.tensor([0.0, 1.0]), torch.tensor([9, 1]))
    assert norm.mean == pytest.approx(0.1) and norm.std == pytest.approx(0.3)
    torch.testing.assert_close(norm(torch.tensor([0.0, 1.0])), torch.tensor([0.0, 3.0]))
    norm.fit(torch.tensor([0.0, 1.0]), torch.tensor([999, 1]))  # a rare message is clipped at 5 std
    assert norm(torch.tensor([1.0])).item() == rm.RANKING_CLIP
    norm.fit(values, torch.ones(8), median=True)  # offline Motif's rule: above the weighted median (3)
    torch.testing.assert_close(norm(values), torch.where(values > 3.0, standardized, torch.zeros(8)))
    torch.manual_seed(0)
    model = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    model.add_labels([{"pair": ["a", "b"], "preference": 1}])
    assert model.piece.score(rm.to_rows(["a"]), ["a"]).item() == 0.0  # untrained: no reward
    model.piece.train_now(1, batch_size=8)
    assert model.piece.score(rm.to_rows(["a"]), ["a"]).item() == 0.0  # trained, no statistics yet: no reward
    texts = [f"message {i}" for i in range(64)]
    rows = rm.to_rows(texts)
    raw_model = rm.IntrinsicReward(make_args(reward_type="ranking", raw_ranking=True), "cpu")
    raw_model.load_state_dict(model.state_dict())
    raw = raw_model.piece.score(rows, texts)
    with torch.no_grad():
        torch.testing.assert_close(raw, model.piece.model(rows))  # the reference's raw output


def test_empty_message_gets_no_intrinsic_reward():
    model = rm.IntrinsicReward(
        make_args(reward_type="retrieval", intrinsic_coef=1.0, extrinsic_coef=0.0), "cpu")
    model.add_labels([{"caption": "", "label": 1}, {"caption": "You kill the newt!", "label": 1}])
    messages = rm.to_rows(["", "You kill the newt!", "It's a wall."]).view(3, 1, 256)
    rewards, _, _ = model.rewards(torch.zeros(3, 1), messages, torch.ones(3, 1, dtype=torch.int32),
                               torch.zeros(3, 1, dtype=torch.bool))
    assert rewards[:, 0].tolist() == [0.0, 1.0, 0.0]


def test_messages_tsv_counts_steps_and_what_each_message_paid(tmp_path):
    model = rm.IntrinsicReward(
        make_args(reward_type="retrieval", intrinsic_coef=1.0, extrinsic_coef=0.0), "cpu")
    model.add_labels([{"caption": "You kill the newt!", "label": 1}, {"caption": "It's a wall.", "label": 0}])
    texts = ["You kill the newt!", "It's a wall.", "", "You kill the newt!", "You kill the newt!"]
    # the second kill: seen twice this episode
    counts = torch.tensor([[1], [1], [1], [2], [1]], dtype=torch.int32)
    for _ in range(2):
        model.rewards(torch.zeros(5, 1), rm.to_rows(texts).view(5, 1, 256), counts,
                      torch.zeros(5, 1, dtype=torch.bool))
    model.write_messages(tmp_path / "messages.tsv")
    rows = [line.split("\t") for line in open(tmp_path / "messages.tsv").read().splitlines()]
    assert rows[0] == ["message", "steps", "label", "reward_now", "paid", "firsts"]
    # per batch the kills paid 1 + 1/8 + 1: R / N^3 summed over steps, not over distinct messages; firsts, the
    # pay weight, is the same sum with R = 1 whatever the label (a wall seen first twice: 2)
    assert rows[1:] == [["You kill the newt!", "6", "1", "1.0000", "4.2500", "4.2500"],
                        ["(none)", "2", "", "0.0000", "0.0000", "2.0000"],
                        ["It's a wall.", "2", "0", "0.0000", "0.0000", "2.0000"]]


def test_message_counts_hold_no_object_the_garbage_collector_walks():
    """Guards: a [steps, paid] list a message made every full GC pass walk 1e6 lists at paper scale (0.2-0.3 s
    pauses of the learner); the counts are now two dicts of numbers: a new message adds no object the
    collector tracks."""
    import gc
    model = rm.IntrinsicReward(
        make_args(reward_type="retrieval", intrinsic_coef=1.0, extrinsic_coef=0.0), "cpu")
    model.add_labels([{"caption": "You kill the newt!", "label": 1}])
    texts = ["You kill the newt!", "It's a wall.", ""]
    model.rewards(torch.zeros(3, 1), rm.to_rows(texts).view(3, 1, 256), torch.ones(3, 1, dtype=torch.int32),
                  torch.zeros(3, 1, dtype=torch.bool))
    many = [f"You see here {i} gold pieces." for i in range(2000)]
    gc.collect()
    before = len(gc.get_objects())
    model.rewards(torch.zeros(2000, 1), rm.to_rows(many).view(2000, 1, 256),
                  torch.ones(2000, 1, dtype=torch.int32), torch.zeros(2000, 1, dtype=torch.bool))
    gc.collect()
    assert len(gc.get_objects()) - before < 100 and len(model.seen) == 2003  # a list a message: 2,000 more
    for text in many:
        del model.seen[text], model.paid[text], model.firsts[text]
    assert model.seen == {t: 1 for t in texts} and model.paid == {
        "You kill the newt!": 1.0, "It's a wall.": 0.0, "": 0.0}
    state = model.state_dict()
    assert isinstance(state["seen"][1], np.ndarray)  # arrays: a tenth of the objects to pickle


def test_a_labelled_caption_answered_unparseable_later_is_not_asked_again():
    model = rm.IntrinsicReward(make_args(reward_type="retrieval"), "cpu")
    model.add_labels([{"caption": "You kill the newt!", "label": 1},
                      {"caption": "You kill the newt!", "label": None},
                      {"caption": "It's a wall.", "label": None}])
    assert model.piece.labels == {"You kill the newt!": 1.0}
    assert list(model.requests.asked) == ["It's a wall."]


def test_resume_reloads_labels_without_asking_again(tmp_path, monkeypatch):
    with open(tmp_path / annotator.LABELS_FILE, "w") as f:
        f.write(json.dumps({"caption": "You kill the newt!", "label": 1}) + "\n")
        f.write(json.dumps({"pair": ["It's a wall.", "You kill the newt!"], "preference": 2}) + "\n")
    saved = rm.IntrinsicReward(make_args(reward_type="retrieval"), "cpu")  # the run that wrote the checkpoint
    saved.add_labels(annotator.read_labels(tmp_path / annotator.LABELS_FILE))
    saved.rewards(torch.zeros(3, 1), to_rows_batch(["You kill the newt!"] * 2 + ["It's a wall."]),
                  torch.tensor([[1], [2], [1]], dtype=torch.int32), torch.zeros(3, 1, dtype=torch.bool))
    model = rm.IntrinsicReward(make_args(reward_type="retrieval"), "cpu")  # its resume
    model.add_labels(annotator.read_labels(tmp_path / annotator.LABELS_FILE))  # as the learner does on resume
    model.load_state_dict(saved.state_dict())
    assert (model.seen, model.paid, model.firsts) == (saved.seen, saved.paid, saved.firsts)  # messages.tsv's
    assert model.piece.labels == {"You kill the newt!": 1.0}
    assert model.piece.pairs == [("It's a wall.", "You kill the newt!", 0.0)]
    assert model.known_keys() == {"You kill the newt!",  # either order is known
                                  annotator.item_key(("It's a wall.", "You kill the newt!")),
                                  annotator.item_key(("You kill the newt!", "It's a wall."))}
    model.rewards(torch.zeros(2, 1), rm.to_rows(["You kill the newt!", "It's a wall."]).view(2, 1, 256),
                  torch.ones(2, 1, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.bool))
    # the labelled caption is not asked again; the other goes with its pay weight over the run, resumes
    # included
    assert model.requests.label_requests() == ({"It's a wall.": 2.0}, {})
    # a trained model: the labels given back before its checkpoint are not new, and owe no training
    monkeypatch.setattr(rm, "BURST", 2)
    pairs = [{"pair": [f"The {m} bites!", f"You kill the {m}!"], "preference": 2} for m in MONSTERS]
    trained = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    trained.add_labels(pairs)
    assert trained.piece.train_now(batch_size=8) == 2  # the first fit
    resumed = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    resumed.add_labels(pairs)
    resumed.load_state_dict(trained.state_dict())
    assert resumed.piece.train_now(batch_size=8) == 0 and resumed.train_stats()["reward_model_steps"] == 2
    resumed.add_labels(pairs[:8])
    assert resumed.piece.train_now(batch_size=8) == 2  # 0.32 steps per new label, at most BURST


def real_nle_messages(n=6):
    """Messages from a real game: moving, searching, kicking, eating, walls."""
    env = envs.make_env("NetHackScoreExtendedActions-v1", seed=0)
    env.reset()
    rng = np.random.default_rng(0)
    seen = []
    for _ in range(3000):
        obs, _, term, trunc, _ = env.step(int(rng.integers(28)))
        text = envs.message_bytes(obs["message"]).decode("latin-1")
        if text and text not in seen and not text.endswith(("? ", "?")):
            seen.append(text)
        if term or trunc:
            env.reset()
        if len(seen) >= n:
            break
    env.close()
    return seen


def test_real_nle_messages_are_labelled_by_the_embedded_server_and_reach_the_learner(tmp_path):
    messages = real_nle_messages() + ["You kill the newt!"]
    model = rm.IntrinsicReward(
        make_args(reward_type="retrieval", intrinsic_coef=1.0, extrinsic_coef=0.0), "cpu")
    client = annotator.LabelClient(model.args)
    # no --llm-url: starts the embedded llama.cpp server
    client.start(str(tmp_path), known=model.known_keys(), asks=model.piece.asks)
    try:
        rows = rm.to_rows(messages).view(len(messages), 1, 256)
        counts = torch.ones(len(messages), 1, dtype=torch.int32)
        ended = torch.zeros(len(messages), 1, dtype=torch.bool)
        model.rewards(torch.zeros(len(messages), 1), rows, counts, ended)
        client.request(*model.requests.label_requests())  # asks the LLM
        deadline = time.time() + 180
        while len(model.piece.labels) < len(messages) and time.time() < deadline:
            time.sleep(0.5)
            model.add_labels(client.new_records())  # the learner's incremental read of new labels
        assert set(model.piece.labels) == set(messages)
        assert model.piece.labels["You kill the newt!"] == 1.0
        rewards, _, _ = model.rewards(torch.zeros(len(messages), 1), rows, counts, ended)
        assert rewards[:, 0].tolist() == [model.piece.labels[m] for m in messages]
    finally:
        client.close()
    assert client.stats()["labels"] == len(messages)
    assert len(open(tmp_path / annotator.LABELS_FILE).readlines()) == len(messages)


def test_ranking_pairs_are_answered_by_the_embedded_server_with_a_real_preference(tmp_path):
    """Ranking's pairs through the real embedded llama.cpp server (the fake server is for faults): drawn from
    the pool, asked, answered from the model's scores (restricted greedy tokens), trained on once a draw. Each
    pairs a helpful message with an unhelpful one; the model prefers the helpful one, and the reward model
    trained on the answers ranks it higher."""
    kill, wall, gold = "You kill the newt!", "It's a wall.", "You see here 5 gold pieces."  # 3 scores of ~5 s
    model = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    requests = model.requests  # what the LLM is asked
    client = annotator.LabelClient(model.args)
    # no --llm-url: the embedded llama.cpp server
    client.start(str(tmp_path), known=model.known_keys(), asks=model.piece.asks)
    try:
        for pool in ([kill, wall], [wall, gold]):  # one pair each, drawn 8 times: asked once
            requests.pair_pool, requests.batches_to_pair = pool, 1
            captions, pairs = requests.label_requests()
            assert captions == {} and len(pairs) == 1
            client.request(captions, pairs)
        deadline = time.time() + 300
        while requests.waiting and time.time() < deadline:
            time.sleep(0.5)
            model.add_labels(client.new_records())
    finally:
        client.close()
    assert not requests.waiting and client.stats()["answers_scored"] == 0  # scores by bisection: llama.cpp's
    # log-probabilities cost ~7 labels a score
    helpful = {kill, gold}
    trained = model.piece.pairs
    assert len(trained) == 2 * rm.PAIRS_PER_BATCH
    assert {frozenset(p[:2]) for p in trained} == {frozenset((kill, wall)), frozenset((wall, gold))}
    assert all(p == float(a in helpful) for a, b, p in trained), trained  # the helpful one preferred: no tie
    torch.manual_seed(0)
    model.piece.train_now(100, batch_size=16)
    with torch.no_grad():
        kill_r, wall_r, gold_r = model.piece.model(rm.to_rows([kill, wall, gold])).tolist()
    assert kill_r > wall_r and gold_r > wall_r


def test_llm_server_commands_and_errors(tmp_path, monkeypatch):
    cmd = llm_server.build_command("llama_cpp", None, "127.0.0.1", 8123, threads=2)
    assert cmd[1:3] == ["-m", "llama_cpp.server"] and cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[cmd.index("--model") + 1].endswith(".gguf")
    # Its server's default computes every prompt token's logits over Gemma's 262k words: a label cost 2.5x
    # (issue 44).
    assert cmd[cmd.index("--logits_all") + 1] == "false"
    with pytest.raises(SystemExit, match="model file /nope.gguf does not exist"):
        llm_server.build_command("llama_cpp", "/nope.gguf", "127.0.0.1", 1)
    with pytest.raises(SystemExit, match="unknown backend"):
        llm_server.build_command("tgi", None, "127.0.0.1", 1)
    real_find_spec = llm_server.importlib.util.find_spec
    monkeypatch.setattr(llm_server.importlib.util, "find_spec",
                        lambda name: object() if name == "vllm" else real_find_spec(name))
    cmd = llm_server.build_command("vllm", "meta-llama/Llama-3.1-8B-Instruct", "0.0.0.0", 9001,
                                   tensor_parallel_size=2)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--model") + 1] == "meta-llama/Llama-3.1-8B-Instruct"
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    with pytest.raises(SystemExit, match="model path ./missing-model does not exist"):
        llm_server.build_command("vllm", "./missing-model", "127.0.0.1", 1)
    monkeypatch.setattr(llm_server.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="backend vllm is not installed: pip install vllm"):
        llm_server.build_command("vllm", "x/y", "127.0.0.1", 1)


def test_motif_trains_offline_from_pairs_then_stays_frozen(tmp_path):
    torch.manual_seed(0)
    random.seed(0)
    good, bad = "You kill the newt!", "It's a wall."
    path = tmp_path / "pairs.jsonl"
    with open(path, "w") as f:  # every pair decisive: the preferred message is half of the file's messages
        for _ in range(300):
            f.write(json.dumps({"pair": [good, bad], "preference": 1}) + "\n")
            f.write(json.dumps({"pair": [bad, good], "preference": 2}) + "\n")
    model = rm.IntrinsicReward(make_args(reward_type="motif", labels_from=str(path), raw_ranking=True), "cpu")
    assert model.requests.label_requests() == ({}, {})  # no LLM at training time
    frozen = {k: v.clone() for k, v in model.piece.model.state_dict().items()}
    model.add_labels([{"pair": [bad, good], "preference": 1}])
    assert model.piece.train_now() == 0
    assert all(torch.equal(v, model.piece.model.state_dict()[k]) for k, v in frozen.items())
    scores = model.piece.score(rm.to_rows([good, bad]), [good, bad])
    assert scores[0] > scores[1]
    # normalized: statistics taken once over the dataset's messages, not moved by what the agent sees
    model = rm.IntrinsicReward(make_args(reward_type="motif", labels_from=str(path)), "cpu")
    frozen = dict(model.piece.published["norm"])
    rewards, _, _ = model.rewards(*steps_of([(good, 3), (bad, 300), ("You hear a door open.", 100)]))
    model.piece.train_now()
    assert model.piece.published["norm"] == frozen
    R = model.piece.score(rm.to_rows([good, bad]), [good, bad])
    assert R.tolist() == [pytest.approx(1.0, abs=1e-3), 0.0]  # above the median, z = 1 (Ranking's bar: 0)
    with pytest.raises(SystemExit, match="motif needs --labels-from"):
        rm.IntrinsicReward(make_args(reward_type="motif"), "cpu")


def test_ranking_pair_pool_is_a_bounded_uniform_sample(monkeypatch):
    monkeypatch.setattr(rm, "PAIR_POOL_SIZE", 50)
    model = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    for i in range(5000):
        model.requests.add_to_pool(str(i))
    kept = [int(t) for t in model.requests.pair_pool]
    assert len(kept) == 50 and len(set(kept)) == 50
    assert 1500 < np.mean(kept) < 3500  # uniform over all 5000, not the first or the last 50
    restored = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    restored.load_state_dict(model.state_dict())
    assert restored.requests.pair_pool == model.requests.pair_pool and restored.requests.pool_offers == 5000


class InThreadClient:
    """The learner's side of an annotator run in a thread (`annotator.serve` on plain containers)."""

    def __init__(self, annotator_thread):
        self.annotator, self.read = annotator_thread, 0

    def check(self):  # a thread does not die: nothing to restart
        return None

    def request(self, captions, pairs):
        self.annotator.send(captions, pairs)

    def new_records(self):
        records = self.annotator.log[self.read:]
        self.read += len(records)
        return records


def steps_of(messages):
    """[(text, steps)] -> the [T, 1, ...] tensors of a learner batch, shuffled."""
    texts = [t for t, k in messages for _ in range(k)]
    random.Random(0).shuffle(texts)
    T = len(texts)
    return (torch.zeros(T, 1), rm.to_rows(texts).view(T, 1, 256), torch.ones(T, 1, dtype=torch.int32),
            torch.zeros(T, 1, dtype=torch.bool))


# a learner batch: (message, steps showing it); kills and gold are rare, as in real play
STEPS = ([("", 300), ("It's a wall.", 400), ("You hear a door open.", 150)]
         + [(f"The {m} bites!", 8) for m in MONSTERS[:12]]
         + [(f"You miss the {m}.", 3) for m in MONSTERS[:12]]
         + [(f"You see here {n} gold pieces.", 1) for n in range(2, 12)]
         + [(f"You kill the {m}!", 1) for m in MONSTERS[:6]])
PREFERRED = [i for i, (t, _) in enumerate(STEPS) if "kill" in t or "gold" in t]


def test_ranking_rewards_are_bounded_z_scores_from_the_first_rewarded_update(tmp_path):
    """The early edge: a server that prefers kills and gold, 60 learner updates from an untrained model on the
    reference's schedule (8 labelled pairs an update, pairs already answered reused: rewarded from update
    26)."""
    from fake_openai import FakeOpenAI
    from test_annotator import Annotator
    torch.manual_seed(0)
    server = FakeOpenAI().start()
    thread = Annotator(server.url, tmp_path)
    model = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    client = InThreadClient(thread)
    batch = steps_of(STEPS)
    texts = [t for t, _ in STEPS]
    rewarded_updates = 0
    try:
        for update in range(60):  # the learner's loop, with the reward model trained inline
            model.rewards(*batch)
            client.request(*model.requests.label_requests())
            thread.wait_for(
                lambda: thread.stats.get("backlog", 1) == 0 and thread.stats.get("in_flight", 1) == 0, 5)
            model.add_labels(client.new_records())
            model.piece.train_now()
            R = model.piece.score(rm.to_rows(texts), texts)
            if R.abs().sum() > 0:
                rewarded_updates += 1
                assert R.abs().max().item() <= rm.RANKING_CLIP  # was 20.7 at update 20 before the fix
                assert R[1].item() == 0  # the wall, unhelpful, ties its unhelpful pairs
    finally:
        thread.close()
        server.stop()
    assert rewarded_updates >= 10
    steps = torch.tensor([k for _, k in STEPS], dtype=torch.float)
    preferred = torch.zeros(len(STEPS), dtype=torch.bool)
    preferred[PREFERRED] = True
    others = ~preferred
    others[0] = False  # the empty message
    per_step = lambda where: ((R * steps)[where].sum() / steps[where].sum()).item()
    assert per_step(preferred) > 1.0 and per_step(preferred) > 10 * per_step(others), (
        per_step(preferred), per_step(others))


@pytest.mark.parametrize("seed", [1, 2])
def test_a_classifier_pays_only_once_it_tells_its_labels_apart(seed):
    """Issue 12's start: 2 helpful labels, then one unhelpful label per update. Before, the first fit
    on one class (or one barely trained fit) paid every message on these seeds."""
    torch.manual_seed(seed)
    model = rm.IntrinsicReward(make_args(reward_type="classification", seed=seed), "cpu")
    helpful = ["You kill the newt!", "You see here 5 gold pieces."]
    unhelpful = ["It's a wall.", "You die..."] + [f"The {m} bites!" for m in MONSTERS] + [
        f"You miss the {m}." for m in MONSTERS]

    def paid_sensibly(seen):
        R = model.piece.score(rm.to_rows(helpful + seen), helpful + seen)
        return not R.any() or (R[:2].sum() >= 1 and R[2:].mean() <= 0.1)

    model.add_labels([{"caption": c, "label": 1} for c in helpful])
    # one class: nothing to learn a boundary from
    assert model.piece.train_now() == 0 and model.piece.model_steps == 0
    for u, caption in enumerate(unhelpful):
        model.add_labels([{"caption": caption, "label": 0}])
        model.piece.train_now()
        assert paid_sensibly(unhelpful[:u + 1]), u
    per_label = rm.Classification.steps_per_label
    assert model.piece.model_steps == rm.BURST + int((len(unhelpful) - 1) * per_label)  # 32, then
    # 1.28 a label
    for _ in range(300):
        model.piece.train_now(1)
        if model.piece.published["fitted"]:
            break
    assert model.piece.published["fitted"] and paid_sensibly(unhelpful)
    R = model.piece.score(rm.to_rows(helpful + unhelpful), helpful + unhelpful)
    assert R.sum() >= 1  # and, fitted, it does pay


def test_a_fitted_classifier_keeps_paying_when_helpful_labels_are_rare():
    """2 helpful labels among 302, each helpful message in 30 episodes, each unhelpful one in 1: half of a
    training minibatch of 256 often holds none. Whether the model pays is judged on the published model over
    the labels, not on the last minibatch (which switched the reward off in ~1 of 8 bursts)."""
    torch.manual_seed(0)
    model = rm.IntrinsicReward(make_args(reward_type="classification"), "cpu")
    helpful, unhelpful = ["You kill the newt!", "You see here 5 gold pieces."], [
        f"The thing {i} bites!" for i in range(300)]
    model.add_labels([{"caption": c, "label": 1} for c in helpful]
                     + [{"caption": c, "label": 0} for c in unhelpful])
    model.rewards(*sightings_of([(c, 30, 30) for c in helpful] + [(c, 1, 1) for c in unhelpful]))
    model.piece.optimizer.param_groups[0]["lr"] = 1e-3
    for _ in range(30):
        model.piece.train_now(10)
        if model.piece.published["fitted"]:
            break
    # then the real one: a step of 1e-3 once paid 97 of the unhelpful labels, and the gate rightly stopped it
    model.piece.optimizer.param_groups[0]["lr"] = 1e-4
    fitted = []
    for _ in range(30):
        model.piece.train_now(1)
        fitted.append(model.piece.published["fitted"])
    assert all(fitted), fitted
    R = model.piece.score(rm.to_rows(helpful + unhelpful[:20]), helpful + unhelpful[:20])
    assert R[:2].tolist() == [1.0, 1.0] and not R[2:].any()


class Judge(torch.nn.Module):
    """A stand-in classifier: it calls helpful exactly the messages in `helpful`."""

    def __init__(self, helpful):
        super().__init__()
        self.helpful = set(helpful)

    def forward(self, rows):
        texts = [bytes(row).rstrip(b"\0").decode("latin-1") for row in rows.tolist()]
        return torch.tensor([[0.0, 1.0] if t in self.helpful else [1.0, 0.0] for t in texts])


# a run's labelled messages over 100 episodes, as in results/free_1m_rerun's Classification seeds: (message,
# steps, first sightings in an episode, label). Pay follows the first sightings: the walls and prompts are on
# most steps and in every episode; "You feel better." on 0.3% of the steps but in half the episodes; a doorway
# bumped into 3,000 times in 5 episodes; the helpful messages rare
WALL, KILL, FEEL = "It's a wall.", "You kill the newt!", "You feel better."
DOORWAY = "You can't move diagonally out of an intact doorway."
LABELLED = ([(WALL, 12000, 100, 0), ("It's solid stone.", 4000, 100, 0), ("Never mind.", 1800, 100, 0),
             ("Are you sure you want to pray? [yn] (n)", 4000, 100, 0),
             ("You can't go up here.", 1300, 100, 0), (DOORWAY, 3000, 5, 0), (FEEL, 70, 50, 0),
             ("You die...", 50, 40, 0)]
            + [(f"The {m} bites!", 10, 8, 0) for m in MONSTERS]
            + [(f"You miss the {m}.", 5, 4, 0) for m in MONSTERS]
            + [("The door opens.", 30, 27, 1), ("You see here a lichen corpse.", 30, 25, 1), (KILL, 10, 9, 1),
               ("You see here 5 gold pieces.", 8, 8, 1), ("You kill the jackal!", 6, 6, 1),
               ("Welcome to experience level 2.", 3, 3, 1), ("You find a hidden passage.", 2, 2, 1)])
HELPFUL = [t for t, *_, label in LABELLED if label]
GATE_WEIGHT = {t: firsts for t, _, firsts, _ in LABELLED}  # the gate's weight of a label seen: its pay weight


def sightings_of(messages):
    """[(text, steps, first sightings)] -> the [T, 1, ...] tensors of a learner batch: the first sightings
    count 1, the other steps are their message's 1,000th sighting in the episode (a pay weight of 1e-9
    each)."""
    texts = [t for t, k, _ in messages for _ in range(k)]
    counts = [n for _, k, firsts in messages for n in [1] * firsts + [1000] * (k - firsts)]
    T = len(texts)
    return (torch.zeros(T, 1), rm.to_rows(texts).view(T, 1, 256),
            torch.tensor(counts, dtype=torch.int32).view(T, 1), torch.zeros(T, 1, dtype=torch.bool))


def labelled_seen(**overrides):
    """A classification learner that has the labels of LABELLED and has seen their steps."""
    model = rm.IntrinsicReward(make_args(reward_type="classification", **overrides), "cpu")
    model.add_labels([{"caption": t, "label": label} for t, *_, label in LABELLED])
    model.rewards(*sightings_of([(t, k, firsts) for t, k, firsts, _ in LABELLED]))
    return model


# the gate's verdict on a model; fresh: no hysteresis from the last one
def publish(piece, judge, fresh=True):
    piece.model, piece.published = judge, None if fresh else piece.published
    piece.publish()
    return piece.published["fitted"]


class Ranker(torch.nn.Module):
    """A stand-in ranking model: the output of each message is given (0 for the rest)."""

    def __init__(self, values):
        super().__init__()
        self.values = values

    def forward(self, rows):
        texts = [bytes(row).rstrip(b"\0").decode("latin-1") for row in rows.tolist()]
        return torch.tensor([self.values.get(t, 0.0) for t in texts])


def test_the_learner_pays_each_step_the_published_model_s_verdict_over_n_beta():
    """What rewards() pays the steps of a learner batch once a trained model is published (whatever its rule):
    R of the step's own message / N^beta, mixed with c_int. Classification: R = 1 for what its classifier
    calls helpful, 0 for the rest. Ranking: R grows with the model's output; nothing for the message it ranks
    lowest (the most frequent one here) and some for the one it ranks highest, over the steps' statistics."""
    texts = [KILL, KILL, WALL, "", HELPFUL[1], "You miss the newt."]
    counts = torch.tensor([[1], [2], [1], [1], [3], [1]], dtype=torch.int32)
    batch = (torch.zeros(6, 1), to_rows_batch(texts), counts, torch.zeros(6, 1, dtype=torch.bool))
    model = labelled_seen()
    assert publish(model.piece, Judge(HELPFUL))  # exactly right: the gate is on
    rewards, paid, _ = model.rewards(*batch)
    assert paid[:, 0].tolist() == pytest.approx([1.0, 1 / 8, 0.0, 0.0, 1 / 27, 0.0])
    torch.testing.assert_close(rewards, 0.4 * paid)

    model = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    values = {t: -2.0 for t, *_ in LABELLED}  # unhelpful: low, the wall lowest
    values.update({WALL: -3.0, **{t: 1.0 + i for i, t in enumerate(HELPFUL)}})  # helpful higher, last most
    model.rewards(*steps_of([(t, k) for t, k, *_ in LABELLED]))  # the steps of its statistics
    model.piece.model = Ranker(values)
    model.piece.publish()
    ranked = sorted(values, key=values.get)
    _, paid, _ = model.rewards(torch.zeros(len(ranked), 1), to_rows_batch(ranked), torch.ones(len(ranked), 1,
                               dtype=torch.int32), torch.zeros(len(ranked), 1, dtype=torch.bool))
    R = paid[:, 0]
    assert R[0] == 0 and R[-1] > 0 and (R[1:] >= R[:-1]).all(), dict(zip(ranked, R.tolist()))
    _, paid, _ = model.rewards(*batch)  # at N: R / N^beta
    expected = [R[ranked.index(t)].item() / n ** 3 if t else 0.0
                for t, n in zip(texts, counts[:, 0].tolist())]
    assert paid[:, 0].tolist() == pytest.approx(expected) and paid[0, 0] > 0
    # statistics over steps, not distinct messages: beside a wall on 88% of the steps the kills stand out (z
    # 2.9); counted once a message, among 15 lower and 10 higher ones, they would not (z 1.2)
    model = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    low, high = [f"The thing {i} bites!" for i in range(15)], [f"You kill the thing {i}!" for i in range(10)]
    model.rewards(*steps_of([(WALL, 180)] + [(t, 1) for t in low + high]))
    model.piece.model = Ranker({WALL: 0.0, **dict.fromkeys(low, -1.0), **dict.fromkeys(high, 1.0)})
    model.piece.publish()
    R = model.piece.score(rm.to_rows([WALL, high[0]]), [WALL, high[0]])
    assert R[0] == 0 and R[1] > 0, R


def to_rows_batch(texts):
    return rm.to_rows(texts).view(len(texts), 1, 256)


def test_the_classifier_gate_judges_where_its_pay_would_go():
    """Before: on once 90% of each class's steps were told apart. Seed 2 of results/free_1m_rerun paid "You
    feel better." (0.2% of its steps, labelled unhelpful) 6% of all it paid: a message pays most at its first
    sighting in an episode. Now judged on pay: 90% of the helpful labels' pay paid, 90% of what it would pay
    to helpful labels."""
    model = labelled_seen()
    texts = [t for t, *_ in LABELLED]
    unhelpful_steps = sum(k + 1 for _, k, _, label in LABELLED if not label)
    assert publish(model.piece, Judge(HELPFUL))
    assert 71 / unhelpful_steps < 0.01 and GATE_WEIGHT[FEEL] / (GATE_WEIGHT[FEEL] + 80) > 0.35  # helpful: 80
    assert not publish(model.piece, Judge(HELPFUL + [FEEL]))  # 99.7% of unhelpful steps told apart: old on
    assert not model.piece.score(rm.to_rows(texts), texts).any()
    assert 3001 / unhelpful_steps > 0.1 and GATE_WEIGHT[DOORWAY] / (GATE_WEIGHT[DOORWAY] + 80) < 0.1
    assert publish(model.piece, Judge(HELPFUL + [DOORWAY]))  # 87% of the unhelpful steps told apart: old off
    R = model.piece.score(rm.to_rows(texts), texts)
    assert {t for t, r in zip(texts, R.tolist()) if r} == set(HELPFUL + [DOORWAY])
    assert not publish(model.piece, Judge(HELPFUL[2:]))  # 35% of helpful pay: the most paid helpful missed
    # A label weighs its pay alone: 80 of 88 to helpful labels, on; with a floor of one, 87 of 97, off.
    assert publish(model.piece, Judge(HELPFUL + [f"You miss the {m}." for m in MONSTERS[:2]]))


def test_the_classifier_gate_does_not_flicker_near_its_bar():
    """Before: judged on a fresh random 1,024 labels a class at every publication, a model that recalled 90.5%
    was on at 146 of 200 publications and switched 79 times."""
    model = rm.IntrinsicReward(make_args(reward_type="classification"), "cpu")
    helpful = [f"You kill the thing {i}!" for i in range(100)]
    unhelpful = [f"The thing {i} bites!" for i in range(3000)]
    model.add_labels([{"caption": c, "label": 1} for c in helpful]
                     + [{"caption": c, "label": 0} for c in unhelpful])
    near = Judge(helpful + unhelpful[:11])  # 100 of 111 messages it would pay helpful (90.1%): at the bar
    assert len({publish(model.piece, near) for _ in range(20)}) == 1  # a fixed model, a fixed verdict
    rng, fitted = random.Random(0), []
    for _ in range(40):  # a model still learning: 87% to 94% of what it would pay goes to helpful labels
        judge = Judge(helpful + rng.sample(unhelpful[:1024], rng.randint(6, 15)))  # the gate's 1,024
        fitted.append(publish(model.piece, judge, fresh=False))
    assert sum(a != b for a, b in zip([False] + fitted, fitted)) == 1 and fitted[-1], fitted


def test_the_classifier_trains_half_on_the_labels_and_half_as_the_pay_shows_them(monkeypatch):
    """Before: minibatches drew the distinct labelled messages uniformly, so the message on 20% of a run's
    steps was 1 of 3,416 negatives; free_classification's classifier called "It's a wall." helpful (p 0.95)
    though labelled 0, the gate stayed shut and the run paid nothing. After a publication half of each
    minibatch follows the pay weights: by steps (before issue 33) "You feel better.", in half the episodes,
    was drawn 1 in 700."""
    model = labelled_seen()
    many = [f"The thing {i} bites!" for i in range(3000)]  # rare labels, one step each: the uniform half's
    model.add_labels([{"caption": t, "label": 0} for t in many])
    model.rewards(*sightings_of([(t, 1, 1) for t in many]))
    model.piece.train_now(1, batch_size=8)  # published: its gate sample and their pay weights
    drawn = []
    monkeypatch.setattr(rm, "outputs",
                        lambda m, texts, device: (drawn.extend(texts), torch.zeros(len(texts), 2))[1])
    for _ in range(256):  # 65,536 draws: 0.003 is 4.5 standard deviations of a share of 0.03
        model.piece.minibatch_loss(256)
    share = lambda texts: sum(t in texts for t in drawn) / len(drawn)
    # the gate's sample: all 7 helpful labels; the 40 unhelpful ones of LABELLED and 984 of `many`, each
    # weighing its pay weight; the uniform half: any of the 3,047 labels
    in_gate = rm.GATE_MESSAGES - (len(LABELLED) - len(HELPFUL))
    gate_weight, labels = sum(GATE_WEIGHT.values()) + in_gate, len(LABELLED) + len(many)
    assert share({FEEL}) == pytest.approx(0.5 * 50 / gate_weight + 0.5 / labels, abs=0.002)  # old: 0.0015
    assert share({WALL}) == pytest.approx(0.5 * 100 / gate_weight + 0.5 / labels, abs=0.003)  # old: 0.21
    assert share(set(HELPFUL)) == pytest.approx(0.5 * 80 / gate_weight + 0.5 * 7 / labels, abs=0.003)
    assert share(set(many)) == pytest.approx(0.5 * in_gate / gate_weight + 0.5 * 3000 / labels, abs=0.01)
    # a resume draws the same, but not a label that a crash took from labels.jsonl's end
    resumed = rm.IntrinsicReward(make_args(reward_type="classification"), "cpu")
    resumed.add_labels([{"caption": t, "label": label} for t, *_, label in LABELLED if t != KILL] +
                       [{"caption": t, "label": 0} for t in many])
    resumed.load_state_dict(model.state_dict())
    texts, weights = model.piece.published["frequent"]
    kept = [(t, w) for t, w in zip(texts, weights) if t != KILL]
    assert resumed.piece.published["frequent"] == tuple(zip(*kept))
    # was a KeyError in the trainer thread: the run stopped, and again on resume
    resumed.piece.minibatch_loss(256)


def test_the_classifier_gate_and_its_pay_weights_survive_a_resume():
    """The gate weighs the learner's pay weights (its firsts), which a resume gives back: without them every
    label would weigh one, and a model that pays a doorway and a miss (89.9% of its pay helpful, 7 of 9
    messages) would switch off."""
    model = labelled_seen()
    model.piece.train_now(1, batch_size=8)  # a checkpoint needs a trained model
    model.piece.published["fitted"] = True  # on, as it would be after telling its labels apart
    resumed = rm.IntrinsicReward(make_args(reward_type="classification"), "cpu")
    resumed.add_labels([{"caption": t, "label": label} for t, *_, label in LABELLED])
    resumed.load_state_dict(model.state_dict())
    assert resumed.piece.pay == model.piece.pay and resumed.piece.published["fitted"]
    assert resumed.piece.pay[DOORWAY] == pytest.approx(5) and resumed.piece.pay[WALL] == pytest.approx(100)
    between = Judge(HELPFUL + [DOORWAY, "You miss the newt."])  # 80 of 89 (89.9%) of its pay helpful
    assert publish(resumed.piece, between, fresh=False)  # on it stays above 85%...
    assert not publish(labelled_seen().piece, between)  # ...though it takes 90% to switch on


BALL = "You see here a heavy iron ball (chained to you)."


def test_the_classifier_does_not_pay_an_unhelpful_label_seen_once_in_most_episodes(monkeypatch):
    """Seed 2 of results/free_1m_rerun paid "You feel better." and the punishment ball, labelled unhelpful:
    a message on few steps but first seen in most episodes, too seldom drawn to be fitted among the helpful
    "You see here ..." messages. The ball's pay outweighs the helpful labels', so the gate stays off while the
    model would pay it: being on soon after the ball's label came takes the trainer's schedule (at 0.32 steps
    a label it fails). A third of such a run's labels, 10 at a time, the ball's the 121st; the gate judges a
    quarter of its labels a class, and the minibatches are half as large, so that it runs in a fraction of the
    time."""
    monkeypatch.setattr(rm, "GATE_MESSAGES", 256)
    torch.manual_seed(1)
    model = rm.IntrinsicReward(make_args(reward_type="classification", seed=1), "cpu")
    items = [f"{n} gold pieces" for n in range(2, 22)] + [f"a {m} corpse" for m in MONSTERS]
    labelled = ([(WALL, 12000, 100, 0), ("It's solid stone.", 4000, 100, 0), ("Never mind.", 1800, 100, 0),
                 (BALL, 80, 80, 0)] + [(f"The thing {i} bites!", 1, 1, 0) for i in range(300)]
                + [(f"You see here {x}.", 3, 3, 1) for x in items]
                + [(f"You kill the {m}!", 3, 3, 1) for m in MONSTERS])
    model.rewards(*sightings_of([(t, k, firsts) for t, k, firsts, _ in labelled]))
    records = [{"caption": t, "label": label} for t, *_, label in labelled]
    random.Random(1).shuffle(records)
    records.insert(120, records.pop(next(i for i, r in enumerate(records) if r["caption"] == BALL)))
    on = []
    for i in range(0, len(records), 10):
        model.add_labels(records[i:i + 10])
        model.piece.train_now(batch_size=128)
        if model.piece.published and BALL in model.piece.labels:
            on.append(model.piece.published["fitted"])
    helpful = [t for t, *_, label in labelled if label]
    assert model.piece.published["fitted"] and model.piece.score(rm.to_rows(helpful), helpful).all()
    assert not model.piece.score(rm.to_rows([BALL]), [BALL]).any()  # the fit, not only the gate
    assert sum(on) >= 10, on  # on while the ball is labelled: never paying it is then the model's doing


def test_ranking_trains_on_every_drawn_pair_as_often_as_the_steps_show_it():
    """Before: self-pairs were dropped (21% of drawn pairs in free_ranking), the annotator dropped a pair
    already asked (63%), and the message on 40% of the steps was in 61% of drawn pairs but 30% of the pairs
    trained on."""
    model = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    requests = model.requests  # what the LLM is asked
    shares = {WALL: 0.4, "Never mind.": 0.2, "It's solid stone.": 0.1,
              **{f"You kill the {m}!": 0.03 for m in MONSTERS[:10]}}
    requests.pair_pool = [t for t, q in shares.items() for _ in range(round(q * 1000))]
    value = {t: i for i, t in enumerate(shares)}  # the fake LLM prefers the later message
    done, asked, updates = set(), [], 300
    for _ in range(updates):
        requests.batches_to_pair = 1
        answers = []
        for pair in requests.label_requests()[1]:  # what the annotator asks: it drops a pair it answered
            if annotator.item_key(pair) not in done:
                done.add(annotator.item_key(pair))
                asked.append(pair)
                answers.append({"pair": list(pair), "preference": 1 if value[pair[0]] > value[pair[1]]
                                else 2})
        model.add_labels(answers)
    trained = model.piece.pairs
    assert len(trained) == updates * rm.PAIRS_PER_BATCH and all(a != b for a, b, _ in trained)
    # reused in either order, with its answer
    assert all(p == float(value[a] > value[b]) for a, b, p in trained)
    assert len({frozenset(pair) for pair in asked}) == len(asked)  # none asked twice, in either order
    # drawn by steps, the second again while it is the first: the wall is in 67% of the pairs
    for message, q in shares.items():
        expected = q + sum(q_x * q / (1 - q_x) for x, q_x in shares.items() if x != message)
        assert sum(message in (a, b) for a, b, _ in trained) / len(trained) == pytest.approx(
            expected, abs=0.03)


def test_a_pair_drawn_again_before_its_answer_is_asked_once_and_trained_on_every_draw():
    model = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    requests = model.requests  # what the LLM is asked
    requests.pair_pool, requests.batches_to_pair = [WALL] * 6 + [KILL] * 4, 1
    pairs = list(requests.label_requests()[1])
    assert len(pairs) == 1 and not model.piece.pairs  # 8 draws of one pair, in either order: asked once
    answer = {"pair": list(pairs[0]), "preference": 1 if pairs[0][0] == KILL else 2}
    model.add_labels([answer])
    assert len(model.piece.pairs) == 8 and all(p == float(a == KILL) for a, b, p in model.piece.pairs)
    requests.batches_to_pair = 2
    assert requests.label_requests() == ({}, {})  # answered: 16 more draws trained on, none asked
    assert len(model.piece.pairs) == 24 and all(p == float(a == KILL) for a, b, p in model.piece.pairs)
    assert model.known_keys() == {annotator.item_key((WALL, KILL)), annotator.item_key((KILL, WALL))}
    resumed = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    resumed.add_labels([answer])  # on resume the LLM's one answer comes back from labels.jsonl...
    resumed.load_state_dict(model.state_dict())  # ...and its 23 reuses from the checkpoint
    assert sorted(resumed.piece.pairs) == sorted(model.piece.pairs)


def test_pairs_waiting_for_an_answer_are_bounded_oldest_dropped(monkeypatch):
    """Guards: with an LLM far behind, ranking remembered every pair asked and unanswered (unbounded at paper
    scale); now 10 annotator backlogs' worth, the oldest dropped. A dropped pair answered later is trained on
    once."""
    monkeypatch.setattr(annotator, "MAX_BACKLOG", 5)
    model = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    requests = model.requests  # what the LLM is asked
    requests.pair_pool = [f"message {i}" for i in range(1000)]
    asked = []
    for _ in range(20):
        requests.batches_to_pair = 1
        asked += requests.label_requests()[1]
    assert len(asked) == 160 and len(requests.waiting) == 50 and list(requests.waiting) == asked[-50:]
    model.add_labels([{"pair": list(asked[0]), "preference": 1}])  # dropped long ago, answered now
    assert model.piece.pairs == [(*asked[0], 1.0)]
    oldest = next(iter(requests.waiting))  # drawn again: asked again, and the last to go
    requests.pair_pool, requests.batches_to_pair = [*oldest] * 2, 1
    requests.label_requests()
    requests.pair_pool = [f"message {i}" for i in range(1000)]
    for _ in range(6):
        requests.batches_to_pair = 1
        requests.label_requests()
    assert len(requests.waiting) == 50 and oldest in requests.waiting


def test_every_caption_seen_is_labelled_after_the_backlog_overflowed(tmp_path, monkeypatch):
    from fake_openai import FakeOpenAI
    from test_annotator import Annotator
    monkeypatch.setattr(annotator, "MAX_BACKLOG", 3)
    monkeypatch.setattr(rm, "RETRY_S", 1.0)
    server = FakeOpenAI().start()
    server.delay = 1.5  # slow: captions pile up and most are dropped from the tiny backlog
    thread = Annotator(server.url, tmp_path)
    model = rm.IntrinsicReward(make_args(reward_type="retrieval"), "cpu")
    client = InThreadClient(thread)
    captions = [f"You kill the {m}!" for m in MONSTERS] + [f"The {m} bites!" for m in MONSTERS]
    try:
        for chunk in range(4):
            model.rewards(*steps_of([(c, 2) for c in captions[chunk * 8:(chunk + 1) * 8]]))
            client.request(*model.requests.label_requests())
            time.sleep(0.2)
        assert thread.wait_for(lambda: thread.stats.get("dropped", 0) > 10, 10)
        server.delay = 0.0  # the server speeds up; the learner keeps updating on empty messages
        deadline = time.time() + 30
        while set(model.piece.labels) != set(captions) and time.time() < deadline:
            model.rewards(*steps_of([("", 4)]))
            model.exchange(client)
            time.sleep(0.1)
    finally:
        thread.close()
        server.stop()
    assert set(model.piece.labels) == set(captions)
    assert model.piece.labels == {c: float("kill" in c) for c in captions}
    assert not model.requests.asked  # nothing left waiting


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b, (a, b)


@pytest.mark.parametrize("reward_type", ["classification", "ranking"])
def test_scoring_changes_nothing(reward_type):
    """score() is pure: the weights, statistics, counters, random streams and train modes stay as they
    were."""
    torch.manual_seed(0)
    model = rm.IntrinsicReward(make_args(reward_type=reward_type), "cpu")
    model.add_labels([{"caption": f"You kill the {m}!", "label": 1} for m in MONSTERS]
                     + [{"caption": f"The {m} bites!", "label": 0} for m in MONSTERS]
                     + [{"pair": [f"You kill the {m}!", f"The {m} bites!"], "preference": 1}
                        for m in MONSTERS])
    model.piece.optimizer.param_groups[0]["lr"] = 1e-3  # fitted in a few steps
    model.rewards(*steps_of(STEPS))
    model.piece.train_now(30, batch_size=16)  # published, with statistics over the batch seen
    piece, texts = model.piece, [t for t, _ in STEPS]
    assert (piece.published.get("fitted", True)
            and piece.published.get("norm", {"mean": 0})["mean"] is not None)

    def snapshot():
        return copy.deepcopy((model.state_dict(), model.train_stats(), piece.rng.getstate(),
                              torch.get_rng_state(), piece.new_labels, piece.batches, piece.owed_steps,
                              vars(piece).get("reference"), piece.model.training,
                              piece.published["model"].training))

    before = snapshot()
    first = piece.score(rm.to_rows(texts), texts)
    assert torch.equal(first, piece.score(rm.to_rows(texts), texts))
    assert_same(before, snapshot())


def pairs_of_monsters():
    return [{"pair": [f"You kill the {m}!", f"The {m} bites!"], "preference": 1} for m in MONSTERS]


def test_the_learner_never_waits_for_the_trainer_thread_and_gets_its_weights(monkeypatch):
    monkeypatch.setattr(rm, "BURST", 2)
    torch.manual_seed(0)
    model = rm.IntrinsicReward(make_args(reward_type="ranking", raw_ranking=True), "cpu")
    model.add_labels(pairs_of_monsters())
    in_burst, release = threading.Event(), threading.Event()
    minibatch_loss = model.piece.minibatch_loss

    def held_loss(batch_size):  # a training step that lasts until the test lets it go (30 s at most)
        in_burst.set()
        release.wait(30)
        return minibatch_loss(16)

    monkeypatch.setattr(model.piece, "minibatch_loss", held_loss)
    texts = [t for t, _ in STEPS]
    model.start(share=1.0)
    try:
        assert in_burst.wait(30)
        started = time.perf_counter()
        _, paid, _ = model.rewards(*steps_of(STEPS))  # a learner update in the middle of a burst
        assert time.perf_counter() - started < 10  # it did not wait for the burst
        assert not paid.any()  # nothing published yet: the untrained model pays nothing
        release.set()
        deadline = time.time() + 60
        while model.piece.published is None and time.time() < deadline:
            time.sleep(0.05)
        scores = model.piece.score(rm.to_rows(texts), texts)  # the published weights, scoring
        assert scores.abs().sum() > 0 and model.train_stats()["reward_model_steps"] == 2
        with torch.no_grad():
            torch.testing.assert_close(scores, model.piece.published["model"](rm.to_rows(texts)))
    finally:
        release.set()
        model.close()


def test_the_trainer_thread_keeps_to_its_share_of_wall_time(monkeypatch):
    model = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    model.add_labels(pairs_of_monsters())
    spent, minibatch_loss = [], model.piece.minibatch_loss

    def slow_loss(batch_size):  # a slow step: 50 ms more
        started = time.perf_counter()
        time.sleep(0.05)
        loss = minibatch_loss(8)
        spent.append(time.perf_counter() - started)
        return loss

    monkeypatch.setattr(model.piece, "minibatch_loss", slow_loss)
    started = time.perf_counter()
    model.start(share=0.3)  # unbounded, the first fit's 32 steps would take all of the 4 s
    time.sleep(4)
    model.close()
    share = sum(spent) / (time.perf_counter() - started)
    assert len(spent) >= 2 and share <= 0.3 + 0.1, (len(spent), share)
    assert (closed := model.train_stats()["reward_model_time_share"]) <= 0.3 + 0.1
    time.sleep(0.5)  # summary.json reads it after the checkpoint: over the time the trainer ran, not since
    assert model.train_stats()["reward_model_time_share"] == closed


def test_a_crash_of_the_trainer_thread_stops_the_learner(monkeypatch):
    model = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    model.add_labels(pairs_of_monsters())
    monkeypatch.setattr(model.piece, "minibatch_loss", lambda batch_size: 1 / 0)
    model.start()
    deadline = time.time() + 30
    while model.piece.error is None and time.time() < deadline:  # the first fit is due at once
        time.sleep(0.05)
    model.close()
    with pytest.raises(SystemExit, match=r"trainer failed \(ZeroDivisionError: division by zero\)"):
        model.rewards(*steps_of(STEPS))


def test_a_resume_continues_the_reward_model_exactly(monkeypatch):
    """A resume forgave the trainer's owed steps (288 owed became 0), the labels it had not trained on yet and
    those answered after the checkpoint, restarted its sampling stream from the seed, and ranking's recent
    window empty."""
    records = [{"caption": f"You kill the {m}!", "label": 1} for m in MONSTERS[:4]] + [
        {"caption": f"The {m} bites!", "label": 0} for m in MONSTERS]
    model = rm.IntrinsicReward(make_args(reward_type="classification"), "cpu")
    model.add_labels(records[:8])
    assert model.piece.train_now(batch_size=8) == rm.BURST  # the first fit, published
    model.add_labels(records[8:18])  # 10 labels: 12.8 steps owed, a burst of 12 that the save cuts short
    drawn, real_loss = [], model.piece.minibatch_loss

    def stop_at_the_first_step(batch_size):
        model.piece.stop.set()  # as close() does mid-burst
        return real_loss(batch_size)
    monkeypatch.setattr(model.piece, "minibatch_loss", stop_at_the_first_step)
    assert model.piece.train_now(batch_size=8) == 1 and model.piece.burst == 12  # a step done, unpublished
    state = model.state_dict()
    model.add_labels(records[18:])  # answered after the checkpoint: they come back from labels.jsonl

    resumed = rm.IntrinsicReward(make_args(reward_type="classification"), "cpu")
    resumed.add_labels(records)  # as set_up does on resume: the run's labels.jsonl first
    resumed.load_state_dict(state)
    assert resumed.piece.owed_steps == pytest.approx(12.8) and resumed.piece.new_labels == len(records) - 18
    assert resumed.piece.model_steps == rm.BURST  # as published: the step of the cut burst is owed again
    # the next minibatches are those the run drew after its publication
    model.piece.rng.setstate(state["minibatch_rng"])
    for piece in (model.piece, resumed.piece):
        drawn.append(piece.rng.choices(piece.keys[:18], k=64))
    assert drawn[0] == drawn[1]

    ranking = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    for i in range(3):
        ranking.piece.see([f"message {i}", "It's a wall."], np.array([i + 1, 10]))
    again = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    again.load_state_dict(ranking.state_dict())
    assert again.piece.reference == ranking.piece.reference and again.piece.batches == 3


def test_an_unlabelled_caption_is_sent_with_the_pay_weight_it_has_accrued_and_a_label_ends_it():
    """Guards the backlog's order (issue 44): captions went out once, at first sight, with no worth, so the
    annotator could only ask them in the order first seen, and a message paid often but first seen late waited
    for rare ones."""
    model = rm.IntrinsicReward(make_args(reward_type="retrieval"), "cpu")
    requests = model.requests  # what the LLM is asked
    prompt = "Are you sure you want to pray? [yn] (n)"
    model.rewards(*steps_of([(prompt, 1), ("You kill the newt!", 5), (WALL, 3)]))
    # each step its episode's first sight: 1/1^beta
    first = {WALL: 3.0, prompt: 1.0, "You kill the newt!": 5.0}
    assert requests.label_requests()[0] == pytest.approx(first)  # each with its pay weight
    model.add_labels([{"caption": "You kill the newt!", "label": 1}])
    model.rewards(*steps_of([(prompt, 1), ("You kill the newt!", 1)]))
    # seen again: its worth grew; labelled: gone
    assert requests.label_requests()[0] == pytest.approx({prompt: 2.0})
    # a restart: most worth first
    assert requests.unanswered()[0] == pytest.approx({prompt: 2.0, WALL: first[WALL]})


def test_a_pair_is_sent_with_each_message_s_pay_weight_and_a_restart_asks_the_most_worth_first(monkeypatch):
    """Guards the pairs' order (issue 44): the learner sent a pair's summed worth, so the annotator could not
    discount a message it had scored already, and a restarted annotator got the oldest waiting pairs."""
    monkeypatch.setattr(annotator, "MAX_BACKLOG", 1)
    model = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    requests = model.requests
    model.rewards(*steps_of([(WALL, 9), ("You kill the newt!", 2), ("You see here a ring.", 3)]))
    requests.pair_pool, requests.batches_to_pair = [WALL, "You kill the newt!"], 1
    sent = requests.label_requests()[1]  # asked in either order: each message's own weight
    assert {frozenset(zip(pair, worth)) for pair, worth in sent.items()} == {
        frozenset({(WALL, 9.0), ("You kill the newt!", 2.0)})}
    requests.pair_pool, requests.batches_to_pair = [WALL, "You see here a ring."], 1
    requests.label_requests()  # waiting: the newt's pair (worth 11), then the ring's (12)
    assert set(map(frozenset, requests.unanswered()[1])) == {frozenset({WALL, "You see here a ring."})}


def test_a_sweep_of_unanswered_captions_is_bounded_and_oldest_first():
    """With 1e6 captions unanswered, one re-ask sweep scanned, shuffled and sent them all every 60 s (1.6 s of
    the learner thread, 57 MB through the request queue); now at most a backlog's worth, the longest waiting
    first."""
    model = rm.IntrinsicReward(make_args(reward_type="retrieval"), "cpu")
    requests = model.requests  # what the LLM is asked
    n, now = annotator.MAX_BACKLOG + 500, time.time()
    requests.asked = {f"message {i}": now - 1000 + i * 0.01 for i in range(n)}
    requests.asked["just asked"] = now
    requests.last_retry = 0.0
    captions, _ = requests.label_requests()
    assert list(captions) == [f"message {i}" for i in range(annotator.MAX_BACKLOG)]
    requests.last_retry = 0.0
    captions, _ = requests.label_requests()  # the rest, then those asked again: not before another RETRY_S
    assert list(captions) == [f"message {i}" for i in range(annotator.MAX_BACKLOG, n)]
    assert list(requests.asked)[-1] == f"message {n - 1}" and len(requests.asked) == n + 1


def test_an_annotator_restart_asks_again_what_it_had_not_answered(tmp_path):
    """A restart lost the annotator's backlog and requests in flight: 8 of 8 queued captions and 4 of 4 pairs
    went unanswered; captions came back after the 60 s re-ask, pairs never."""
    from types import SimpleNamespace

    from fake_openai import FakeOpenAI
    fake = FakeOpenAI().start()
    fake.delay = 0.2  # one request at a time: the rest wait in the backlog when the annotator dies
    try:
        for reward_type, pending in (("retrieval", "asked"), ("ranking", "waiting")):
            model = rm.IntrinsicReward(make_args(reward_type=reward_type), "cpu")
            client = annotator.LabelClient(SimpleNamespace(prompt_file=None, llm_url=[fake.url],
                                                           llm_model=None, llm_concurrency=1))
            client.start(str(tmp_path), set())
            try:
                model.rewards(*steps_of(STEPS + [(f"You kill the {m}!", 30) for m in MONSTERS[:8]]))
                client.request(*model.requests.label_requests())
                time.sleep(0.5)
                assert len(getattr(model.requests, pending)) >= 4
                client.process.kill()
                client.process.join()
                model.exchange(client, stopping=True)  # in a stop the SIGTERM killed it: no restart
                assert client.restarts == 0
                model.exchange(client)  # as the next update: restarts it, asks again what was not answered
                assert client.restarts == 1
                deadline = time.time() + 60
                while getattr(model.requests, pending) and time.time() < deadline:
                    model.add_labels(client.new_records())
                    time.sleep(0.1)
                assert not getattr(model.requests, pending), (reward_type, getattr(model.requests, pending))
            finally:
                client.close()
    finally:
        fake.stop()


def test_the_classifier_trains_only_while_its_labels_hold_both_classes():
    """Its classes are kept as labels arrive (no scan of every label under the lock); a caption labelled again
    with the other class must not leave a class behind that no label holds any more."""
    model = rm.IntrinsicReward(make_args(reward_type="classification"), "cpu")
    model.add_labels([{"caption": "It's a wall.", "label": 0}, {"caption": "You kill the newt!", "label": 0}])
    assert not model.piece.ready()
    model.add_labels([{"caption": "You kill the newt!", "label": 1}, {"pair": ["a", "b"], "preference": 1}])
    assert model.piece.ready()
    model.add_labels([{"caption": "You kill the newt!", "label": 0}])  # a re-ask answered otherwise
    assert not model.piece.ready() and model.piece.keys == ["It's a wall.", "You kill the newt!"]


# a young agent's steps as in results/free_1m_rerun's free_ranking, with the labeler's scores (helpful above
# annotator.THRESHOLD): "It's a wall." on a quarter of them and the best scored unhelpful message, the pet's
# rare pickups and drops just under the threshold, kills and gold on 4% of the steps; (message, steps, score)
PET = [f"The kitten {verb} {item}." for verb in ("picks up", "drops") for item in
       ("a dart", "an apple", "a dagger", "a food ration", "a scroll", "a ring", "a wand", "a potion")]
DEATH = "You die..."
RANKED_STEPS = ([(WALL, 240, 0.3), ("Never mind.", 150, -1.0), ("It's solid stone.", 100, -2.0),
                 ("What a strange direction!", 80, -1.5), ("Unknown command '^M'.", 80, -2.5),
                 ("You kick at empty space.", 40, -0.5), ("You swap places with your kitten.", 30, 0.0),
                 (DEATH, 3, 0.2)]
                + [(t, 2, 0.5) for t in PET] + [(f"You kill the {m}!", 2, 2.0) for m in MONSTERS[:8]]
                + [(f"You see here {n} gold pieces.", 2, 1.5) for n in range(2, 10)])
SCORE = {t: score for t, _, score in RANKED_STEPS}


def answered(pairs):  # what the annotator answers, from the two scores
    return [{"pair": list(pair), "preference": annotator.preference(SCORE[pair[0]], SCORE[pair[1]])}
            for pair in pairs]


@pytest.fixture(scope="module")
def ranked():
    """A ranking learner after 20 batches of RANKED_STEPS, trained on the pairs of 200 more (1,600 draws)."""
    torch.manual_seed(0)
    model = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    batch = steps_of([(t, k) for t, k, _ in RANKED_STEPS])
    for _ in range(20):  # 16,880 steps: the statistics' reference is full
        model.rewards(*batch)
    model.requests.batches_to_pair = 200
    model.add_labels(answered(model.requests.label_requests()[1]))
    model.piece.train_now(300, batch_size=64)
    return model


def test_ranking_pays_the_helpful_steps_not_the_frequent_unhelpful_ones(ranked):
    """Before, every message above the step median of recent steps was paid, and two unhelpful messages
    were ordered by their score gap: "It's a wall." never lost such a pair and was paid on a quarter of the
    steps."""
    texts = [t for t, _, _ in RANKED_STEPS]
    steps = torch.tensor([k for _, k, _ in RANKED_STEPS], dtype=torch.float)
    helpful = torch.tensor([score > annotator.THRESHOLD for _, _, score in RANKED_STEPS])
    R = ranked.piece.score(rm.to_rows(texts), texts)
    paid = lambda where: (steps * (R > 0))[where].sum().item() / steps[where].sum().item()
    assert paid(helpful) >= 0.8 and paid(~helpful) <= 0.05, (paid(helpful), paid(~helpful))
    assert R[~helpful].eq(0).all(), R  # neither paid nor charged: the median rule gave some a negative z


def test_a_death_is_not_paid(ranked):
    """Before, "You die..." sat above the median and was paid on 360-560 terminal steps of a run."""
    batch = steps_of([(DEATH, 8), (KILL, 8), ("Never mind.", 8)])
    shows = lambda text: (batch[1] == rm.to_rows([text]).view(1, 1, -1)).all(-1)
    terminal = shows(DEATH)
    _, paid, stats = ranked.rewards(batch[0], batch[1], batch[2], terminal)
    assert terminal.sum() == 8 and stats["terminal_step_reward"] == 0 and paid[terminal].eq(0).all()
    assert paid[shows(KILL)].gt(0).all()  # the kill beside it is paid


def one_env_episodes(episode, episodes):
    """The [T, 1] batch of one env's `episodes` episodes, each the messages of `episode`, with sightings."""
    texts = [t for _ in range(episodes) for t in episode]
    counts = [episode[:i + 1].count(t) for _ in range(episodes) for i, t in enumerate(episode)]
    T = len(texts)
    return (torch.zeros(T, 1), rm.to_rows(texts).view(T, 1, 256), torch.tensor(counts).view(T, 1),
            torch.zeros(T, 1, dtype=torch.bool))


@pytest.mark.parametrize("raw", [False, True])
def test_ranking_pairs_hold_each_message_as_often_as_it_is_paid(raw):
    """Before, every 10th step's message went to the pair pool: a kill seen once an episode beside a wall
    bumped into 50 times was in 4% of the pairs trained on. Now a step goes in with probability 1 / N^beta,
    what R = 1 pays it, so the kill is in about as many pairs as the wall; --raw-ranking keeps every 10th
    step."""
    gold = "$ - 2 gold pieces."
    episode = [WALL] * 50 + ["It's solid stone."] * 30 + ["Never mind."] * 20 + [KILL, gold]
    model = rm.IntrinsicReward(make_args(reward_type="ranking", raw_ranking=raw), "cpu")
    requests = model.requests  # what the LLM is asked
    before = requests.rng.getstate()
    model.rewards(*one_env_episodes(episode, 200))
    assert (requests.rng.getstate() != before) != raw  # --raw-ranking leaves the seeded stream as it was
    requests.batches_to_pair = 100
    model.add_labels([{"pair": list(pair), "preference": 1 if pair[0] in (KILL, gold) else 2}
                      for pair in requests.label_requests()[1]])
    pairs = model.piece.pairs
    assert len(pairs) == 800
    pays = lambda n: n if raw else sum(k ** -3.0 for k in range(1, n + 1))  # R = 1 paid over n sightings
    weight = {t: pays(episode.count(t)) for t in episode}
    q = {t: w / sum(weight.values()) for t, w in weight.items()}
    for message in (KILL, gold, WALL):  # by weight, the second drawn again while it is the first (draw_pair)
        expected = q[message] + sum(q_x * q[message] / (1 - q_x) for x, q_x in q.items() if x != message)
        assert sum(message in p[:2] for p in pairs) / len(pairs) == pytest.approx(expected, abs=0.05), message
    assert (sum(KILL in p[:2] for p in pairs) / len(pairs) > 0.3) != raw  # 36% of the pairs; raw: 4%


def test_ranking_statistics_stay_on_the_run_s_first_steps_and_survive_a_resume(monkeypatch):
    """Before, the statistics were refit over the last 8 batches: once the agent killed often, a kill sank to
    the median and was no longer paid. Now they are refit, with each publication's model, over the run's first
    REFERENCE_STEPS steps, kept in the checkpoint: a resume pays exactly as the run would have."""
    monkeypatch.setattr(rm, "REFERENCE_STEPS", 1000)
    torch.manual_seed(0)
    pairs = [{"pair": [KILL, t], "preference": 1} for t in (WALL, "Never mind.")] * 16
    model = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    model.add_labels(pairs)
    model.piece.optimizer.param_groups[0]["lr"] = 1e-3  # fitted in a few steps
    early, later = ([(WALL, 300), ("Never mind.", 200), (KILL, k)] for k in (10, 500))
    for _ in range(2):  # 1,020 steps: the reference is full
        model.rewards(*steps_of(early))
    model.piece.train_now(30, batch_size=16)
    norm, texts = model.piece.published["norm"], [WALL, "Never mind.", KILL]
    for _ in range(4):  # the agent now kills on half of its steps
        model.rewards(*steps_of(later))
    model.piece.publish()  # the same model, statistics refit
    assert model.piece.published["norm"] == norm
    assert model.piece.reference == {WALL: 600, "Never mind.": 400, KILL: 20}
    assert model.piece.score(rm.to_rows(texts), texts).tolist()[2] > rm.RANKING_BAR  # the kill is still paid
    resumed = rm.IntrinsicReward(make_args(reward_type="ranking"), "cpu")
    resumed.add_labels(pairs)
    resumed.load_state_dict(model.state_dict())
    assert resumed.piece.reference == model.piece.reference and resumed.piece.published["norm"] == norm
    for piece in (model.piece, resumed.piece):  # both go on: the same steps, the same statistics, bit for bit
        piece.train_now(5, batch_size=16)
    assert resumed.piece.published["norm"] == model.piece.published["norm"] != norm
