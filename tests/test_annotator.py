"""The annotator against a fake OpenAI server with injected faults, its parsing, and training runs
whose LLM server is down or dies mid-run."""
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

import annotator
from fake_openai import FakeOpenAI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAPTIONS = ["You kill the newt!", "It's a wall.", "You see here 5 gold pieces.",
            "The jackal bites!", "You kill the grid bug!"]


class Annotator:
    """`annotator.serve` in a thread, with plain containers in place of the Manager's proxies."""

    def __init__(self, url, run_dir, known=(), timeout_s=5.0):
        self.requests, self.stop = queue.Queue(), threading.Event()
        self.labels, self.log, self.stats = {}, [], {}
        self.thread = threading.Thread(target=annotator.serve, daemon=True, args=(
            [url], None, annotator.PROMPTS, self.requests, self.labels, self.log, self.stats,
            self.stop, str(run_dir), set(known), timeout_s))
        self.thread.start()

    def send(self, captions=(), pairs=()):
        self.requests.put((list(captions), list(pairs)))

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


@pytest.fixture
def fake():
    server = FakeOpenAI().start()
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
    assert a.labels[annotator.pair_key("It's a wall.", "You kill the newt!")] == 2
    assert a.stats["labels"] == 6 and a.stats["requests"] == 6 and a.stats.get("failures", 0) == 0
    lines = [json.loads(x) for x in open(tmp_path / annotator.LABELS_FILE)]
    assert len(lines) == 6 and {"pair": ["It's a wall.", "You kill the newt!"], "preference": 2} in lines
    assert lines == a.log


def test_server_down_at_start(tmp_path):
    fake = FakeOpenAI()
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


def test_http_500s_are_retried(fake, tmp_path):
    fake.fail_next = 3
    a = Annotator(fake.url, tmp_path)
    a.send(CAPTIONS)
    assert a.wait_for(lambda: len(a.labels) == len(CAPTIONS))
    a.close()
    assert a.labels == expected_labels()
    assert a.stats["failures"] == 3 and a.stats["requests"] == len(CAPTIONS) + 3


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


def test_garbage_answers_are_counted_retried_once_then_unknown(fake, tmp_path):
    fake.mode = "garbage"
    a = Annotator(fake.url, tmp_path)
    a.send(CAPTIONS[:3], pairs=[("a", "b")])
    assert a.wait_for(lambda: len(a.labels) == 4)
    a.close()
    assert set(a.labels.values()) == {None}
    assert a.stats["parse_failures"] == 8 and a.stats["requests"] == 8 and a.stats["labels"] == 4


def test_known_captions_are_not_asked_again_and_the_backlog_is_bounded(fake, tmp_path, monkeypatch):
    a = Annotator(fake.url, tmp_path, known={"You kill the newt!"})
    a.send(["You kill the newt!", "It's a wall."])
    assert a.wait_for(lambda: len(a.labels) == 1)
    a.close()
    assert list(a.labels) == ["It's a wall."] and fake.requests == 1

    monkeypatch.setattr(annotator, "MAX_BACKLOG", 3)
    fake.stop()
    b = Annotator(fake.url, tmp_path)
    b.send([f"message {i}" for i in range(10)])
    assert b.wait_for(lambda: b.stats.get("dropped", 0) == 7 and b.stats.get("backlog") is not None)
    b.close()
    assert b.stats["backlog"] + b.stats["in_flight"] <= 3


@pytest.mark.parametrize("text,label", [
    ("The newt is weak. <label>FOO</label>", 1),
    ("Answer FOO/BAR inside the tag... <label> bar </label>", 0),
    ("I would say FOO/BAR is a choice; <label>BAR</label> and finally <label>FOO</label>", 1),
    ("FOO", annotator.UNPARSEABLE),  # the reference counted any mention of FOO as a yes
    ("<label>MAYBE</label>", annotator.UNPARSEABLE),
    ("", annotator.UNPARSEABLE),
])
def test_parse_label(text, label):
    assert annotator.parse_label(text) is label if label is annotator.UNPARSEABLE else annotator.parse_label(text) == label


@pytest.mark.parametrize("text,preference", [
    ('Both matter, but ("best_description": 2)', 2),
    ('{"best_description": 1} ... ("best_description": 2)', 1),  # the first answer counts
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
                           "--batch-size", "256", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_training_with_no_llm_listening_completes(tmp_path):
    run_dir = tmp_path / "run"
    result = train(["--reward-type", "retrieval", "--llm-url", "http://127.0.0.1:9/v1",
                    "--total-env-steps", "6000", "--run-dir", str(run_dir)])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["env_steps"] >= 6000 and summary["llm_labels"] == 0 and summary["llm_failures"] > 0


def test_training_survives_a_server_that_dies_and_comes_back(tmp_path):
    fake = FakeOpenAI().start()
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "oni_appo.py", "--num-workers", "2", "--num-envs-per-worker", "4",
                             "--batch-size", "256", "--reward-type", "classification", "--llm-url", fake.url,
                             "--total-env-steps", "20000", "--run-dir", str(run_dir)],
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
    labelled = [json.loads(x)["caption"] for x in open(run_dir / annotator.LABELS_FILE)]
    assert len(labelled) == len(set(labelled)) == summary["llm_labels"]  # each asked once


def test_ctrl_c_to_the_whole_process_group_saves_and_exits_cleanly(tmp_path):
    """Ctrl-C reaches every process of the group: the annotator and its Manager must survive it."""
    fake = FakeOpenAI().start()
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "oni_appo.py", "--num-workers", "2", "--num-envs-per-worker", "4",
                             "--batch-size", "256", "--reward-type", "retrieval", "--llm-url", fake.url,
                             "--run-dir", str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    for line in proc.stdout:
        if "llm labels" in line and "llm labels 0 " not in line:
            break
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    fake.stop()
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["llm_labels"] > 0
    assert (run_dir / "checkpoint.pt").exists()


def test_prompt_file_replaces_templates_and_bad_files_are_clear_errors(tmp_path, fake):
    from types import SimpleNamespace
    custom = tmp_path / "prompts.json"
    custom.write_text(json.dumps({"label_completion": "Is this good in NetHack?\nMessage: {caption}\nProgress:"}))
    client = annotator.LabelClient(SimpleNamespace(prompt_file=str(custom), llm_url=[fake.url], llm_model=None))
    assert client.prompts["label_completion"].startswith("Is this good in NetHack?")
    assert client.prompts["label_user"] == annotator.PROMPTS["label_user"]  # the rest stays
    labeler = annotator.Labeler([fake.url], None, client.prompts, 5.0)
    labeler.resolve_model()
    assert labeler.ask("You kill the newt!") == 1
    chat = annotator.Labeler([fake.url], "Llama-3.1-8B-Instruct", client.prompts, 5.0)
    chat.resolve_model()
    assert chat.style == "chat" and labeler.style == "completion"
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(SystemExit, match="cannot read --prompt-file"):
        annotator.LabelClient(SimpleNamespace(prompt_file=str(broken)))
