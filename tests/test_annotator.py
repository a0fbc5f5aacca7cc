"""The annotator against a fake OpenAI server with injected faults, its parsing, and training runs
whose LLM server is down or dies mid-run."""
import json
import multiprocessing.managers
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest

import annotator
import llm_server
import reward_models
from fake_openai import TOKENS, FakeOpenAI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAPTIONS = ["You kill the newt!", "It's a wall.", "You see here 5 gold pieces.",
            "The jackal bites!", "You kill the grid bug!"]


class Annotator:
    """`annotator.serve` in a thread, with a plain LabelTable and dict in place of the Manager's proxies."""

    def __init__(self, url, run_dir, known=(), timeout_s=5.0, model=None, prompts=annotator.PROMPTS,
                 concurrency=4, scored=True, demos=None, share=1.0, server_pid=None):
        self.requests, self.stop = queue.Queue(), threading.Event()
        self.table, self.stats, self.concurrency = annotator.LabelTable(), {}, concurrency
        self.thread = threading.Thread(target=annotator.serve, daemon=True, kwargs=dict(
            urls=url if isinstance(url, list) else [url], model=model, prompts=prompts,
            concurrency=concurrency, run_dir=str(run_dir), known=set(known), requests=self.requests,
            table=self.table, stats=self.stats, stop=self.stop, scored=scored, demos=demos,
            timeout_s=timeout_s, share=share, server_pid=server_pid))
        self.thread.start()

    @property
    def labels(self):
        """key -> the latest answer"""
        return {r["caption"] if "caption" in r else annotator.item_key(tuple(r["pair"])):
                r["label"] if "caption" in r else r["preference"] for r in self.log}

    @property
    def log(self):
        """every record in the order written (tests/test_reward_models.py reads it as the learner would)"""
        return self.table.since(0)[0]

    def send(self, captions=(), pairs=()):  # as the learner does: each with its worth (0 unless given)
        self.requests.put((captions if isinstance(captions, dict) else dict.fromkeys(captions, 0.0),
                           {tuple(pair): (0.0, 0.0) for pair in pairs}))  # a pair's: a number a message

    def wait_for(self, condition, timeout=30.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if condition():
                return True
            time.sleep(0.05)
        return False

    def close(self):
        self.stop.set()
        self.thread.join(timeout=10)


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(annotator, "MAX_BACKOFF_S", 0.3)
    monkeypatch.setattr(annotator, "TOKENIZE_BACKOFF_S", (0.05, 0.05))


STYLES = ["fake-base", "fake-instruct"]  # model names that get completion and chat prompts


@pytest.fixture(params=STYLES)
def fake(request):
    server = FakeOpenAI(model=request.param).start()
    yield server
    if server.server is not None:
        try:
            server.stop()
        except OSError:
            pass


def expected_labels():
    return {c: int("kill" in c or "gold" in c) for c in CAPTIONS}


def test_labels_pairs_and_the_labels_file(fake, tmp_path):
    a = Annotator(fake.url, tmp_path)
    a.send(CAPTIONS + ["", CAPTIONS[0]], pairs=[("It's a wall.", "You kill the newt!")])
    assert a.wait_for(lambda: len(a.labels) == 6)
    a.close()
    assert {c: a.labels[c] for c in CAPTIONS} == expected_labels()
    assert a.labels[annotator.item_key(("It's a wall.", "You kill the newt!"))] == 2
    assert a.stats["labels"] == 6 and a.stats["requests"] == 6 and a.stats.get("failures", 0) == 0
    lines = [json.loads(x) for x in open(tmp_path / annotator.LABELS_FILE)]
    pair = next(line for line in lines if "pair" in line)
    assert len(lines) == 6 and pair["pair"] == ["It's a wall.", "You kill the newt!"]
    assert pair["preference"] == 2 and ("scores" in pair) == (fake.model == "fake-base")  # base: from scores
    assert lines == a.log
    path, body = fake.calls[-1]
    if fake.model == "fake-instruct":  # chat prompts: the system's role, then the question
        assert path == "/v1/chat/completions" and [m["role"] for m in body["messages"]] == ["system", "user"]
        assert "answers_restricted" not in a.stats
    else:  # log-probabilities of the next token; the prompt shows the nearest labelled messages first
        assert path == "/v1/completions" and body["prompt"].endswith("\nProgress:") and body["logprobs"] == 5
        per_label = annotator.DEMOS_PER_LABEL
        assert (body["prompt"].count("\nProgress: Yes\n") == body["prompt"].count("\nProgress: No\n")
                == per_label)
        assert "logit_bias" not in body and a.stats["answers_restricted"] == a.stats["answers_scored"] == 1


@pytest.mark.parametrize("model", STYLES)
def test_server_down_at_start(tmp_path, model):
    fake = FakeOpenAI(model=model)
    probe = FakeOpenAI().start()  # reserve a free port, then free it: nothing listens there
    fake.port = probe.port
    probe.stop()
    a = Annotator(fake.url, tmp_path)
    a.send(CAPTIONS)
    assert a.wait_for(lambda: a.stats.get("failures", 0) >= 2)
    assert a.labels == {}
    fake.start()
    assert a.wait_for(lambda: len(a.labels) == len(CAPTIONS))
    a.close()
    fake.stop()
    assert a.labels == expected_labels()


def test_server_dies_mid_run_and_comes_back(fake, tmp_path):
    a = Annotator(fake.url, tmp_path)
    a.send(CAPTIONS[:2])
    assert a.wait_for(lambda: len(a.labels) == 2)
    fake.stop()
    a.send(CAPTIONS[2:])
    assert a.wait_for(lambda: a.stats.get("failures", 0) >= 2)
    assert len(a.labels) == 2
    fake.start()  # same port
    assert a.wait_for(lambda: len(a.labels) == len(CAPTIONS))
    a.close()
    assert a.labels == expected_labels() and a.stats["labels"] == len(CAPTIONS)


@pytest.mark.parametrize("status", [500, 503, 408, 429])
def test_http_5xx_408_and_429_are_retried(fake, tmp_path, status):
    fake.fail_next, fake.fail_status = 3, status
    a = Annotator(fake.url, tmp_path)
    a.send(CAPTIONS)
    assert a.wait_for(lambda: len(a.labels) == len(CAPTIONS))
    a.close()
    assert a.labels == expected_labels() and "fatal" not in a.stats
    assert a.stats["failures"] == 3 and a.stats["requests"] == len(CAPTIONS) + 3


@pytest.mark.parametrize("status", [400, 404, 422])  # 401 and 403: the key's own test
def test_other_4xx_are_fatal(fake, tmp_path, status):
    fake.fail_next, fake.fail_status = 1000, status
    a = Annotator(fake.url, tmp_path)
    a.send(CAPTIONS)
    a.thread.join(timeout=30)
    assert not a.thread.is_alive()  # the annotator stopped asking
    assert a.stats["fatal"] == (f"HTTP {status} from {fake.url}/"
                                f"{'chat/' * ('instruct' in fake.model)}completions: injected failure")
    assert fake.requests <= a.concurrency and a.labels == {}


def test_the_key_goes_with_every_request(fake, tmp_path, monkeypatch):
    fake.key = "sk-test-key"
    monkeypatch.setenv("OPENAI_API_KEY", fake.key)
    a = Annotator(fake.url, tmp_path)
    a.send(CAPTIONS)
    assert a.wait_for(lambda: len(a.labels) == len(CAPTIONS))
    a.close()
    assert a.labels == expected_labels() and "fatal" not in a.stats
    assert set(fake.authorizations) == {"Bearer sk-test-key"} and len(fake.authorizations) > len(CAPTIONS)


@pytest.mark.parametrize("status", [401, 403])
@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_a_missing_or_wrong_key_is_one_fatal_line_not_retries(fake, tmp_path, monkeypatch, key, status):
    fake.key, fake.key_status = "sk-test-key", status
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    if key:
        monkeypatch.setenv("OPENAI_API_KEY", key)
    a = Annotator(fake.url, tmp_path)
    a.send(CAPTIONS)
    a.thread.join(timeout=30)
    assert not a.thread.is_alive() and a.labels == {}
    said = "refused the key in OPENAI_API_KEY" if key else "wants a key"
    assert a.stats["fatal"] == f"the LLM server at {fake.url}/models {said} (HTTP {status}): " \
                               "set OPENAI_API_KEY to its key"
    assert fake.authorizations == [key and f"Bearer {key}"]  # asked once: the model's name, then it stopped


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_a_missing_or_wrong_key_stops_the_run(tmp_path, monkeypatch, key):
    """Through the annotator's process, as the learner sees it: check() ends the run with the one line."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    if key:
        monkeypatch.setenv("OPENAI_API_KEY", key)
    fake = FakeOpenAI().start()
    fake.key = "sk-test-key"
    client = annotator.LabelClient(client_args(fake.url))
    client.start(str(tmp_path), set())
    try:
        client.request(dict.fromkeys(CAPTIONS, 0.0), {})
        said = "refused the key in OPENAI_API_KEY" if key else "wants a key"
        line = (f"error: annotator: the LLM server at {fake.url}/models {said} (HTTP 401): "
                "set OPENAI_API_KEY to its key")
        with pytest.raises(SystemExit, match=f"^{re.escape(line)}$"):
            deadline = time.time() + 60
            while time.time() < deadline:
                client.check()
                time.sleep(0.05)
    finally:
        client.close()
        fake.stop()
    assert client.stats()["restarts"] == 0


def test_a_model_the_server_does_not_have_is_fatal(fake, tmp_path):
    a = Annotator(fake.url, tmp_path, model=fake.model.replace("fake", "missing"))
    a.send(CAPTIONS)
    a.thread.join(timeout=30)
    assert not a.thread.is_alive()
    assert a.stats["fatal"].startswith("HTTP 404 from http://127.0.0.1:")
    assert a.stats["fatal"].endswith(f"The model `{fake.model.replace('fake', 'missing')}` does not exist.")


def test_a_template_that_cannot_be_filled_is_fatal(fake, tmp_path):
    broken = {**annotator.PROMPTS, "label_user": 'Answer {"label": ...} for {caption}',
              "label_completion": 'Answer {"label": ...} for {caption}'}
    a = Annotator(fake.url, tmp_path, prompts=broken)
    a.send(CAPTIONS)
    a.thread.join(timeout=30)
    assert not a.thread.is_alive() and fake.requests == 0
    assert a.stats["fatal"].startswith("prompt template 'label_") and "KeyError" in a.stats["fatal"]


def test_a_server_that_cannot_tokenize_leaves_answers_unrestricted_and_says_so(tmp_path, capsys):
    fake = FakeOpenAI().start()
    fake.logprobs = "error"  # else the answer is read from log-probabilities, where restricting matters not
    fake.tokenize_fails = 2  # a passing failure: retried
    a = Annotator(fake.url, tmp_path)
    a.send(CAPTIONS[:1])
    assert a.wait_for(lambda: len(a.labels) == 1)
    a.close()
    assert a.stats["answers_restricted"] == 1 and fake.calls[-1][1]["logit_bias"]
    fake.tokenize_fails = 1000
    b = Annotator(fake.url, tmp_path)
    b.send(CAPTIONS)
    assert b.wait_for(lambda: len(b.labels) == len(CAPTIONS))  # the run goes on
    b.close()
    fake.stop()
    assert b.stats["answers_restricted"] == 0 and b.labels == expected_labels()
    assert fake.calls[-1][1]["logit_bias"] is None
    assert capsys.readouterr().err.count("answers are not restricted") == 1


def test_slow_server_times_out_then_recovers(fake, tmp_path):
    fake.delay = 1.5
    a = Annotator(fake.url, tmp_path, timeout_s=0.3)
    a.send(CAPTIONS[:2])
    assert a.wait_for(lambda: a.stats.get("failures", 0) >= 2)
    assert a.labels == {}
    fake.delay = 0.0
    assert a.wait_for(lambda: len(a.labels) == 2)
    a.close()
    assert a.labels == {c: v for c, v in expected_labels().items() if c in CAPTIONS[:2]}


def test_the_labeler_keeps_a_request_in_flight_at_most_its_share_of_wall_time(tmp_path):
    """Guards issue 44: the embedded server, always busy, took a core of the learner's two (ONI at 0.37-0.53
    of `none`'s steps/s). With --llm-share it is busy at most that share of wall time, after a first burst of
    credit."""
    fake = FakeOpenAI().start()
    fake.delay = 0.2
    a = Annotator(fake.url, tmp_path, concurrency=1, share=0.25)
    a.send([f"You see here {i} gold pieces." for i in range(100)])
    started = time.time()
    time.sleep(6.0)
    a.close()
    fake.stop()
    # the credit, then the share
    busy_allowed = annotator.MAX_CREDIT_S * 0.25 + 0.25 * (time.time() - started)
    assert 0.6 * busy_allowed / 0.2 <= fake.requests <= busy_allowed / 0.2 + 2  # unbounded: ~30 requests


def test_a_caption_asked_again_while_in_flight_is_asked_once(fake, tmp_path):
    fake.delay = 0.5  # the learner's retry of an unanswered caption can come while it is in flight
    a = Annotator(fake.url, tmp_path)
    a.send(CAPTIONS[:1])
    assert a.wait_for(lambda: a.stats.get("in_flight", 0) == 1)
    a.send(CAPTIONS[:1])
    a.send(CAPTIONS[:1])
    assert a.wait_for(lambda: len(a.labels) == 1)
    time.sleep(1.0)
    a.close()
    assert a.stats["requests"] == 1 and a.log == [{"caption": CAPTIONS[0],
                                                   "label": expected_labels()[CAPTIONS[0]]}]


def test_garbage_answers_are_counted_retried_once_then_unknown(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(annotator, "UNKNOWN_RETRY_S", 1.0)
    fake.mode = "garbage"
    a = Annotator(fake.url, tmp_path)
    a.send(CAPTIONS[:3], pairs=[("a", "b")])
    assert a.wait_for(lambda: len(a.labels) == 4)
    assert set(a.labels.values()) == {None}
    assert a.stats["parse_failures"] == 8 and a.stats["requests"] == 8 and a.stats["labels"] == 4
    fake.mode = "ok"  # an unknown label is asked again, not before UNKNOWN_RETRY_S (patched to 1 s here)
    a.send(CAPTIONS[:1], pairs=[("a", "b")])  # a pair that ended as a tie is an answer: not asked again
    time.sleep(0.3)
    assert a.stats["requests"] == 8  # sent again at once (the learner sends it each batch it is seen): waits
    time.sleep(1.0)
    a.send(CAPTIONS[:1])
    assert a.wait_for(lambda: a.labels[CAPTIONS[0]] is not None)
    time.sleep(0.3)
    a.close()
    assert a.labels[CAPTIONS[0]] == expected_labels()[CAPTIONS[0]]
    assert a.stats["requests"] == 9 and a.stats["labels"] == 5


def test_known_captions_are_not_asked_again_and_the_backlog_is_bounded(fake, tmp_path, monkeypatch):
    a = Annotator(fake.url, tmp_path, known={"You kill the newt!"})
    a.send(["You kill the newt!", "It's a wall."])
    assert a.wait_for(lambda: len(a.labels) == 1)
    a.close()
    assert list(a.labels) == ["It's a wall."] and fake.requests == 1

    monkeypatch.setattr(annotator, "MAX_BACKLOG", 3)
    fake.stop()
    b = Annotator(fake.url, tmp_path)
    b.send({f"message {i}": float(i % 5) for i in range(10)})  # the server down: nothing leaves the backlog
    assert b.wait_for(lambda: b.stats.get("dropped", 0) + b.stats.get("backlog", 0) == 10)
    b.close()
    assert b.stats["backlog"] + b.stats["in_flight"] <= 3


def test_the_backlog_is_asked_most_worth_first_and_the_oldest_of_equals_first(tmp_path, monkeypatch):
    """Guards issue 44: asked in the order first seen, the embedded labeler (far behind the agent's stream of
    new messages) never reached frequent messages first seen late, e.g. the faint from hunger, paid on 7,000
    steps of a 1M-step run while rare earlier messages were asked. Worth is the pay weight a caption accrued
    unlabelled."""
    fake = FakeOpenAI().start()
    fake.delay = 0.05
    a = Annotator(fake.url, tmp_path, concurrency=1)
    rare = {f"You see here {i} gold pieces.": 1.0 for i in range(6)}  # seen first, once each
    a.send(rare)
    a.send({"You faint from lack of food.": 40.0, "It's a wall.": 12.0})  # later, but paid far more
    a.send({"It's a wall.": 30.0})  # its worth grew before it was asked: the learner sends the total
    assert a.wait_for(lambda: len(a.log) == 8)
    a.close()
    fake.stop()
    asked = [r["caption"] for r in a.log]
    assert asked[1:3] == ["You faint from lack of food.", "It's a wall."]  # after the one already in flight
    assert asked[3:] == [c for c in rare if c != asked[0]]

    monkeypatch.setattr(annotator, "MAX_BACKLOG", 10)  # full: the least worth goes, the most stays
    backlog = annotator.Backlog()
    dropped = sum(backlog.put(f"m{i}", f"m{i}", float(i)) for i in range(20))
    assert dropped == 10 and set(backlog.items) == {f"m{i}" for i in range(10, 20)}
    assert [backlog.pop(backlog.peek()) for _ in range(3)] == ["m19", "m18", "m17"]


def test_a_pair_waits_by_the_pay_weight_of_its_messages_not_scored_when_it_is_asked():
    """Guards issue 44's pair order: a pair was worth both its messages' pay weight, so pairs holding the
    most common message, already scored (a base model reuses a score free), stayed first in a full backlog
    though each cost one cheap score; its worth was fixed when it came, never lowered once a message was
    scored; and an instruct model, which answers every pair whole, must get no such discount."""
    labeler = annotator.Labeler(["http://unused"], "m", annotator.PROMPTS, 1.0)
    labeler.style = "completion"  # a base model: a pair's preference comes from its messages' scores
    backlog = annotator.Backlog(labeler.worth)
    wall, other = ("It's a wall.", "You kill the newt!"), ("You see here a ring.", "The door opens.")
    backlog.put(annotator.item_key(wall), wall, (9.0, 1.0))  # each message's pay weight, as the learner sends
    backlog.put(annotator.item_key(other), other, (3.0, 3.0))
    assert backlog.peek() == annotator.item_key(wall)  # 10 against 6
    labeler.scores["It's a wall."] = -3.0  # scored meanwhile, through another pair: nothing is sent again
    assert backlog.peek() == annotator.item_key(other)  # the wall's pair now costs one score worth 1
    assert backlog.pop(backlog.peek()) == other and backlog.peek() == annotator.item_key(wall)
    backlog.put(annotator.item_key(wall), wall, 0.0)  # a retry sends no worth: what it was sent stands
    assert backlog.worth[annotator.item_key(wall)] == 1.0 and backlog.raw[annotator.item_key(wall)] == (9, 1)
    labeler.style = "chat"  # an instruct model answers every pair whole: a score in hand is no discount
    assert labeler.worth(wall, (9.0, 1.0)) == 10.0 and labeler.worth("It's a wall.", 5.0) == 5.0


@pytest.mark.parametrize("text,label", [
    ("The newt is weak. <label>FOO</label>", 1),
    ("Answer FOO/BAR inside the tag... <label> bar </label>", 0),
    ("I would say FOO/BAR is a choice; <label>BAR</label> and finally <label>FOO</label>", 1),
    ("FOO", annotator.UNPARSEABLE),  # the reference counted any mention of FOO as a yes
    ("<label>MAYBE</label>", annotator.UNPARSEABLE),
    ("", annotator.UNPARSEABLE),
])
def test_parse_label(text, label):
    assert (annotator.parse_label(text) is label if label is annotator.UNPARSEABLE
            else annotator.parse_label(text) == label)


@pytest.mark.parametrize("text,preference", [
    ('Both matter, but ("best_description": 2)', 2),
    ('{"best_description": 1} ... ("best_description": 2)', 2),  # the last answer counts
    ('I must answer with ("best_description": 1) or ("best_description": 2). The kill matters: '
     '("best_description": 2)', 2),
    ('Format: ("best_description": 1|2|None). Neither: ("best_description": None)', None),
    ('("best_description": None)', None),
    ('best_description: "1"', 1),
    ("description 1 is better", annotator.UNPARSEABLE),
])
def test_parse_preference(text, preference):
    result = annotator.parse_preference(text)
    assert result is preference if preference in (None, annotator.UNPARSEABLE) else result == preference


def test_parse_choice():
    yes_no = {"yes": 1, "no": 0}
    assert annotator.parse_choice(" Yes", yes_no) == 1 and annotator.parse_choice("no", yes_no) == 0
    assert annotator.parse_choice(" The", yes_no) is annotator.UNPARSEABLE
    assert annotator.parse_choice(" 2", {"1": 1, "2": 2}) == 2


def train(args, timeout=600):
    return subprocess.run([sys.executable, "oni_appo.py", "--num-workers", "2", "--num-envs-per-worker", "4",
                           "--batch-size", "256", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_training_with_no_llm_listening_completes(tmp_path):
    run_dir = tmp_path / "run"
    result = train(["--reward-type", "retrieval", "--llm-url", "http://127.0.0.1:9/v1",
                    "--total-env-steps", "3000", "--run-dir", str(run_dir)])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["env_steps"] >= 3000 and summary["llm_labels"] == 0 and summary["llm_failures"] > 0


def test_training_survives_a_server_that_dies_and_comes_back(tmp_path):
    fake = FakeOpenAI().start()
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "oni_appo.py", "--num-workers", "2", "--num-envs-per-worker",
                             "4", "--batch-size", "256", "--reward-type", "classification", "--llm-url",
                             fake.url, "--total-env-steps", "20000", "--run-dir", str(run_dir)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = iter(proc.stdout)
    for line in lines:
        if "steps/s" in line:
            break
    fake.stop()  # the server dies mid-run
    for line, _ in zip(lines, range(2)):
        pass
    fake.start()
    out, err = proc.communicate(timeout=600)
    fake.stop()
    assert proc.returncode == 0, err[-2000:]
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["llm_labels"] > 0 and summary["llm_failures"] > 0 and summary["env_steps"] >= 20000
    # what the classifier's trainer cost, recorded with the run
    assert summary["reward_model_steps"] > 0 and 0 < summary["session_reward_model_time_share"] < 1
    assert 0 < summary["session_reward_model_publications"] <= summary["reward_model_steps"]
    labelled = [json.loads(x)["caption"] for x in open(run_dir / annotator.LABELS_FILE)]
    assert len(labelled) == len(set(labelled)) == summary["llm_labels"]  # each asked once


def test_ctrl_c_to_the_whole_process_group_saves_and_exits_cleanly(tmp_path):
    """Ctrl-C reaches every process of the group: the annotator and its Manager must survive it."""
    fake = FakeOpenAI().start()
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "oni_appo.py", "--num-workers", "2", "--num-envs-per-worker",
                             "4", "--batch-size", "256", "--reward-type", "retrieval", "--llm-url", fake.url,
                             "--run-dir", str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    for line in proc.stdout:
        if "llm labels" in line and "llm labels 0 " not in line:
            break
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    fake.stop()
    assert proc.returncode == 130, err[-2000:]  # a stop, not an end (issue 45)
    assert "Traceback" not in err
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["llm_labels"] > 0
    assert (run_dir / "checkpoint.pt").exists()


def test_prompt_file_replaces_templates_and_bad_files_are_clear_errors(tmp_path):
    fake = FakeOpenAI().start()
    custom = tmp_path / "prompts.json"
    custom.write_text(
        json.dumps({"label_completion": "Is this good in NetHack?\nMessage: {caption}\nProgress:"}))
    client = annotator.LabelClient(SimpleNamespace(prompt_file=str(custom), llm_url=[fake.url],
                                                   llm_model=None))
    assert client.prompts["label_completion"].startswith("Is this good in NetHack?")
    assert client.prompts["label_user"] == annotator.PROMPTS["label_user"]  # the rest stays
    labeler = annotator.Labeler([fake.url], None, client.prompts, 5.0)
    labeler.resolve_model()
    assert labeler.ask("You kill the newt!") == 1
    chat = annotator.Labeler([fake.url], "Llama-3.1-8B-Instruct", client.prompts, 5.0)
    chat.resolve_model()
    fake.stop()
    assert chat.style == "chat" and labeler.style == "completion"
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(SystemExit, match="cannot read --prompt-file"):
        annotator.LabelClient(SimpleNamespace(prompt_file=str(broken)))
    braces = tmp_path / "braces.json"  # literal braces must be doubled for str.format
    braces.write_text(json.dumps({"pair_user": 'Answer {"best_description": 1} for {first} / {second}'}))
    with pytest.raises(SystemExit, match=r"^error: --prompt-file .*braces.json: prompt template 'pair_user': "
                                         r"KeyError: '\"best_description\"'$"):
        annotator.LabelClient(SimpleNamespace(prompt_file=str(braces)))
    braces.write_text(json.dumps({"pair_user": 'Answer {{"best_description": 1}} for {first} / {second}'}))
    assert annotator.LabelClient(SimpleNamespace(prompt_file=str(braces))).prompts["pair_user"].startswith(
        "Answer {{")


def client_args(url, **kw):
    return SimpleNamespace(prompt_file=None, llm_url=[url] if url else [], llm_model=None, **kw)


def test_check_restarts_a_dead_annotator_and_stops_the_run_on_a_fatal_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(annotator, "MAX_RESTARTS", 2)
    fake = FakeOpenAI().start()
    client = annotator.LabelClient(client_args(fake.url))
    client.start(str(tmp_path), set())
    records = []

    def labelled(n):
        deadline = time.time() + 60
        while len(records) < n and time.time() < deadline:
            records.extend(client.new_records())
            client.check()
            time.sleep(0.05)
        return len(records) == n

    try:
        client.request(dict.fromkeys(CAPTIONS[:2], 0.0), {})
        assert labelled(2)
        client.process.kill()  # the annotator dies (not through close())
        client.process.join()
        client.check()
        assert client.process.is_alive() and client.stats()["restarts"] == 1
        assert ("annotator: its process died (exit code -9), 1 times so far: restarting it"
                in capsys.readouterr().err)
        # the learner re-sends what is unlabelled; done ones are not asked again
        client.request(dict.fromkeys(CAPTIONS, 0.0), {})
        assert labelled(len(CAPTIONS)) and fake.requests == len(CAPTIONS)
        assert client.stats()["labels"] == len(CAPTIONS)  # the counts go on across the restart
        fake.fail_next, fake.fail_status = 1000, 404
        client.request(dict.fromkeys(["You hear a door open."], 0.0), {})
        with pytest.raises(SystemExit,
                           match=r"^error: annotator: HTTP 404 from .*/v1/completions: injected failure$"):
            labelled(len(CAPTIONS) + 1)
        assert client.stats()["restarts"] == 1  # a fatal error is not a crash: no restart
    finally:
        client.close()
        fake.stop()
    assert client.stats()["restarts"] == 1 and client.stats()["fatal"].startswith("HTTP 404")

    client = annotator.LabelClient(client_args("http://127.0.0.1:9/v1"))
    client.start(str(tmp_path), set())
    try:
        for _ in range(2):
            client.process.kill()
            client.process.join()
            client.check()
        client.process.kill()
        client.process.join()
        with pytest.raises(SystemExit,
                           match=r"^error: annotator: its process died \(exit code -9\), 3 times so far$"):
            client.check()
    finally:
        client.close()


def test_the_label_table_keeps_only_what_the_learner_has_not_read():
    table = annotator.LabelTable()
    table.put([(f"c{i}", {"caption": f"c{i}", "label": 1}) for i in range(3)])
    records, cursor = table.since(0)
    assert [r["caption"] for r in records] == ["c0", "c1", "c2"] and cursor == 3
    table.put([("c1", {"caption": "c1", "label": 0}), ("c3", {"caption": "c3", "label": None})])
    records, cursor = table.since(cursor)
    assert records == [{"caption": "c1", "label": 0}, {"caption": "c3", "label": None}] and cursor == 5
    assert table.since(cursor) == ([], 5) and table.written == []  # what was read is gone
    # the keys stay, not the records
    assert sorted(table.settled()) == ["c0", "c1", "c2"] and not hasattr(table, "items")


def test_labels_reach_the_learner_through_the_manager_table_in_bulk(tmp_path, monkeypatch):
    """The LabelTable in the Manager is the one channel: new_records() takes everything written since
    its last call, in order (a caption asked again appears again), in one round trip."""
    fake = FakeOpenAI(model="fake-instruct").start()
    # the first caption's answer is unparseable twice: an unknown label, asked again later
    fake.mode = "garbage"
    client = annotator.LabelClient(client_args(fake.url))
    client.start(str(tmp_path), set())

    def written(n):
        deadline = time.time() + 15
        while client.stats().get("labels", 0) < n and time.time() < deadline:
            time.sleep(0.05)
        return client.stats().get("labels", 0) == n

    calls = []
    call = multiprocessing.managers.BaseProxy._callmethod
    monkeypatch.setattr(multiprocessing.managers.BaseProxy, "_callmethod",
                        lambda proxy, name, *a, **kw: calls.append(name) or call(proxy, name, *a, **kw))
    try:
        assert client.concurrency == annotator.URL_CONCURRENCY and not hasattr(client, "log")
        client.request(dict.fromkeys(CAPTIONS[:1], 0.0), {})
        assert written(1)
        fake.mode = "ok"
        client.request(dict.fromkeys(CAPTIONS, 0.0), {("It's a wall.", "You kill the newt!"): 0.0})
        assert written(len(CAPTIONS) + 1)  # the unknown one waits UNKNOWN_RETRY_S
        calls.clear()
        records = client.new_records()
        assert calls == ["since"]  # one round trip for all of them
        assert records == [json.loads(x) for x in open(tmp_path / annotator.LABELS_FILE)]
        assert records[0] == {"caption": CAPTIONS[0], "label": None}
        assert [r for r in records if r.get("caption") == CAPTIONS[0]] == [
            {"caption": CAPTIONS[0], "label": None}]
        assert client.new_records() == []  # nothing new since
        client.request(dict.fromkeys(["You see here 9 gold pieces."], 0.0), {})
        assert written(len(CAPTIONS) + 2)
        assert client.new_records() == [{"caption": "You see here 9 gold pieces.", "label": 1}]
    finally:
        client.close()
        fake.stop()


def test_concurrency_keeps_n_requests_in_flight_spread_over_the_servers(tmp_path):
    slow = [FakeOpenAI(model="fake-instruct").start() for _ in range(2)]
    for server in slow:
        server.delay = 1.0
    captions = [f"You kill the newt number {i}!" for i in range(36)]
    a = Annotator([s.url for s in slow], tmp_path, model="fake-instruct", concurrency=6)
    a.send(captions)
    in_flight = []
    assert a.wait_for(
        lambda: in_flight.append(a.stats.get("in_flight", 0)) or len(a.labels) == len(captions), 15)
    a.close()
    assert max(in_flight) == 6 and a.labels == dict.fromkeys(captions, 1)
    assert [s.max_active for s in slow] == [3, 3] and min(s.requests for s in slow) >= 12  # an even spread
    dead = FakeOpenAI(model="fake-instruct")  # a server that is down: the other one takes its share
    dead.port = slow[0].port
    slow[0].stop()
    slow[1].delay, slow[1].requests = 0.0, 0
    b = Annotator([dead.url, slow[1].url], tmp_path, model="fake-instruct", concurrency=6)
    b.send(CAPTIONS)
    assert b.wait_for(lambda: len(b.labels) == len(CAPTIONS), 10)
    b.close()
    slow[1].stop()
    assert b.labels == expected_labels() and slow[1].requests == len(CAPTIONS) and b.stats["failures"] >= 1


def test_start_passes_threads_and_stops_the_server_when_start_up_fails(tmp_path, monkeypatch):
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    calls = []
    monkeypatch.setattr(llm_server, "start",
                        lambda **kw: calls.append(kw) or (server, "http://127.0.0.1:9/v1"))

    def broken_start(*args, **kw):
        raise OSError("cannot start the Manager")
    monkeypatch.setattr(annotator.multiprocessing.managers.SyncManager, "start", broken_start)
    client = annotator.LabelClient(client_args(None, num_workers=3, llm_threads=None))
    with pytest.raises(OSError, match="cannot start the Manager"):
        client.start(str(tmp_path), set())
    assert server.poll() is not None  # the embedded server did not outlive the failed start
    assert calls[0]["threads"] is None and calls[0]["num_workers"] == 3
    assert client.concurrency == annotator.EMBEDDED_CONCURRENCY  # what llama.cpp serves best, unless told


def test_a_label_from_a_server_that_cannot_restrict_the_answer_still_keeps_the_threshold(tmp_path):
    """Guards: without ' Yes'/' No' token ids no logit bias can carry THRESHOLD, so a greedy label would be
    argmax (threshold 0): a label is then read from the scores even where only the label is wanted."""
    fake = FakeOpenAI().start()
    fake.tokenize_fails, fake.margins = 10**6, {"You kill the grid bug!": annotator.THRESHOLD / 2}
    a = Annotator(fake.url, tmp_path, scored=False)
    a.send(CAPTIONS)
    assert a.wait_for(lambda: len(a.labels) == len(CAPTIONS))
    a.close()
    fake.stop()
    assert (a.labels == {**expected_labels(), "You kill the grid bug!": 0}
            and a.stats["answers_restricted"] == 0)


@pytest.mark.parametrize("reward_type", ["retrieval", "classification", "ranking"])
def test_only_ranking_asks_for_log_probabilities(tmp_path, capsys, monkeypatch, reward_type):
    # Guards the ~6x cost of log-probabilities (llama.cpp's --logits_all) on reward models that use only the
    # label.
    fake = FakeOpenAI().start()
    # the likelier answer, yet under THRESHOLD
    fake.margins = {"You kill the grid bug!": annotator.THRESHOLD / 2}
    client = annotator.LabelClient(client_args(fake.url))
    client.start(str(tmp_path), set(), asks=reward_models.PIECES[reward_type].asks)
    records, deadline = [], time.time() + 60
    try:
        client.request(dict.fromkeys(CAPTIONS, 0.0), {})
        while len(records) < len(CAPTIONS) and time.time() < deadline:
            records.extend(client.new_records())
            time.sleep(0.05)
        stats = client.stats()
    finally:
        client.close()
        fake.stop()
    assert {r["caption"]: r["label"] for r in records} == {
        **expected_labels(), "You kill the grid bug!": 0}  # either way
    asked = ["logprobs" in body for path, body in fake.calls if path.endswith("/completions")]
    assert asked and set(asked) == {reward_type == "ranking"} and stats.get("answers_scored") == (
        1 if reward_type == "ranking" else None)
    assert "log-probabilities" not in capsys.readouterr().err  # a choice, not a server's lack: no notice


@pytest.mark.parametrize("scored", [False, True])
def test_a_llama_cpp_server_is_asked_by_bisection_never_for_log_probabilities(scored):
    """Guards issue 44: llama-cpp-python computes the log-probabilities of every prompt token (a score took
    2.1 s where a label takes 0.3 s). Its labels are one restricted greedy token at THRESHOLD; a score
    (ranking) takes BISECTIONS more on the same prompt, which its prompt cache holds, and lands within half
    their resolution."""
    fake = FakeOpenAI().start()
    fake.llama_cpp = True
    fake.margins = {"You kill the newt!": 2.3, "It's a wall.": -1.1,
                    "You kill the grid bug!": annotator.THRESHOLD + 0.2,
                    "You see here 3 gold pieces.": annotator.THRESHOLD - 0.05, "You hear a door open.": -9.0}
    labeler = annotator.Labeler([fake.url], None, annotator.PROMPTS, 5.0, scored=scored)
    labeler.resolve_model()
    try:
        for caption, margin in fake.margins.items():
            if scored:
                span = (annotator.THRESHOLD - annotator.SCORE_SPAN,
                        annotator.THRESHOLD + annotator.SCORE_SPAN)
                assert (abs(labeler.score(caption, 0) - np.clip(margin, *span))  # beyond the span: its bound
                        <= annotator.SCORE_SPAN / 2 ** (annotator.BISECTIONS + 1) + 1e-9)
            else:
                assert labeler.ask(caption) == int(margin > annotator.THRESHOLD)
    finally:
        fake.stop()
    completions = [body for path, body in fake.calls if path == "/v1/completions"]
    assert not any("logprobs" in body for body in completions) and labeler.logprobs is False
    assert len(completions) == len(fake.margins) * (1 + annotator.BISECTIONS * scored)


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, just not reaped
    except FileNotFoundError:
        return False


def test_llm_server_stop_ends_its_whole_process_group():
    child = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); "
             "time.sleep(60)")
    leader = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', %r], "
              "stdout=subprocess.PIPE); p.stdout.readline(); print(p.pid, flush=True); "
              "time.sleep(60)" % child)
    server = subprocess.Popen([sys.executable, "-c", leader], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    engine = int(server.stdout.readline())  # like vLLM's engine: a child of the server, deaf to SIGTERM
    llm_server.stop(server, timeout_s=2)
    deadline = time.time() + 10
    while alive(engine) and time.time() < deadline:
        time.sleep(0.05)
    assert server.poll() is not None and not alive(engine)


def test_llm_server_threads_and_gpu_memory(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    monkeypatch.setattr(llm_server.os, "cpu_count", lambda: 16)

    def threads(**kw):
        command = llm_server.build_command("llama_cpp", str(model), "127.0.0.1", 1, **kw)
        return command[command.index("--n_threads") + 1]
    assert (threads(), threads(num_workers=12), threads(num_workers=20),
            threads(threads=3, num_workers=12)) == \
        ("16", "4", "1", "3")  # the cores the env workers leave, at least one; --llm-threads wins
    monkeypatch.setattr(llm_server.importlib.util, "find_spec", lambda name: object())
    for kw, share in (({}, "0.5"), ({"gpu_memory_utilization": 0.3}, "0.3")):
        command = llm_server.build_command("vllm", "org/Model-Instruct", "0.0.0.0", 1, **kw)
        assert command[command.index("--gpu-memory-utilization") + 1] == share
    started = []

    def start(*args, **kw):
        started.append(kw)
        raise KeyboardInterrupt
    monkeypatch.setattr(llm_server, "start", start)
    with pytest.raises(KeyboardInterrupt):
        llm_server.main(["--backend", "vllm", "--model", "m", "--gpu-memory-utilization", "0.25"])
    assert started[0]["gpu_memory_utilization"] == 0.25


def test_a_server_gets_the_key_in_its_environment_and_an_open_one_is_named(monkeypatch, capsys):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-key")
    monkeypatch.setenv("api_key", "an unrelated key")  # would lock the annotator out of llama.cpp's server
    def keys(env):
        return {k: v for k, v in env.items() if k.upper() in ("API_KEY", "VLLM_API_KEY")}
    for backend, variable in (("llama_cpp", "API_KEY"), ("vllm", "VLLM_API_KEY")):
        assert keys(llm_server.server_environment(backend)) == {variable: "sk-test-key"}
    monkeypatch.delenv("OPENAI_API_KEY")
    assert keys(llm_server.server_environment("llama_cpp")) == {}
    monkeypatch.setenv("PORT", "5000")  # llama.cpp's server would listen there, not on the port it is given
    monkeypatch.setenv("HOST", "0.0.0.0")
    assert not {"PORT", "HOST"} & set(llm_server.server_environment("llama_cpp"))

    def start(*args, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(llm_server, "start", start)
    for host, key, warned in (("0.0.0.0", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False)):
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        if key:
            monkeypatch.setenv("OPENAI_API_KEY", key)
        with pytest.raises(KeyboardInterrupt):
            llm_server.main(["--host", host, "--port", "8001"])
        said = "warning: serving on 0.0.0.0 with no key: whoever reaches port 8001 can use it; set " \
               "OPENAI_API_KEY\n"
        assert capsys.readouterr().err == (said if warned else ""), (host, key)


def test_the_embedded_server_wants_the_key_and_ps_does_not_show_it(tmp_path, monkeypatch):
    """The real llama.cpp server: it reads the key from its environment (pydantic settings), not a flag."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-key")
    process, url = llm_server.start(log_path=str(tmp_path / "llm_server.log"), threads=1)
    try:
        assert b"sk-test-key" not in open(f"/proc/{process.pid}/cmdline", "rb").read()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}/models", timeout=30)
        assert refused.value.code == 401
        labeler = annotator.Labeler([url], None, annotator.PROMPTS, 30.0, scored=False)
        assert labeler.resolve_model() and labeler.restricted  # /models and /extras/tokenize took the key
        assert labeler.ask("You kill the newt!") in (0, 1)
    finally:
        llm_server.stop(process)
    assert "sk-test-key" not in open(tmp_path / "llm_server.log").read()


