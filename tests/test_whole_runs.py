"""Whole runs of the learner on NLE: start, stop, resume, signals, the run-dir lock, bad flags, dead
processes, the checkpoints a real run writes, and a real run's updates checked exactly (log-probs, rewards,
seeds)."""
import collections
import contextlib
import copy
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import annotator
import oni_appo
import run_files
from oni_appo import End

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_RUN = ["--num-workers", "2", "--num-envs-per-worker", "4", "--batch-size", "256",
             "--reward-type", "none"]


def run(args, timeout=600, **kw):
    return subprocess.run([sys.executable, "oni_appo.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, **kw)


def evaluate(args, timeout=600):
    return subprocess.run([sys.executable, "evaluate.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_end_to_end_on_nle_then_resume(tmp_path):
    run_dir = str(tmp_path / "run")
    first = run(SMALL_RUN + ["--total-env-steps", "10000", "--run-dir", run_dir, "--seed", "3"])
    assert first.returncode == 0, first.stderr[-2000:]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["env_steps"] >= 10000 and summary["updates"] >= 10000 // 256 - 12
    # one batch queued while the learner works, not two: data at most ~2 updates old (was ~2.8)
    assert summary["policy_lag_mean"] < 2.5
    for key in ("sps", "episodes", "mean_episode_return", "mean_score", "mean_depth", "mean_explored"):
        assert key in summary
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(run_dir))
    checkpoint = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=False)
    assert checkpoint["counters"]["learned_steps"] == summary["env_steps"]
    # what was learned, not what was collected (12,000 vs 11,776): a resume collects the rest again
    assert checkpoint["counters"]["learned_steps"] == checkpoint["counters"]["updates"] * 256
    assert "steps/s" in first.stdout

    # logged after the checkpoint, then a crash:
    with open(os.path.join(run_dir, "episodes.jsonl"), "a") as f:
        f.write(json.dumps({"return": 0.0, "steps": 1, "score": 12345, "env_steps": summary["env_steps"] + 1})
                + "\n")
        f.write('{"return": 1.0, "ste')  # and a line cut short
    labels = os.path.join(run_dir, "labels.jsonl")
    with open(labels, "w") as f:  # a labels file whose last write a crash cut short
        f.write(json.dumps({"caption": "It's a wall.", "label": 0}) + '\n{"caption": "You kill')
    second = run(["--resume", run_dir, "--total-env-steps", "14000"])
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"resumed from {run_dir}/checkpoint.pt at {summary['env_steps']:,} env steps" in second.stdout
    resumed = json.load(open(os.path.join(run_dir, "summary.json")))
    assert resumed["env_steps"] >= 14000 and resumed["updates"] > summary["updates"]
    assert torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=False)["args"]["seed"] == 3

    episodes = [json.loads(line) for line in open(os.path.join(run_dir, "episodes.jsonl"))]
    assert len(episodes) == resumed["episodes"] and all(e["score"] != 12345 for e in episodes)  # played again
    # labels.jsonl is appendable again
    assert open(labels).read() == json.dumps({"caption": "It's a wall.", "label": 0}) + "\n"
    assert all(e["intrinsic_return"] == 0.0 for e in episodes if "intrinsic_return" in e)  # reward type none
    # all but those the learner missed
    assert sum("intrinsic_return" in e for e in episodes) >= len(episodes) - 16
    # when it ended, by the steps collected: at most the 8 buffers in flight (8 x 32 x 2 steps) past those
    # learned
    assert all(0 < e["env_steps"] <= resumed["env_steps"] + 512 for e in episodes)
    lines = open(os.path.join(run_dir, "messages.tsv")).read().splitlines()
    assert lines[0] == "message\tsteps\tlabel\treward_now\tpaid\tfirsts" and len(lines) > 2

    evaluation = evaluate([run_dir, "--episodes", "2"])
    assert evaluation.returncode == 0, evaluation.stderr[-2000:]
    assert "2 episodes of NetHackScoreExtendedActions-v1" in evaluation.stdout
    assert len(json.load(open(os.path.join(run_dir, "eval.json")))["episodes"]) == 2
    baseline = evaluate([run_dir, "--episodes", "2", "--random"])
    assert baseline.returncode == 0 and "with random actions" in baseline.stdout, baseline.stderr[-2000:]
    assert json.load(open(os.path.join(run_dir, "eval_random.json")))["random_actions"] is True


@pytest.mark.parametrize("to_group", [False, True])
def test_sigterm_saves_a_checkpoint_and_stops_the_workers(tmp_path, to_group):
    """SIGTERM to the trainer, or to its whole process group as a scheduler sends it (there with an LLM reward
    type, whose annotator and Manager are in the group too): a clean stop with a checkpoint and no process
    left. Sent to the group, the acting process died at once and the run ended with "the acting process died"
    (2 runs in 4); the Manager died with it and the run ended in a traceback; and the old check for leftovers
    (pgrep of a parent pid in spawn_main's command line) could not match anything."""
    from fake_openai import FakeOpenAI
    run_dir, fake = str(tmp_path / "run"), FakeOpenAI().start() if to_group else None
    llm = ["--reward-type", "classification", "--llm-url", fake.url] if to_group else []
    proc = subprocess.Popen([sys.executable, "oni_appo.py", *SMALL_RUN, *llm, "--run-dir", run_dir],
                            start_new_session=True, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        for line in proc.stdout:  # wait for the first progress line
            if "steps/s" in line:
                break
        # the acting process and its 2 workers (+ the Manager, the annotator)
        assert len(descendants(proc.pid)) >= 3
        if to_group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        # a stop, not an end
        assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err[-2000:]
        # a stop is no crash: no annotator started again (it dies of the SIGTERM)
        assert "restarting" not in err
        assert os.path.exists(os.path.join(run_dir, "checkpoint.pt"))
        assert json.load(open(os.path.join(run_dir, "summary.json")))["env_steps"] > 0
        deadline = time.time() + 10  # any process of the run's session, started before the signal or after it
        while (left := in_session(proc.pid)) and time.time() < deadline:
            time.sleep(0.2)
        assert not left, left
    finally:
        proc.kill()
        for pid in in_session(proc.pid):
            with contextlib.suppress(ProcessLookupError):  # gone since
                os.kill(pid, signal.SIGKILL)
        if fake is not None:
            fake.stop()


def in_session(sid):
    """The live processes (zombies excluded) of session sid."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[3]) == sid:  # state, parent, group, session
                found.append(int(pid))
    return found


@pytest.mark.parametrize("argv,message", [
    (["--task", "NoSuchTask-v0"],
     "error: unknown task 'NoSuchTask-v0'; known tasks: NetHackScoreExtendedActions-v1"),
    (["--reward-type", "bogus"], "error: unknown reward type 'bogus'; choose one of none, retrieval"),
    (["--num-envs-per-worker", "3"],
     "error: need --num-workers, --rollout, --batch-size, --total-env-steps >= 1 and an even"),
    (["--batch-size", "0"],
     "error: need --num-workers, --rollout, --batch-size, --total-env-steps >= 1 and an even"),
    (["--rollout", "0"], "error: need --num-workers, --rollout, --batch-size, --total-env-steps >= 1"),
    (["--total-env-steps", "0"],
     "error: need --num-workers, --rollout, --batch-size, --total-env-steps >= 1"),
    (["--total-env-steps", "-5"],
     "error: need --num-workers, --rollout, --batch-size, --total-env-steps >= 1"),
    (["--llm-concurrency", "0"], "error: --llm-concurrency must be at least 1, not 0"),
    (["--llm-url", "localhost:8000"], "error: --llm-url 'localhost:8000' is no http:// or https:// URL"),
    (["--batch-size", "100"], "error: --batch-size (100) must be a multiple of"),
    (["--resume", "/nonexistent/run"], "error: no checkpoint at /nonexistent/run"),
    (["--device", "nonsense"], "error: cannot use device 'nonsense'"),
    (["--max-episode-steps", "0"],
     "error: need --max-episode-steps >= 1, --llm-threads >= 1, 0 < --reward-model-share"),
    (["--llm-threads", "0"],
     "error: need --max-episode-steps >= 1, --llm-threads >= 1, 0 < --reward-model-share"),
    (["--reward-model-share", "0"],
     "error: need --max-episode-steps >= 1, --llm-threads >= 1, 0 < --reward-model-share"),
    (["--reward-model-share", "1.5"],
     "error: need --max-episode-steps >= 1, --llm-threads >= 1, 0 < --reward-model-share"),
    (["--llm-share", "0"],
     "error: need --max-episode-steps >= 1, --llm-threads >= 1, 0 < --reward-model-share"),
    (["--llm-share", "1.5"],
     "error: need --max-episode-steps >= 1, --llm-threads >= 1, 0 < --reward-model-share"),
])
def test_bad_flags_are_one_line_errors(argv, message, tmp_path):
    result = run(["--total-env-steps", "1000", "--run-dir", str(tmp_path / "r"), *argv],
                 timeout=120)  # argv's last
    assert result.returncode != 0
    assert result.stderr.strip().startswith(message), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_a_run_dir_is_held_by_one_learner_and_freed_when_it_dies(tmp_path):
    """Guards issue 45 item 2: two learners on one run dir both ran to the end, interleaving episodes.jsonl
    and labels.jsonl. The second gets one line naming the holder; a holder killed with -9 frees the dir."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c",
                               "import run_files, sys, time; lock = run_files.hold(sys.argv[1]); "
                               "print('held', flush=True); time.sleep(600)", str(run_dir)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        second = run([*SMALL_RUN, "--total-env-steps", "1000", "--run-dir", str(run_dir)], timeout=120)
        assert second.returncode != 0 and second.stderr.strip() == (
            f"error: --run-dir {run_dir} is in use by another learner (pid {holder.pid} on "
            f"{socket.gethostname()})")
    finally:
        holder.kill()
        holder.wait()
    lock = run_files.hold(str(run_dir))  # the kernel freed the lock of the killed process
    lock.close()
    (tmp_path / "file").write_text("")
    bad = run([*SMALL_RUN, "--total-env-steps", "1000", "--run-dir", str(tmp_path / "file" / "run")],
              timeout=120)
    assert bad.returncode != 0 and bad.stderr.startswith("error: cannot write to --run-dir") and len(
        bad.stderr.strip().splitlines()) == 1


def test_a_resume_sends_the_key_only_to_servers_named_on_its_command_line(tmp_path, monkeypatch, capsys):
    """Guards issue 45 item 1: --resume took llm_url from the checkpoint, so resuming someone's run dir sent
    OPENAI_API_KEY and every message to the server its author named."""
    import dataclasses
    path = str(tmp_path / "checkpoint.pt")
    saved = oni_appo.Args(reward_type="ranking", llm_url=["http://elsewhere:9/v1"], run_dir=str(tmp_path))
    torch.save({"format": 1, "model": {}, "counters": {}, "args": dataclasses.asdict(saved)}, path)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-mine")
    with pytest.raises(SystemExit, match="OPENAI_API_KEY goes only to servers named on this command line"):
        oni_appo.parse_args(["--resume", path])
    assert oni_appo.parse_args(["--resume", path, "--llm-url", "http://mine:8/v1"]).llm_url == [
        "http://mine:8/v1"]
    monkeypatch.delenv("OPENAI_API_KEY")  # no key to lose: the saved server is asked, and the run says so
    assert oni_appo.parse_args(["--resume", path]).llm_url == ["http://elsewhere:9/v1"]
    assert "--resume: asking the run's --llm-url http://elsewhere:9/v1" in capsys.readouterr().err


def test_ctrl_c_twice_still_saves_exits_130_and_a_garbage_episode_line_is_one_error_on_resume(tmp_path):
    """Guards issue 45 item 4: a second Ctrl-C raised KeyboardInterrupt (46 lines, and the work since the last
    checkpoint lost), an interrupted run exited 0 like a finished one, and a garbage line in episodes.jsonl
    stopped a resume with a traceback."""
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "oni_appo.py", *SMALL_RUN, "--run-dir", run_dir], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if "steps/s" in line:
                break
        proc.send_signal(signal.SIGINT)
        for line in proc.stdout:  # the first is taken: a second, while it stops
            if "stopping, saving a checkpoint" in line:
                break
        time.sleep(0.3)  # (two signals at once are one to Python)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert "signal 2: still stopping, saving a checkpoint" in out
    assert os.path.exists(os.path.join(run_dir, "checkpoint.pt"))
    episodes = os.path.join(run_dir, "episodes.jsonl")
    with open(episodes, "a") as f:
        f.write('{"return": 1.0, "steps"\n{"env_steps": 1}\n')
    bad_line = len(open(episodes).readlines()) - 1
    resumed = run(["--resume", run_dir, "--total-env-steps", "100000"], timeout=120)
    assert resumed.returncode != 0 and resumed.stderr.startswith(
        f"error: {episodes} line {bad_line} is not an episode record (JSONDecodeError") and len(
        resumed.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("files", [["episodes.jsonl", "labels.jsonl"], ["checkpoint.pt"],
                                   ["episodes.jsonl.gz"]])  # The last: a run committed to results/.
def test_a_fresh_start_into_an_earlier_runs_directory_is_refused(files, tmp_path):
    """A run killed before its first checkpoint left its logs: a fresh start appended the new run's labels to
    them (five_1m's Classification seed 3), and one into a finished run's directory would overwrite its
    checkpoint."""
    for name in files:
        (tmp_path / name).write_text("earlier\n")
    with pytest.raises(SystemExit) as stop:
        oni_appo.parse_args(["--run-dir", str(tmp_path)])
    remedy = "--resume it, or move them aside" if "checkpoint.pt" in files else "move them aside"  # no resume
    assert str(stop.value) == f"error: --run-dir {tmp_path} holds a run ({', '.join(files)}): {remedy}"
    assert all((tmp_path / name).read_text() == "earlier\n" for name in files)  # nothing touched
    assert oni_appo.parse_args(["--run-dir", str(tmp_path / "new")]).run_dir == str(tmp_path / "new")


def test_corrupt_and_mismatched_checkpoints_are_clear_errors(tmp_path):
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"\x80\x02 not a checkpoint")
    result = run(["--resume", str(corrupt)], timeout=120)
    assert result.returncode != 0 and result.stderr.startswith(f"error: cannot read checkpoint {corrupt}")
    assert "Traceback" not in result.stderr
    agent = oni_appo.Agent()
    state = agent.state_dict()
    state["actor.weight"] = torch.zeros(5, 512)
    mismatched = tmp_path / "mismatched.pt"
    torch.save({"format": 1, "model": state, "args": vars(oni_appo.Args()), "counters": {}}, mismatched)
    result = evaluate([str(mismatched)], timeout=120)
    assert result.returncode != 0 and "does not match this policy" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("victim, error", [("worker", "error: env worker"),
                                           ("acting", "error: the acting process died")])
def test_a_dead_worker_ends_the_run_with_a_clear_error_and_a_checkpoint(tmp_path, victim, error):
    """A dead env worker or acting process (the learner's child; the workers are its children) must stop the
    run with a one-line error and a checkpoint, not leave the learner waiting for rollouts that never come."""
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "oni_appo.py", *SMALL_RUN, "--run-dir", run_dir],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if "steps/s" in line:
            break
    spawned = lambda pid: subprocess.run(["pgrep", "-P", str(pid), "-f", "spawn_main"],
                                         capture_output=True, text=True).stdout.split()
    acting, = spawned(proc.pid)
    os.kill(int(spawned(acting)[0] if victim == "worker" else acting), signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert err.strip().splitlines()[-1].startswith(error) and "Traceback" not in err, err[-3000:]
    assert f"--resume {run_dir}" in err
    assert torch.load(os.path.join(run_dir, "checkpoint.pt"),
                      weights_only=True)["counters"]["learned_steps"] > 0


def train_in_process(tmp_path, argv, monkeypatch, loss_hook=None, name="run"):
    """oni_appo.train in this process (its env workers are still spawned), so a test can look at
    every learner update through a wrapper of appo_loss."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    if loss_hook is not None:
        real_loss = oni_appo.appo_loss
        monkeypatch.setattr(oni_appo, "appo_loss", lambda *a: loss_hook(real_loss, *a))
    try:
        return oni_appo.train(oni_appo.parse_args(argv + ["--run-dir", str(tmp_path / name)]))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


# the first messages of an episode (NetHack's welcome; a game with a new or full moon opens with the moon's):
# no step of the policy produces one, so a learner that pays them read the next observation's message, not the
# step's
FIRST_MESSAGES = ("Hello Agent, welcome to NetHack!  You are a neutral male human Monk.",
                  "Be careful!  New moon tonight.", "You are lucky!  Full moon tonight.")


def test_the_learner_recomputes_every_log_prob_and_pays_each_step_its_own_message(tmp_path, monkeypatch):
    """On-policy exactness: with the optimizer step a no-op (lr 0), the learner's log-prob of every
    taken action equals the one the actor stored, at every kind of boundary. And the reward of every learned
    step is its own message's (Retrieval, the first messages labelled helpful): R / N^beta at its own count,
    nothing at a reset step, a death paid for its last message, not the next episode's first."""
    import envs
    import reward_models
    gaps = {name: [] for name in ("rollout start", "running", "after a death", "truncated", "reset",
                                  "after a reset")}
    labels = {**dict.fromkeys(FIRST_MESSAGES, 1), "It's a wall.": 1, "It's solid stone.": 0}
    labels_file = str(tmp_path / "labels.jsonl")
    with open(labels_file, "w") as f:
        f.writelines(json.dumps({"caption": c, "label": v}) + "\n" for c, v in labels.items())
    monkeypatch.setattr(reward_models, "NEEDS_LLM", ())  # no annotator: these labels are all it pays
    taken, real_take_batch, paid_running, deaths = [], oni_appo.take_batch, [], []

    def take_batch(run, rollouts):  # each step's own message, as the workers wrote it
        taken.append(real_take_batch(run, rollouts))
        return taken[-1]

    def check(real_loss, agent, batch, rewards, args):
        end = batch["end"]
        with torch.no_grad():
            logits, _ = agent.unroll(batch["obs"], batch["h0"], oni_appo.episode_cut(end))
            logp = torch.log_softmax(logits[:-1], -1).gather(-1, batch["action"][..., None]).squeeze(-1)
        gap = (logp - batch["logprob"]).abs()
        previous = torch.cat([torch.full_like(end[:1], -1), end[:-1]])
        for name, where in (("rollout start", previous == -1), ("running", (previous == 0) & (end == 0)),
                            ("after a death", previous == End.TERMINATED),
                            ("truncated", end == End.TRUNCATED),
                            ("reset", end == End.RESET), ("after a reset", previous == End.RESET)):
            gaps[name].append(gap[where])
        learned, step_message = taken.pop()[:2]
        assert learned is batch and not taken
        # a step that did not end its episode shows its message in the next observation; a reset step has none
        shown = (end == End.RUNNING) | (end == End.TRUNCATED)
        assert torch.equal(step_message[shown], batch["obs"]["message"][1:][shown])
        assert not step_message[end == End.RESET].any() and (batch["step_count"][end == End.RESET] == 1).all()
        texts = [[envs.message_bytes(m.numpy()).decode("latin-1") for m in row] for row in step_message]
        R = torch.tensor([[float(labels.get(t, 0)) for t in row] for row in texts])
        extrinsic = (batch["reward"] * args.reward_scale).clamp(-args.reward_clip, args.reward_clip)
        paid = R / batch["step_count"].float() ** 3  # R / N^beta
        expected = args.extrinsic_coef * extrinsic + args.intrinsic_coef * paid
        torch.testing.assert_close(rewards, expected)
        paid_running.append((R[end == End.RUNNING] > 0).sum().item())
        deaths.extend(t for row, ends in zip(texts, end.tolist())
                      for t, e in zip(row, ends) if e == End.TERMINATED)
        return real_loss(agent, batch, rewards, args)

    monkeypatch.setattr(oni_appo, "take_batch", take_batch)
    train_in_process(tmp_path, ["--num-workers", "2", "--num-envs-per-worker", "4", "--batch-size", "256",
                                "--lr", "0", "--max-episode-steps", "150", "--total-env-steps", "12000",
                                "--reward-type", "retrieval", "--labels-from", labels_file],
                     monkeypatch, check)
    for name, values in gaps.items():
        values = torch.cat(values)
        assert values.numel() > 0, f"no {name} step in the run"
        assert values.max().item() < 1e-5, (name, values.max().item())
    assert sum(paid_running) > 0  # the check above compared some paid steps
    # the check trusts step_message: a death must show its own last message, never the next episode's first
    assert deaths and not set(deaths) & set(FIRST_MESSAGES), collections.Counter(deaths)


def test_the_same_seed_gives_the_same_first_update(tmp_path, monkeypatch):
    first_updates = []

    def record(real_loss, agent, batch, rewards, args):
        loss, losses = real_loss(agent, batch, rewards, args)
        first_updates.append((loss.item(), batch["action"].clone(),
                              [p.detach().clone() for p in agent.parameters()]))
        return loss, losses

    argv = ["--num-workers", "1", "--num-envs-per-worker", "4", "--batch-size", "128",
            "--total-env-steps", "128", "--seed", "11"]  # one update
    train_in_process(tmp_path, argv, monkeypatch, record, name="a")
    first = first_updates[0]
    first_updates.clear()
    train_in_process(tmp_path, argv, monkeypatch, record, name="b")
    second = first_updates[0]
    assert torch.equal(first[1], second[1])  # the same actions in the same order
    assert first[0] == pytest.approx(second[0], abs=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(first[2], second[2]))  # the same initial weights
    first_updates.clear()
    train_in_process(tmp_path, argv[:-1] + ["12"], monkeypatch, record, name="c")
    assert not torch.equal(first[1], first_updates[0][1])  # another seed, other actions


def test_checkpoints_written_during_training_hold_whole_updates(tmp_path, monkeypatch):
    saved = []
    real_save = oni_appo.save

    def save(run):  # what each checkpoint written to disk holds
        totals = real_save(run)
        state = torch.load(os.path.join(run.args.run_dir, "checkpoint.pt"), weights_only=True)
        steps = {int(s["step"]) for s in state["optimizer"]["state"].values()}
        saved.append((steps, state["counters"]["updates"]))
        return totals

    monkeypatch.setattr(oni_appo, "save", save)
    train_in_process(tmp_path, SMALL_RUN + ["--total-env-steps", "2048", "--checkpoint-every-s", "0"],
                     monkeypatch)
    during = [s for s in saved if s[1] > 0][:-1]  # the last one is written after training stopped
    assert len(during) >= 5
    for steps, updates in during:
        assert steps == {updates}, (steps, updates)  # Adam's step count is the update counter


def test_an_llm_error_retrying_cannot_fix_stops_the_run_with_a_checkpoint(tmp_path):
    from fake_openai import FakeOpenAI
    server = FakeOpenAI().start()
    run_dir = str(tmp_path / "run")
    try:
        result = run(SMALL_RUN[:-2] + ["--reward-type", "retrieval", "--llm-url", server.url,
                                        "--llm-model", "no-such-model", "--run-dir", run_dir], timeout=300)
    finally:
        server.stop()
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: annotator: HTTP 404") and "no-such-model" in last, result.stderr[-2000:]
    assert f"--resume {run_dir}" in last and "Traceback" not in result.stderr
    saved = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)
    assert saved["counters"]["updates"] >= 1


