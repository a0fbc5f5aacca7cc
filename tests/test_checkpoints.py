"""Checkpoints hold only what torch.load(weights_only=True) reads, so that loading a shared one cannot run
code; one that needs pickle, or of another format, is refused; bad files are one-line errors."""
import collections
import dataclasses
import json
import pickle
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import evaluate
import oni_appo
import reward_models as rm
import run_files
import learning_curves
from test_reward_models import LABELLED, STEPS, steps_of


class WritesAFile:
    """Unpickled with pickle, it calls open(path, "w"): the file appears. Any code could run instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def saved_run(tmp_path, reward_type):
    """A learner's state as train() holds it, trained a little: the policy and its optimizer after a step, the
    reward model after a few batches of STEPS (classification and ranking: trained and published)."""
    torch.manual_seed(0)
    args = oni_appo.Args(reward_type=reward_type, batch_size=256, extrinsic_coef=0.0, run_dir=str(tmp_path))
    agent = oni_appo.Agent()
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-4)
    for parameter in agent.parameters():  # an Adam step: its state holds tensors and a step count
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    intrinsic = rm.IntrinsicReward(args, "cpu")
    intrinsic.add_labels(labels(reward_type))
    for _ in range(3):
        intrinsic.rewards(*steps_of(STEPS))
        intrinsic.requests.label_requests()
    if reward_type in ("classification", "ranking"):
        assert intrinsic.piece.train_now(2, batch_size=8) == 2
    tally = SimpleNamespace(counters={"collected_steps": 640, "updates": 2, "episodes": 1}, saved_totals={},
                            sums=collections.Counter(max_reward=0.5), start_time=time.time(), start_steps=0,
                            sessions=[oni_appo.run_record(args)])
    return SimpleNamespace(args=args, agent=agent, optimizer=optimizer, intrinsic=intrinsic, client=None,
                           tally=tally)


def labels(reward_type):
    if reward_type == "ranking":
        return [{"pair": ["It's a wall.", f"You kill the {m}!"], "preference": 2} for m in ("newt", "jackal")]
    return [{"caption": t, "label": label} for t, *_, label in LABELLED]


def resumed_state(run, checkpoint):
    """The reward model's state after a resume from checkpoint["intrinsic"], as set_up() does it."""
    intrinsic = rm.IntrinsicReward(run.args, "cpu")
    intrinsic.add_labels(labels(run.args.reward_type))
    intrinsic.load_state_dict(checkpoint["intrinsic"])
    return run_files.loadable(intrinsic.state_dict())


def assert_same(a, b, where="state"):
    assert type(a) is type(b) or isinstance(a, dict) and isinstance(b, dict), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def refusal(load) -> str:
    with pytest.raises(SystemExit) as stop:
        load()
    message = str(stop.value)
    assert len(message.splitlines()) == 1 and message.startswith("error: "), message
    return message


def test_a_checkpoint_whose_pickle_would_run_code_is_refused_and_runs_none(tmp_path):
    marker = tmp_path / "written_by_the_checkpoint"
    path = tmp_path / "run" / "checkpoint.pt"
    path.parent.mkdir()
    torch.save({"model": {}, "args": dataclasses.asdict(oni_appo.Args()), "counters": {},
                "payload": WritesAFile(str(marker))}, path)
    for load in (lambda: oni_appo.load_checkpoint(str(path)),  # --resume, evaluate.py and learning_curves.py
                 lambda: oni_appo.parse_args(["--resume", str(path.parent)]),
                 lambda: evaluate.evaluate(evaluate.Args(str(path), device="cpu")),
                 lambda: learning_curves.random_games(str(path.parent))):
        message = refusal(load)
        assert f"{path} needs pickle to load (io.open)" in message and "it is not loaded" in message, message
        assert not marker.exists()


def test_a_checkpoint_of_another_format_is_refused_in_one_line_that_names_the_way_back(tmp_path):
    """Guards issue 46 item 3: the loaders carried branches for three past layouts; a checkpoint now says its
    format, and any other (or none) is refused before anything reads it."""
    run = saved_run(tmp_path, "retrieval")
    oni_appo.save(run)
    path = tmp_path / "checkpoint.pt"
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["format"] == oni_appo.CHECKPOINT_FORMAT
    for form in (None, oni_appo.CHECKPOINT_FORMAT + 1):
        torch.save({k: v for k, v in checkpoint.items() if k != "format"}
                   | ({"format": form} if form else {}), path)
        for load in (lambda: oni_appo.load_checkpoint(str(path)),
                     lambda: oni_appo.parse_args(["--resume", str(path)])):
            assert refusal(load) == (f"error: {path} is a checkpoint of format {form or 'none'}; this code "
                                     f"reads format {oni_appo.CHECKPOINT_FORMAT}: use the commit that wrote "
                                     "it (its summary.json's sessions name it)")