def test_a_labels_file_cut_short_by_a_crash_still_resumes(tmp_path):
    path, whole = tmp_path / annotator.LABELS_FILE, {"caption": "You kill the newt!", "label": 1}
    path.write_text(json.dumps(whole) + "\n" + '{"caption": "It\'s a w')  # the last write, cut short
    assert annotator.read_labels(path) == [whole]
    # a whole last line without its newline (a file written by hand) is kept
    path.write_text(json.dumps(whole))
    assert annotator.read_labels(path) == [whole]
    # damage before the end is an error
    path.write_text('{"caption": "It\'s a w\n' + json.dumps(whole) + "\n")
    with pytest.raises(SystemExit, match="cannot read labels"):
        annotator.read_labels(path)


def base_labeler(fake):
    labeler = annotator.Labeler([fake.url], None, annotator.PROMPTS, 5.0)
    labeler.resolve_model()
    return labeler


def test_a_score_is_the_log_probability_margin_and_a_label_is_above_the_threshold(monkeypatch):
    fake = FakeOpenAI().start()
    fake.margins = {"You kill the newt!": 1.5, "You hear a door open.": 0.3, "It's a wall.": -2.0}
    labeler = base_labeler(fake)
    try:
        assert [labeler.score(m, 0) for m in fake.margins] == pytest.approx([1.5, 0.3, -2.0])
        monkeypatch.setattr(annotator, "THRESHOLD", 0.5)
        assert [labeler.ask(m) for m in fake.margins] == [1, 0, 0]
        monkeypatch.setattr(annotator, "THRESHOLD", 0.1)
        assert [labeler.ask(m) for m in fake.margins] == [1, 1, 0]
    finally:
        fake.stop()
    # llama.cpp's answer: a word outside the top ones is at most as likely as the last of them; neither: no
    # answer
    answers = iter([{" Yes": -0.2, " I": -2.0}, {" No": -0.1, " You": -4.0}, {" I": -0.1, " You": -2.0}])
    monkeypatch.setattr(labeler, "first_token", lambda *a, **k: {"text": " I", "logprobs": {
        "tokens": [" I"], "token_logprobs": [-0.1], "text_offset": [0], "top_logprobs": [next(answers)]}})
    assert labeler.score("a", 0) == pytest.approx(1.8) and labeler.score("b", 0) == pytest.approx(-3.9)
    assert labeler.score("c", 0) is annotator.UNPARSEABLE and labeler.logprobs