def test_resume_takes_the_llm_flags_and_names_the_flags_it_ignores(tmp_path, capsys):
    """After "error: annotator: HTTP 404 ... model does not exist", --resume with the right model must
    work."""
    import dataclasses
    path = str(tmp_path / "checkpoint.pt")
    saved = oni_appo.Args(reward_type="ranking", llm_model="wrong-model", run_dir=str(tmp_path))
    torch.save({"format": 1, "model": {}, "counters": {}, "args": dataclasses.asdict(saved)}, path)
    args = oni_appo.parse_args(["--resume", path, "--llm-model", "right-model", "--prompt-file", "fixed.json",
                                "--lr", "0.5"])
    assert (args.llm_model, args.prompt_file, args.lr, args.reward_type) == (
        "right-model", "fixed.json", 1e-4, "ranking")
    assert "--resume: ignoring --lr" in capsys.readouterr().err
    for saved_share, argv, share in ((0.5, [], 0.5), (0.5, ["--reward-model-share", "1"], 1.0),
                                     (None, [], 1.0), (None, ["--reward-model-share", "0.2"], 0.2)):
        saved = dataclasses.asdict(oni_appo.Args(reward_type="ranking", reward_model_share=saved_share,
                                                 run_dir=str(tmp_path)))
        if saved_share is None:  # a checkpoint from before the flag
            del saved["reward_model_share"]
        torch.save({"format": 1, "model": {}, "counters": {}, "args": saved}, path)
        assert oni_appo.parse_args(["--resume", path, *argv]).reward_model_share == share, (saved_share, argv)