@pytest.mark.parametrize("reward_type", ["retrieval", "classification", "ranking"])
def test_a_saved_checkpoint_loads_safely_and_resumes_as_the_state_itself(tmp_path, reward_type):
    """Through the file, with weights_only=True: the policy, its optimizer and the reward model come back as a
    resume from the state in memory brings them back (the exact-resume tests start from there)."""
    run = saved_run(tmp_path, reward_type)
    oni_appo.save(run)
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    agent, in_memory = oni_appo.Agent(), {"intrinsic": run.intrinsic.state_dict()}
    oni_appo.load_checkpoint(str(tmp_path), agent)
    assert_same(agent.state_dict(), run.agent.state_dict())
    assert_same(checkpoint["optimizer"], run.optimizer.state_dict())
    assert_same(resumed_state(run, checkpoint), resumed_state(run, in_memory))
    assert checkpoint["intrinsic"]["seen"][0] and isinstance(checkpoint["intrinsic"]["seen"][1], torch.Tensor)
    assert run_files.loadable({"n": np.float64(0.5), "c": collections.Counter(a=1)}) == {
        "n": 0.5, "c": {"a": 1}}


def test_a_checkpoint_counts_the_steps_learned_and_a_resume_collects_again_from_there(tmp_path, capsys):
    """A checkpoint holds the steps learned, not the ones collected ahead of them. A resume collects again
    from there and keeps the episodes that ended up to there."""
    run = saved_run(tmp_path, "retrieval")  # 512 steps learned (2 updates of 256), 640 collected
    oni_appo.save(run)
    path = tmp_path / "checkpoint.pt"
    assert torch.load(path, weights_only=True)["counters"] == {"learned_steps": 512, "updates": 2,
                                                               "episodes": 1}
    (tmp_path / "episodes.jsonl").write_text("".join(json.dumps({"return": 0.0, "env_steps": s}) + "\n"
                                                     for s in (100, 512, 600)))
    args = dataclasses.replace(run.args, resume=str(path))
    agent = oni_appo.Agent()
    intrinsic = rm.IntrinsicReward(args, "cpu")
    intrinsic.add_labels(labels(args.reward_type))
    counters = {"collected_steps": 0, "updates": 0, "episodes": 0}
    oni_appo.restore(args, agent, torch.optim.Adam(agent.parameters(), lr=1e-4), intrinsic, counters)
    assert counters == {"collected_steps": 512, "updates": 2, "episodes": 2}  # those kept
    assert f"resumed from {path} at 512 env steps" in capsys.readouterr().out
    assert [json.loads(e)["env_steps"] for e in open(tmp_path / "episodes.jsonl")] == [100, 512]


def test_a_truncated_or_foreign_file_is_a_one_line_error(tmp_path, recwarn):
    run = saved_run(tmp_path, "retrieval")
    oni_appo.save(run)
    whole = (tmp_path / "checkpoint.pt").read_bytes()
    files = {"half.pt": whole[:len(whole) // 2], "empty.pt": b"", "notes.pt": b"hello, not a checkpoint\n",
             "pickled.pkl": pickle.dumps({"a": 1})}  # torch warns of its protocol, then fails
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    np.save(tmp_path / "array.npy", np.zeros(3))
    torch.save(run.agent.state_dict(), tmp_path / "weights.pt")  # a bare state_dict, as other projects save
    torch.save({"format": 1, "model": {}, "args": ["--seed", "1"], "counters": {}},
               tmp_path / "other.pt")  # not ours
    for name in ("weights.pt", "other.pt"):  # other.pt: an AttributeError and its traceback
        assert refusal(lambda: oni_appo.load_checkpoint(str(tmp_path / name))) == (
            f"error: {tmp_path / name} is not a checkpoint of oni_appo.py")
    for name in [*files, "array.npy"]:
        path = tmp_path / name
        message = refusal(lambda: oni_appo.load_checkpoint(str(path)))
        assert message.startswith(f"error: cannot read checkpoint {path}"), message
        assert "weights_only" not in message  # never the advice to load it with pickle
    assert not recwarn.list


def test_a_checkpoint_the_disk_cannot_hold_leaves_the_last_whole_one_and_no_partial_file(
        tmp_path, monkeypatch):
    """Guards issue 45 item 4: a full disk at a checkpoint left a partial checkpoint.pt.tmp beside the last
    one."""
    path = str(tmp_path / "checkpoint.pt")
    run_files.write_checkpoint({"format": 1, "counters": {"updates": 1}}, path)

    def full_disk(state, target):
        open(target, "wb").write(b"half a checkpoint")
        raise OSError(28, "No space left on device", target)
    monkeypatch.setattr(oni_appo.torch, "save", full_disk)
    with pytest.raises(OSError):
        run_files.write_checkpoint({"format": 1, "counters": {"updates": 2}}, path)
    monkeypatch.undo()
    assert not (tmp_path / "checkpoint.pt.tmp").exists()
    assert torch.load(path, weights_only=True)["counters"] == {"updates": 1}