def test_the_labeler_asks_a_message_as_the_pool_holds_it_one_space_between_words(monkeypatch):
    """NetHack leaves a space after a y/n prompt for the cursor, two between sentences; the pool's messages
    (as messages.tsv writes them) have one between words and none at the end. The 270M model scored "Continue
    eating? [yn] (n) " above THRESHOLD and the same without the space below it; a Ranking run ate until it
    choked."""
    fake = FakeOpenAI().start()
    labeler = base_labeler(fake)
    fake.stop()
    asked = []
    monkeypatch.setattr(labeler, "score", lambda caption, server, precise=True: asked.append(caption) or 0.0)
    labeler.ask("Continue eating? [yn] (n) ")
    labeler.ask(("Continue eating? [yn] (n) ",
                 "You hear bubbling water.  It's a wall."))  # as NetHack shows it
    assert asked == ["Continue eating? [yn] (n)"] * 2 + ["You hear bubbling water. It's a wall."]


@pytest.mark.parametrize("threshold", [0.25, -0.5])
@pytest.mark.parametrize("missing", ["error", "absent"])
def test_a_server_without_log_probabilities_gets_bisected_scores_and_says_so_once(
        tmp_path, capsys, monkeypatch, missing, threshold):
    monkeypatch.setattr(annotator, "THRESHOLD", threshold)
    fake = FakeOpenAI().start()
    # llama.cpp without --logits_all answers HTTP 500; another server may leave them out
    fake.logprobs = missing
    a = Annotator(fake.url, tmp_path)
    a.send(CAPTIONS, pairs=[("It's a wall.", "You kill the newt!"),
                            ("You kill the newt!", "You kill the grid bug!")])
    assert a.wait_for(lambda: len(a.labels) == len(CAPTIONS) + 2)
    a.close()
    fake.stop()
    assert {c: a.labels[c] for c in CAPTIONS} == expected_labels() and a.stats["answers_scored"] == 0
    # pairs: from the two scores
    assert a.labels[annotator.item_key(("It's a wall.", "You kill the newt!"))] == 2
    assert a.labels[annotator.item_key(("You kill the newt!", "You kill the grid bug!"))] is None
    # the same decision: Yes where its margin > THRESHOLD
    yes, no = (str(TOKENS[w][-1]) for w in (" Yes", " No"))
    biases = [body["logit_bias"] for path, body in fake.calls if "logit_bias" in body]
    assert {yes: 100.0 - max(threshold, 0), no: 100.0 + min(threshold, 0)} in biases
    assert len(biases) >= len(CAPTIONS) + 3 * (1 + annotator.BISECTIONS)  # a label each; the pairs' 3 scores
    assert capsys.readouterr().err.count("returns no log-probabilities") == 1
    assert a.stats.get("failures", 0) == 0