def test_a_run_split_by_two_resumes_reports_the_totals_of_its_pieces(tmp_path, monkeypatch):
    """summary.json after a resume described the last session alone: llm_labels 130 while labels.jsonl held
    492; wall time, LLM failures, policy lag and the largest reward of one session only. The run's LLM server
    wants a key; each session records what made it. And the labels a session gets are paid in that session: in
    the first, with no labels before it, as in the others."""
    import fake_openai
    from fake_openai import FakeOpenAI
    helpful = fake_openai.good  # and the wall, on ~10% of random play's steps: every session shows it
    monkeypatch.setattr(fake_openai, "good", lambda text: "It's a wall." in text or helpful(text))
    fake, run_dir, summaries, failed = FakeOpenAI().start(), str(tmp_path / "run"), [], 0
    records, outputs, fake.key = [], "", "sk-test-a1b2c3d4e5f6"  # the key: from the environment
    try:
        for steps in (4000, 8000, 12000):
            fake.fail_next = 2  # up to two failed requests in each session
            # the key goes where this command sends it
            start = (SMALL_RUN[:-1] + ["retrieval", "--llm-url", fake.url, "--run-dir", run_dir]
                     if not summaries else ["--resume", run_dir, "--llm-url", fake.url])
            keyed = {**os.environ, "OPENAI_API_KEY": fake.key}
            result = run(start + ["--total-env-steps", str(steps)], env=keyed)
            assert result.returncode == 0, result.stderr[-2000:]
            summaries.append(json.load(open(os.path.join(run_dir, "summary.json"))))
            failed += 2 - fake.fail_next
            first = result.stdout.splitlines()[0]  # a console.log opens with what made the session
            assert first.startswith("run record: {"), result.stdout[:500]
            records.append(json.loads(first.removeprefix("run record: ")))
            outputs += result.stdout + result.stderr
    finally:
        fake.stop()
    assert set(fake.authorizations) == {f"Bearer {fake.key}"} and len(fake.authorizations) > fake.requests > 0
    # Retrieval's piece asks captions: one greedy token each, never the log-probabilities pairs are scored by
    assert not any("logprobs" in body for path, body in fake.calls if path.endswith("/completions"))
    for path in (tmp_path / "run").rglob("*"):  # the key is in no file of the run dir, nor in its output
        assert not path.is_file() or fake.key.encode() not in path.read_bytes(), path
    assert fake.key not in outputs
    def git(*argv):
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True)
    head, changes = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    code = (head.stdout.strip(), bool(changes.stdout)) if head.returncode == 0 else ("unknown", "unknown")
    pool = hashlib.sha256(open(annotator.DEMOS_FILE, "rb").read()).hexdigest()
    for n, (record, steps) in enumerate(zip(records, (4000, 8000, 12000))):
        assert (record["commit"], record["uncommitted_changes"]) == code
        assert record["flags"]["total_env_steps"] == steps and record["flags"]["reward_type"] == "retrieval"
        assert record["flags"]["resume"] == (os.path.join(run_dir, "checkpoint.pt") if n else None)
        assert record["demonstrations"] == {"file": annotator.DEMOS_FILE, "sha256": pool}
        assert record["llm"] == {"urls": [fake.url], "model": "the first listed"}
        # summary.json: each session's record, earlier ones kept, with the model the server answered as
        assert len(summaries[n]["sessions"]) == n + 1
        assert summaries[n]["sessions"][:n] == (summaries[n - 1]["sessions"] if n else [])
        assert summaries[n]["sessions"][n] == {**record, "llm": {"urls": [fake.url], "model": "fake-base"}}
    last = summaries[-1]
    # exactly: a session's time ends at its last save, from which the next goes on (it ended after
    # messages.tsv and the LLM's stats, which the saved total missed: 1.25 s short over two resumes on a
    # loaded box)
    assert last["wall_time_s"] == pytest.approx(sum(s["session_wall_time_s"] for s in summaries), abs=1e-6)
    assert last["llm_failures"] == failed > 2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(run_dir)  # the counts in tensorboard go on across resumes too
    events.Reload()
    assert events.Scalars("llm/failures")[-1].value == failed
    labelled = open(os.path.join(run_dir, "labels.jsonl")).read().splitlines()
    assert last["llm_labels"] == len(labelled) > summaries[0]["llm_labels"] > 0
    assert last["intrinsic_max_reward"] == max(s["intrinsic_max_reward"] for s in summaries) > 0
    assert summaries[0]["intrinsic_max_reward"] == 1.0  # R / 1^beta: a wall, seen first in an episode
    totals = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=False)["totals"]
    # the lag is a mean over every rollout step learned in all sessions (a version tag covers a slot's 2 envs)
    assert totals["lag_steps"] == last["updates"] * 256 // 2
    assert last["policy_lag_mean"] == pytest.approx(totals["lag_sum"] / totals["lag_steps"])