@pytest.mark.parametrize("fake", ["fake-base"], indirect=True)  # chat prompts ask for the preference itself
def test_a_pair_preference_comes_from_the_two_scores_a_tie_on_one_side_of_the_threshold(fake, tmp_path,
                                                                                         monkeypatch):
    """Before, two messages on the same side were ordered by their gap: "It's a wall." won its unhelpful
    pairs."""
    monkeypatch.setattr(annotator, "TIE_MARGIN", 0.5)
    monkeypatch.setattr(annotator, "THRESHOLD", 0.8)
    fake.margins = {"You kill the newt!": 3.0, "You kill the jackal!": 2.8, "$ - 2 gold pieces.": 1.0,
                    "It's a wall.": -0.5, "It's solid stone.": -2.3, "You see here a dart.": 0.9,
                    "Never mind.": 0.6}
    pairs = [("You kill the newt!", "You kill the jackal!"), ("$ - 2 gold pieces.", "You kill the newt!"),
             ("It's a wall.", "It's solid stone."), ("It's solid stone.", "$ - 2 gold pieces."),
             ("You see here a dart.", "Never mind."), ("It's a wall.", "You see here a dart.")]
    a = Annotator(fake.url, tmp_path)
    a.send(pairs=pairs)
    assert a.wait_for(lambda: len(a.labels) == len(pairs))
    a.close()
    # both helpful or both not: a tie, however far apart; across the threshold, a tie only within TIE_MARGIN
    assert [a.labels[annotator.item_key(p)] for p in pairs] == [None, None, None, 2, None, 2]
    assert a.stats["answers_scored"] == 1 and "logprobs" in fake.calls[-1][1]


def test_demonstrations_come_from_the_dev_split_nearest_last():
    pool = annotator.load_demos()
    with open(annotator.DEMOS_FILE) as f:
        held_out = {line.split("\t")[0] for line in f if line.rstrip("\n").split("\t")[3] in ("test", "goal")}
    assert pool and not {m for m, _, _ in pool} & held_out  # the test and goal splits never reach a prompt
    shown = annotator.demonstrations("You kill the gnome lord!", pool, per_label=2)
    lines = shown.splitlines()
    assert [line.split(": ")[1] for line in lines[1::2]].count("Yes") == 2 and len(lines) == 8
    assert lines[-2].startswith("Message: You kill the ") and lines[-1] == "Progress: Yes"


def test_demos_come_from_a_tsv_or_a_runs_labels_and_a_bad_pool_is_a_one_line_error(fake, tmp_path):
    """Guards --demos: a pool from a label_sets.tsv-style file (dev rows only where it has splits) or from a
    run's labels.jsonl (captions with a label; pairs and unknowns left out; the last label wins) reaches the
    prompt; an unreadable, empty, headerless or one-class pool stops the run before it starts, in one line."""
    tsv, jsonl, flat = tmp_path / "sets.tsv", tmp_path / "labels.jsonl", tmp_path / "flat.tsv"
    tsv.write_text("message\tsteps\tlabel\tsplit\nYou slay the dragon!\t3\t1\tdev\nYou yawn.\t9\t0\tdev\n"
                   "You kill the newt!\t5\t1\ttest\n")
    flat.write_text("label\tmessage\n1\tYou slay the dragon!\n0\tYou yawn.\n")
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in [
        {"caption": "You slay the dragon!", "label": 0}, {"caption": "You yawn.", "label": 0},
        {"caption": "You hear a yawn.", "label": None}, {"pair": ["a", "b"], "preference": 1},
        {"caption": "You slay the dragon!", "label": 1}])
                     + '{"caption": "You yaw')  # a crash cut the last line
    flat.write_text(flat.read_text() + "\n")  # a blank line, as hand-edited files end
    for path in (tsv, flat, jsonl):
        client = annotator.LabelClient(client_args(fake.url, demos=str(path)))
        assert sorted((m, label) for m, label, _ in client.demos) == [
            ("You slay the dragon!", 1), ("You yawn.", 0)]
    a = Annotator(fake.url, tmp_path, demos=client.demos)
    a.send(["You slay the wolf!"])
    assert a.wait_for(lambda: len(a.labels) == 1)
    a.close()
    if fake.model == "fake-base":  # the run's pool, not the shipped one, is what the prompt shows
        assert (fake.calls[-1][1]["prompt"].count("Message: ") == 3
                and "You slay the dragon!" in fake.calls[-1][1]["prompt"])
    one_class = tmp_path / "one.tsv"
    one_class.write_text("message\tlabel\nYou yawn.\t0\nIt's a wall.\t0\n")
    headerless = tmp_path / "headerless.tsv"
    headerless.write_text("You yawn.\t0\n")
    (tmp_path / "empty.jsonl").write_text("")
    for path, says in ((tmp_path / "missing.tsv", "No such file"),
                       (tmp_path / "empty.jsonl", "hold 0 labelled"),
                       (one_class, "all labelled 0: a pool needs both labels"), (headerless, "must name")):
        with pytest.raises(SystemExit) as error:
            annotator.LabelClient(client_args(fake.url, demos=str(path)))
        assert str(error.value).startswith("error: --demos: ") and says in str(error.value)
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("where", ["same origin", "another port", "another host"])
def test_the_key_does_not_follow_a_redirect_to_another_origin(monkeypatch, where):
    """urllib keeps Authorization on a redirect, so a server could send the key anywhere: like OpenAI's
    client, the Labeler (and llm_server.start's probe, the same opener) keeps it only for the same scheme,
    host and port."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-key")
    hop, other = FakeOpenAI().start(), FakeOpenAI().start()
    target = {"same origin": hop.url, "another port": other.url,
              "another host": hop.url.replace("127.0.0.1", "localhost")}[where]
    hop.redirects["/v1/moved/models"] = f"{target}/models"
    try:
        labeler = annotator.Labeler([hop.url], None, annotator.PROMPTS, 5.0)
        assert labeler.call(f"{hop.url}/moved/models")["data"][0]["id"] == "fake-base"  # it followed
    finally:
        hop.stop()
        other.stop()
    followed = other.authorizations if where == "another port" else hop.authorizations[1:]
    assert hop.authorizations[0] == "Bearer sk-test-key"
    assert followed == ["Bearer sk-test-key" if where == "same origin" else None]


@pytest.mark.parametrize("flags, says", [
    ({"llm_url": ["notaurl"]}, "--llm-url 'notaurl' is no http:// or https:// URL"),
    ({"llm_url": ["localhost:8000"]}, "--llm-url 'localhost:8000' is no http"),
    ({"llm_url": ["ftp://example.com/v1"]}, "--llm-url 'ftp://example.com/v1' is no http"),
    ({"llm_url": ["file:///etc/passwd"]}, "--llm-url 'file:///etc/passwd' is no http"),
    ({"llm_url": ["http://127.0.0.1:8000/v1", "http://:8000/v1"]}, "--llm-url 'http://:8000/v1' is no http"),
    ({"llm_url": ["http://127.0.0.1:port/v1"]}, "--llm-url 'http://127.0.0.1:port/v1' is no http"),
    ({"llm_concurrency": 0}, "--llm-concurrency must be at least 1, not 0"),
    ({"llm_concurrency": -1}, "--llm-concurrency must be at least 1, not -1")])
def test_malformed_llm_flags_are_one_line_errors_before_anything_starts(flags, says):
    """Before, a URL that is no http(s) one was retried for the whole run as a server that is down (rc 0, no
    word), --llm-concurrency 0 became 64 and -1 crashed the annotator five times."""
    args = SimpleNamespace(**{**vars(client_args("http://127.0.0.1:8000/v1")), "llm_concurrency": None,
                              **flags})
    with pytest.raises(SystemExit) as error:
        annotator.LabelClient(args)
    assert str(error.value).startswith(f"error: {says}") and "\n" not in str(error.value)
    annotator.check_llm_flags(
        ["http://127.0.0.1:8000/v1", "https://api.example.com/v1", "http://[::1]:8000"], 1)


def test_a_bad_labels_line_is_named_by_its_line_and_column_in_the_file(tmp_path):
    """json names the line and column within the string it parses: line 41 was reported as
    "line 1 column 29"."""
    path, good = tmp_path / annotator.LABELS_FILE, "".join(json.dumps({"caption": f"c{i}", "label": 1}) + "\n"
                                                             for i in range(40))
    path.write_text(good + '{"caption": "x", "label": 1,}\n' + good)
    with pytest.raises(SystemExit,
                       match=r"^error: cannot read labels from .*labels.jsonl: line 41 column 29: "
                                         r"Expecting property name enclosed in double quotes$"):
        annotator.read_labels(path)
    # nested past Python's recursion limit: was a traceback
    path.write_text(good + "[" * 100_000 + "\n" + good)
    with pytest.raises(SystemExit,
                       match=r"^error: cannot read labels from .*labels.jsonl: line 41: maximum recursion"):
        annotator.read_labels(path)


def test_a_bad_demonstration_row_names_its_line_and_what_is_wrong(tmp_path):
    """A row short of a column was a bare IndexError; labels {2, 0} were reported as "all labelled 2"
    (or 0)."""
    cases = {"message\tlabel\tsplit\nYou yawn.\t0\tdev\nYou slay the dragon!\t1\n":
             "line 3 has no split column",
             "message\tlabel\nYou yawn.\t0\n\nYou slay the dragon!\n":
             "line 4 has no label column",  # a blank line 3
             "message\tlabel\nYou yawn.\t0\nYou slay the dragon!\t2\n": "line 3: label '2' is not 0 or 1"}
    for i, (text, says) in enumerate(cases.items()):
        path = tmp_path / f"pool{i}.tsv"
        path.write_text(text)
        with pytest.raises(SystemExit) as error:
            annotator.LabelClient(client_args(None, demos=str(path)))
        assert str(error.value) == f"error: --demos: the demonstrations {path} {says}"


def test_the_annotator_stops_in_one_line_when_the_learners_table_is_gone(tmp_path, capfd):
    """kill -9 of the learner kills its Manager (die_with_parent); the annotator, whose next write to the
    label table then fails, printed a traceback. It stops with one line and no traceback."""
    fake = FakeOpenAI().start()
    client = annotator.LabelClient(client_args(fake.url))
    client.start(str(tmp_path), set())
    try:
        client.request(dict.fromkeys(CAPTIONS, 0.0), {})
        deadline, records = time.time() + 60, []
        while len(records) < len(CAPTIONS) and time.time() < deadline:  # the annotator is at work
            records += client.new_records()
            time.sleep(0.05)
        os.kill(client.manager._process.pid, signal.SIGKILL)
        client.process.join(timeout=30)
        assert client.process.exitcode == 1
    finally:
        client.close()
        fake.stop()
    err = capfd.readouterr().err
    assert "Traceback" not in err and err == "annotator: the learner's label table is gone: stopping\n", err


def test_the_embedded_server_gets_a_key_of_its_own_that_the_annotator_sends(tmp_path, monkeypatch):
    """Without --llm-url nothing else uses the embedded server: it gets a key made for the run, so that
    another local user gets HTTP 401 (with no OPENAI_API_KEY it answered anyone), and OPENAI_API_KEY, meant
    for the URLs named on the command line, does not go to it."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-for-named-urls")
    servers = []

    def start(**kw):  # a fake in place of llama.cpp, behind the key it is given (no pid: no CPU time to read)
        servers.append(FakeOpenAI().start())
        servers[-1].key, servers[-1].pid = kw["key"], None
        return servers[-1], servers[-1].url
    monkeypatch.setattr(llm_server, "start", start)
    monkeypatch.setattr(llm_server, "stop", lambda server: server.stop())
    client = annotator.LabelClient(client_args(None))
    client.start(str(tmp_path), set())
    try:
        (fake,) = servers
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{fake.url}/models", timeout=10)
        assert refused.value.code == 401
        client.request(dict.fromkeys(CAPTIONS, 0.0), {})
        deadline, records = time.time() + 60, []
        while len(records) < len(CAPTIONS) and time.time() < deadline:
            records += client.new_records()
            time.sleep(0.05)
        assert len(records) == len(CAPTIONS)
    finally:
        client.close()
    assert len(fake.key) >= 32 and fake.key != "sk-for-named-urls"
    assert set(fake.authorizations) == {None, f"Bearer {fake.key}"} and fake.authorizations.count(None) == 1