def test_git_state_names_the_commit_and_uncommitted_changes_and_never_fails(tmp_path, monkeypatch):
    repo, plain = tmp_path / "repo", tmp_path / "plain"
    repo.mkdir(), plain.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # plain/ is in no repository, whatever /tmp

    def git(*argv):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *argv], cwd=repo,
                              check=True, capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "a")
    (repo / "results.txt").write_text("a run's output\n")  # untracked: not a change to the code
    assert run_files.git_state(repo) == (git("rev-parse", "HEAD"), False)
    (repo / "a.py").write_text("x = 2\n")
    assert run_files.git_state(repo) == (git("rev-parse", "HEAD"), True)
    assert run_files.git_state(plain) == ("unknown", "unknown")
    monkeypatch.setenv("PATH", "")  # no git at all
    assert run_files.git_state(repo) == ("unknown", "unknown")


def test_a_reward_model_trainer_crash_saves_the_run_and_it_resumes_exactly(tmp_path, monkeypatch, capsys):
    """A crash of the trainer thread re-raised as a RuntimeError before finish(): no checkpoint, summary.json
    or messages.tsv; up to 10 minutes of training lost. It must end like a fatal LLM error. The resume then
    goes on from the checkpoint exactly: its first update starts from the saved weights, Adam state and
    counters, the acting process acts with those weights, and the reward model starts training again from its
    saved state."""
    import reward_models
    from test_reward_models import assert_same
    labels = tmp_path / "labels.jsonl"  # both classes at once: the first fit is due from the first update
    labels.write_text("".join(json.dumps({"caption": c, "label": v}) + "\n" for c, v in
                              (("You kill the newt!", 1), ("It's a wall.", 0),
                               ("You see here 3 gold pieces.", 1))))
    monkeypatch.setattr(reward_models, "NEEDS_LLM", ())  # no annotator: the labels file is all it learns from
    monkeypatch.setattr(reward_models, "SMALL_SET", 0)  # a step per learner batch: published before the crash
    calls, real_loss = [], reward_models.Classification.minibatch_loss

    def crash_on_the_fifth_step(self, batch_size):
        calls.append(1)
        if len(calls) == 5:
            raise ValueError("injected trainer crash")
        return real_loss(self, batch_size)
    monkeypatch.setattr(reward_models.Classification, "minibatch_loss", crash_on_the_fifth_step)
    argv = ["--num-workers", "1", "--num-envs-per-worker", "4", "--batch-size", "256", "--reward-type",
            "classification", "--labels-from", str(labels), "--total-env-steps", "50000"]
    with pytest.raises(SystemExit) as stop:
        train_in_process(tmp_path, argv, monkeypatch)
    run_dir = tmp_path / "run"
    assert str(stop.value).startswith(
        "error: the reward model's trainer failed (ValueError: injected trainer crash)")
    assert str(stop.value).endswith(f"checkpoint saved, continue with --resume {run_dir}")
    assert "injected trainer crash" in capsys.readouterr().err  # its traceback, printed when it happened
    assert all((run_dir / f).exists() for f in ("checkpoint.pt", "summary.json", "messages.tsv"))
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    saved, intrinsic = checkpoint["counters"], checkpoint["intrinsic"]
    assert intrinsic["model_steps"] >= 2  # a published reward model, to resume from

    seen, real_start = {}, reward_models.TrainedModel.start
    real_learn, real_update = oni_appo.learn, oni_appo.update_policy

    def start(piece, share=1.0):  # the reward model as its trainer starts again
        seen["reward model"] = copy.deepcopy(piece.state_dict())
        return real_start(piece, share)

    def learn(run):  # the learner's counts of each message, before its first batch
        state = run.intrinsic.state_dict()
        seen["messages"] = {k: v for k, v in state.items() if k not in seen["reward model"]}
        return real_learn(run)

    def update_policy(run, batch, rewards):
        if "policy" not in seen:  # the first update
            seen["policy"] = copy.deepcopy((run.agent.state_dict(), run.optimizer.state_dict(),
                                            dict(run.tally.counters), run.tally.start_steps))
            with torch.no_grad():  # acted on by the acting process with the weights it resumed from
                logits, _ = run.agent.unroll(batch["obs"], batch["h0"], oni_appo.episode_cut(batch["end"]))
                logp = torch.log_softmax(logits[:-1], -1).gather(-1, batch["action"][..., None]).squeeze(-1)
            seen["behaviour gap"] = (logp - batch["logprob"]).abs().max().item()
        return real_update(run, batch, rewards)

    monkeypatch.setattr(reward_models.Classification, "minibatch_loss", real_loss)  # the cause fixed: resume
    monkeypatch.setattr(reward_models.TrainedModel, "start", start)
    monkeypatch.setattr(oni_appo, "learn", learn)
    monkeypatch.setattr(oni_appo, "update_policy", update_policy)
    summary = train_in_process(tmp_path, ["--resume", str(run_dir), "--total-env-steps",
                                          str(saved["learned_steps"] + 1024)],
                               monkeypatch)
    assert summary["updates"] > saved["updates"] and summary["env_steps"] >= saved["learned_steps"] + 1024
    model, optimizer, counters, start_collected = seen["policy"]
    assert_same(model, checkpoint["model"])
    assert_same(optimizer, checkpoint["optimizer"])
    assert counters["updates"] == saved["updates"] and start_collected == saved["learned_steps"]
    assert seen["behaviour gap"] < 1e-5
    assert_same(seen["reward model"], {k: v for k, v in intrinsic.items() if k in seen["reward model"]})
    assert_same(seen["messages"], {k: v for k, v in intrinsic.items() if k in seen["messages"]})
    assert len(seen["messages"]["seen"][0]) > 3  # the messages the first session saw, counted on