def test_the_embedded_servers_share_is_counted_in_its_cpu_time(tmp_path, monkeypatch):
    """Guards issue 44: wall time with a request in flight is not the CPU the embedded server takes from the
    learner's cores (under load a label's wall time stretches). The share is the server process's CPU time
    (from /proc) over wall time: a server using a whole core is soon given no more (on the wall-time rule it
    would be)."""
    monkeypatch.setattr(annotator, "MAX_CREDIT_S", 1.0)  # a small credit: 0.01 s of work at share 0.01
    fake = FakeOpenAI().start()
    # stands for a server busy on a core
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        a = Annotator(fake.url, tmp_path, concurrency=1, share=0.01, server_pid=burner.pid)
        a.send([f"You see here {i} gold pieces." for i in range(10_000)])
        time.sleep(3.0)  # the burner takes far more than 0.01 of a core, even on a busy box
        a.close()
        assert fake.requests <= 2  # on the wall-time rule, thousands: each answer takes a millisecond
    finally:
        burner.kill()
        fake.stop()
    assert annotator.cpu_seconds(os.getpid()) > 0 and annotator.cpu_seconds(2 ** 30) is None


def test_a_pair_answered_free_while_it_waits_in_the_backlog_leaves_it():
    """Guards a crash (review of issue 44): a pair sent again while queued, whose two messages other pairs had
    scored meanwhile, was answered free but left in the backlog without its worth; peek() then raised KeyError
    and killed the annotator (5 times, and the run)."""
    backlog = annotator.Backlog()
    backlog.put("p", ("You kill the newt!", "It's a wall."))
    backlog.put("q", ("You kill the jackal!", "You see here a dart."), 1.0)
    backlog.forget("p")  # settled while it waited
    assert backlog.peek() == "q" and backlog.pop("q") and backlog.peek() is None and not backlog


@pytest.mark.parametrize("fake", ["fake-base"], indirect=True)  # an instruct model's pairs carry no scores
def test_a_restarted_annotator_answers_pairs_from_the_scores_its_labels_file_kept(fake, tmp_path):
    """A base model's scores lived in the annotator's memory only: after a restart or a resume every message
    was scored again, which on llama.cpp costs 1 + BISECTIONS requests a message. Saved ones are reused only
    by the same scorer: another model, prompt or demonstration pool scores afresh."""
    wall, newt = "It's  a wall.", "You kill the newt!"  # the wall as NetHack pads it: asked one space apart
    first = Annotator(fake.url, tmp_path)
    first.send(pairs=[(wall, newt)])
    assert first.wait_for(lambda: len(first.labels) == 1)
    first.close()
    record = json.loads(open(tmp_path / annotator.LABELS_FILE).read())
    assert len(record["scores"]) == 2 and record["scores"][0] < record["scores"][1] and record["scorer"]

    def restart(pair, **kwargs):  # the completions asked for a pair, and its answer
        asked = len(fake.calls)
        again = Annotator(fake.url, tmp_path, known=[annotator.item_key((wall, newt))], **kwargs)
        again.send(pairs=[pair])
        assert again.wait_for(lambda: len(again.labels) == 1)
        again.close()
        return ([path for path, _ in fake.calls[asked:] if path.endswith("completions")],
                again.labels[annotator.item_key(pair)])
    assert restart((newt, "It's a wall.")) == ([], 1)  # both scored before the restart: nothing asked
    pool = annotator.load_demos()
    asked, answer = restart((newt, wall), demos=pool[:-1])  # another pool: its own scores
    assert len(asked) == 2 and answer == 1
    for bad in ([1.0], ["high", 0.0], [True, 0.0], "1.0 0.0"):  # what a resume refuses, named by its line
        assert not annotator.valid_record({"pair": ["a", "b"], "preference": 1, "scores": bad})


def test_a_line_a_killed_annotator_left_half_written_is_cut_before_the_next_one_appends(fake, tmp_path):
    """Appended to, the half line and the next record made one corrupt line that no resume could read."""
    path = tmp_path / annotator.LABELS_FILE
    path.write_text('{"caption": "You kill the newt!", "label": 1}\n{"caption": "It\'s a w')
    a = Annotator(fake.url, tmp_path)
    a.send(["You see here 5 gold pieces."])
    assert a.wait_for(lambda: len(a.labels) == 1)
    a.close()
    assert [r["caption"] for r in annotator.read_labels(str(path))] == ["You kill the newt!",
                                                                       "You see here 5 gold pieces."]