def process_states():
    """pid -> (state, parent pid) of every process, from /proc."""
    states = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError):
            stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            states[int(entry)] = stat[0], int(stat[1])
    return states


def descendants(pid):
    """Every live process under pid, zombies excluded."""
    children = collections.defaultdict(list)
    for child, (state, parent) in process_states().items():
        if state != "Z":
            children[parent].append(child)
    found, todo = [], [pid]
    while todo:
        found += children[todo[-1]]
        todo += children[todo.pop()]
    return found


def test_a_trainer_killed_by_sigkill_leaves_no_child_running(tmp_path):
    """15 s after kill -9 of the trainer, the llama.cpp server, the Manager and the annotator were alive under
    PID 1: each crash-and-resume added an LLM server holding cores and memory."""
    proc = subprocess.Popen([sys.executable, "oni_appo.py", *SMALL_RUN[:-1], "retrieval", "--run-dir",
                             str(tmp_path / "run")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if "steps/s" in line:  # the embedded server, the Manager, the annotator and the workers all run
            break
    children = descendants(proc.pid)
    assert len(children) >= 5, children  # 2 workers, the server, the Manager, the annotator
    proc.kill()
    proc.wait()
    deadline = time.time() + 10
    while ((left := [pid for pid in children if process_states().get(pid, ("Z",))[0] != "Z"])
           and time.time() < deadline):
        time.sleep(0.2)
    assert not left, [open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:100] for pid in left]


def test_defaults_follow_the_device_and_a_resume_keeps_its_own(tmp_path, monkeypatch):
    """On a GPU node the defaults were a laptop's: every core a worker (none left for the process that acts
    and learns) and 16 envs per worker with batches of 1,024, 0.55 of the speed of 64 x 4,096 on an H200
    (benchmarks/README.md, On a GPU node)."""
    import dataclasses
    monkeypatch.setattr(oni_appo.os, "cpu_count", lambda: 16)
    cpu, gpu = oni_appo.parse_args(["--device", "cpu"]), oni_appo.parse_args(["--device", "cuda:1"])
    assert (cpu.num_workers, cpu.num_envs_per_worker, cpu.batch_size) == (16, 16, 1024)
    assert (gpu.num_workers, gpu.num_envs_per_worker, gpu.batch_size) == (14, 64, 4096)
    mine = oni_appo.parse_args(["--device", "cuda", "--num-workers", "3", "--num-envs-per-worker", "8",
                                "--batch-size", "128"])
    assert (mine.num_workers, mine.num_envs_per_worker, mine.batch_size) == (3, 8, 128)
    path = str(tmp_path / "checkpoint.pt")  # a run started on a CPU, resumed on a GPU: the same batches
    torch.save({"format": 1, "model": {}, "counters": {}, "args": dataclasses.asdict(cpu)}, path)
    resumed = oni_appo.parse_args(["--resume", path, "--device", "cuda"])
    assert (resumed.num_envs_per_worker, resumed.batch_size) == (16, 1024)
    with pytest.raises(SystemExit,
                       match="need --num-workers, --rollout, --batch-size, --total-env-steps >= 1"):
        oni_appo.parse_args(["--device", "cuda", "--num-envs-per-worker", "0"])


def test_resume_applies_every_flag_given_even_at_its_default(tmp_path, capsys):
    """A flag given with its default value counted as not given: a run saved with 16 workers and 500,000 steps
    kept both under `--num-workers 2 --total-env-steps 2000000000` on a 2-core box, and could never leave
    --llm-url."""
    import dataclasses
    path = str(tmp_path / "checkpoint.pt")
    saved = oni_appo.Args(reward_type="ranking", num_workers=16, total_env_steps=500_000,
                          llm_url=["http://gpu:8000/v1"], reward_model_share=0.5, run_dir=str(tmp_path))
    torch.save({"format": 1, "model": {}, "counters": {}, "args": dataclasses.asdict(saved)}, path)
    defaults = oni_appo.parse_args(["--device", "cpu"])  # the defaults as resolved on this machine
    kept = oni_appo.parse_args(["--resume", path])  # nothing given: the saved values
    assert (kept.num_workers, kept.total_env_steps, kept.llm_url, kept.reward_model_share) == (
        16, 500_000, ["http://gpu:8000/v1"], 0.5)
    args = oni_appo.parse_args(["--resume", path, "--num-workers", str(defaults.num_workers),
                                "--total_env_steps=2000000000", "--llm-url", "--reward-model-share", "1",
                                "--lr", str(defaults.lr), "--no-raw-ranking"])
    assert (args.num_workers, args.total_env_steps, args.llm_url, args.reward_model_share) == (
        defaults.num_workers, 2_000_000_000, [], 1.0)
    err = capsys.readouterr().err  # explicit defaults of flags a run keeps are named too
    assert ("--resume: ignoring --lr" in err and "--resume: ignoring --raw-ranking" in err
            and "--num-workers" not in err)


def test_the_trainer_gets_the_reward_model_share(tmp_path, monkeypatch):
    import reward_models
    shares = []
    monkeypatch.setattr(reward_models.TrainedModel, "start", lambda self, share=1.0: shares.append(share))
    monkeypatch.setattr(reward_models, "NEEDS_LLM", ())  # no annotator, no LLM server
    for argv, share in (([], 1.0), (["--reward-model-share", "0.25"], 0.25)):
        run = oni_appo.set_up(oni_appo.parse_args(["--reward-type", "classification", *argv, "--run-dir",
                                                   str(tmp_path / "r")]))
        run.writer.close()
        run.lock.close()  # the run dir, free for the next set_up
        assert shares.pop() == share


