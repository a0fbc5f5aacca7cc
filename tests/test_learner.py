"""The learner's pieces, called directly: V-trace and the APPO loss against their definitions, the policy's
unroll and its CUDA graphs, the acting process's sampling and its pipe to the learner, the env workers' end
codes, and the episode returns the learner joins."""
import collections
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import oni_appo
from oni_appo import End


def vtrace_by_definition(rewards, values, bootstrap, discounts, rhos, cs):
    """Espeholt et al. (2018), eq. 1, summed term by term (no recursion):
    v_s = V(x_s) + sum_{t>=s} (prod_{i=s}^{t-1} gamma_i c_i) rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t))."""
    T, B = rewards.shape
    V = np.concatenate([values, bootstrap[None]], axis=0)
    vs = np.zeros((T, B))
    for b in range(B):
        for s in range(T):
            total, weight = V[s, b], 1.0
            for t in range(s, T):
                total += weight * rhos[t, b] * (rewards[t, b] + discounts[t, b] * V[t + 1, b] - V[t, b])
                weight *= discounts[t, b] * cs[t, b]
            vs[s, b] = total
    vs_next = np.concatenate([vs[1:], bootstrap[None]], axis=0)
    advantages = rhos * (rewards + discounts * vs_next - values)
    return vs, advantages


def test_vtrace_matches_the_definition_with_episode_ends_inside():
    rng = np.random.default_rng(0)
    T, B = 12, 5
    rewards, values, bootstrap = rng.normal(size=(T, B)), rng.normal(size=(T, B)), rng.normal(size=B)
    ratio = np.exp(rng.normal(scale=0.5, size=(T, B)))
    discounts = 0.99 * (rng.random((T, B)) > 0.2)  # episode ends inside the rollout
    rhos, cs = np.minimum(ratio, 1.0), np.minimum(ratio, 0.9)
    expected = vtrace_by_definition(rewards, values, bootstrap, discounts, rhos, cs)
    got = oni_appo.vtrace(*(torch.tensor(x) for x in (rewards, values, bootstrap, discounts, rhos, cs)))
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-10, atol=1e-10)


def test_vtrace_targets_cut_at_deaths_and_bootstrap_at_truncations():
    # one env: running, terminated, running, truncated, reset, running; on-policy (ratio 1)
    end = torch.tensor([[0], [1], [0], [2], [3], [0]], dtype=torch.int8)
    rewards = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0], [6.0]])
    values = torch.tensor([[0.5], [0.6], [0.7], [0.8], [10.0], [0.9], [1.1]])  # [T+1, B]
    g = 0.9
    vs, _ = oni_appo.vtrace_targets(end, rewards, values, torch.ones(6, 1), g)
    vs = vs[:, 0].tolist()
    assert vs[1] == pytest.approx(2.0)  # death: no bootstrap
    assert vs[0] == pytest.approx(1.0 + g * 2.0)
    assert vs[3] == pytest.approx(4.0 + g * 10.0)  # truncation: bootstraps on the real last obs
    assert vs[2] == pytest.approx(3.0 + g * vs[3])
    assert vs[4] == pytest.approx(10.0)  # the reset step is no transition
    assert vs[5] == pytest.approx(6.0 + g * 1.1)
    # on-policy with these discounts V-trace is the discounted return, as the definition says
    ref, _ = vtrace_by_definition(rewards.numpy().astype(float), values[:-1].numpy().astype(float),
                                  values[-1].numpy().astype(float),
                                  np.array([[g], [0], [g], [g], [0], [g]]),
                                  np.array([[1.0], [1], [1], [1], [0], [1]]),
                                  np.array([[1.0], [1], [1], [1], [0], [1]]))
    np.testing.assert_allclose(vs, ref[:, 0], rtol=1e-6)


def random_obs(shape, rng):
    return {"chars": torch.tensor(rng.integers(32, 128, size=shape + (21, 79)), dtype=torch.uint8),
            "colors": torch.tensor(rng.integers(0, 16, size=shape + (21, 79)), dtype=torch.uint8),
            "blstats": torch.tensor(rng.integers(0, 20, size=shape + (27,)), dtype=torch.float32),
            "message": torch.tensor(rng.integers(0, 128, size=shape + (256,)), dtype=torch.uint8)}


def test_unroll_matches_stepwise_inference_and_resets_at_episode_ends():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    agent = oni_appo.Agent().eval()
    T, B = 6, 3
    obs = random_obs((T, B), rng)
    cuts = torch.zeros(T, B, dtype=torch.bool)
    cuts[2, 0] = cuts[4, 2] = True
    h0 = torch.randn(B, 512)
    with torch.no_grad():
        logits, values = agent.unroll(obs, h0, cuts)
        h = h0
        for t in range(T):  # what the inference loop does, one step at a time
            if t > 0:
                h = h * (~cuts[t - 1]).float()[:, None]
            step_logits, step_values, h = agent.step({k: v[t] for k, v in obs.items()}, h)
            torch.testing.assert_close(step_logits, logits[t], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(step_values, values[t], rtol=1e-5, atol=1e-5)
        # after a reset the past no longer matters: change everything before it
        changed = {k: v.clone() for k, v in obs.items()}
        changed["chars"][:3, 0] = 65
        logits2, _ = agent.unroll(changed, torch.randn(B, 512), cuts)
    torch.testing.assert_close(logits2[3:, 0], logits[3:, 0])
    assert not torch.allclose(logits2[:3, 0], logits[:3, 0])


class Unrolled(torch.nn.Module):
    """A stand-in policy for appo_loss: unroll() returns the logits and values the test set (parameters)."""

    def __init__(self, logits, values):
        super().__init__()
        self.logits, self.values = torch.nn.Parameter(logits), torch.nn.Parameter(values)

    def unroll(self, obs, h0, cuts):
        self.cuts = cuts
        return self.logits, self.values


def loss_by_definition(logits, values, batch, rewards, args):
    """appo_loss written out from its parts' definitions, in numpy: the ratio clipped to [0.05, 20]; V-trace
    by the paper's sum with rho = c = min(ratio, 1), zero at reset steps, discount gamma after running and
    truncated steps; advantages standardized over the valid steps; PPO's min(r A, clip(r, 1/(1+c), 1+c) A);
    reset steps masked."""
    end, action, old = batch["end"].numpy(), batch["action"].numpy(), batch["logprob"].numpy().astype(float)
    logits, values, rewards = logits.double().numpy(), values.double().numpy(), rewards.double().numpy()
    log_probs = logits[:-1] - np.log(np.exp(logits[:-1]).sum(-1, keepdims=True))
    new = np.take_along_axis(log_probs, action[..., None], -1)[..., 0]
    ratio = np.clip(np.exp(new - old), 0.05, 20.0)
    valid = end != End.RESET
    discounts = args.gamma * ((end == End.RUNNING) | (end == End.TRUNCATED))
    rho = np.minimum(ratio, 1.0) * valid
    vs, advantages = vtrace_by_definition(rewards, values[:-1], values[-1], discounts, rho, rho)
    mean = advantages[valid].mean()
    advantages = (advantages - mean) / max(np.sqrt(((advantages[valid] - mean) ** 2).mean()), 1e-3)
    low, high = 1 / (1 + args.clip_coef), 1 + args.clip_coef
    surrogate = np.minimum(ratio * advantages, np.clip(ratio, low, high) * advantages)
    entropy = -(np.exp(log_probs) * log_probs).sum(-1)
    clipped = (ratio < low) | (ratio > high)
    parts = {"policy_loss": -surrogate[valid].mean(), "value_loss": ((values[:-1] - vs) ** 2)[valid].mean(),
             "entropy": entropy[valid].mean(), "clip_fraction": clipped[valid].mean()}
    loss = parts["policy_loss"] + args.vf_coef * parts["value_loss"] - args.ent_coef * parts["entropy"]
    return loss, parts, ratio, advantages, valid


def test_appo_loss_clips_both_ways_masks_reset_steps_and_uses_off_policy_v_trace_targets():
    """Each term of appo_loss against its definition, off-policy (ratios from 0.03 to 30) with every kind of
    end; then the policy gradient alone: zero at reset steps and where the clip holds the ratio (above 1 + c
    with a positive advantage, below 1 / (1 + c) with a negative one, 0.905 among them: 1 - c would not clip
    it)."""
    T, B, A = 8, 16, 5
    gen = torch.Generator().manual_seed(0)
    end = torch.randint(0, 4, (T, B), generator=gen).to(torch.int8)
    end[:, 0] = torch.tensor([End.RUNNING, End.TRUNCATED, End.RESET, End.RUNNING, End.TERMINATED, End.RUNNING,
                              End.RUNNING, End.RUNNING], dtype=torch.int8)
    end[1:][end[:-1] == End.TRUNCATED] = End.RESET  # the step after a truncation only resets
    end[1:][(end[:-1] != End.TRUNCATED) & (end[1:] == End.RESET)] = End.RUNNING
    logits, values = torch.randn(T + 1, B, A, generator=gen), torch.randn(T + 1, B, generator=gen)
    action = torch.randint(0, A, (T, B), generator=gen)
    new_logp = torch.log_softmax(logits[:-1], -1).gather(-1, action[..., None])[..., 0]
    ratio = torch.exp(torch.empty(T, B).uniform_(np.log(0.03), np.log(30.0), generator=gen))
    ratio[:, 1::4] = 0.905  # between 1 - c and 1 / (1 + c)
    batch = {"obs": None, "h0": None, "end": end, "action": action, "logprob": new_logp - torch.log(ratio)}
    rewards = torch.randn(T, B, generator=gen)
    args = SimpleNamespace(gamma=0.9, clip_coef=0.1, vf_coef=0.5, ent_coef=0.01)

    agent = Unrolled(logits, values)
    loss, stats = oni_appo.appo_loss(agent, batch, rewards, args)
    expected, parts, ratio, advantages, valid = loss_by_definition(logits, values, batch, rewards, args)
    assert torch.equal(agent.cuts, (end == End.TERMINATED) | (end == End.RESET))  # the GRU restarts after
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    for name, value in parts.items():
        assert stats[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name

    policy_only = SimpleNamespace(**{**vars(args), "vf_coef": 0.0, "ent_coef": 0.0})
    agent = Unrolled(logits, values)
    oni_appo.appo_loss(agent, batch, rewards, policy_only)[0].backward()
    moved = agent.logits.grad[:-1].abs().sum(-1).numpy() > 0
    low, high = 1 / 1.1, 1.1
    up, down = (advantages > 0) & valid, (advantages < 0) & valid
    held = (up & (ratio > high)) | (down & (ratio < low)) | (ratio <= 0.05) | (ratio >= 20)
    assert (valid & ~held).sum() > 20 and (down & np.isclose(ratio, 0.905)).sum() > 3
    assert (up & (ratio < low)).any() and (down & (ratio > high)).any()  # each side also unclipped
    np.testing.assert_array_equal(moved, valid & ~held)
    assert agent.values.grad is None or not agent.values.grad.any()  # the policy term leaves the critic alone
    agent = Unrolled(logits, values)
    value_only = SimpleNamespace(**{**vars(policy_only), "vf_coef": 1.0})
    oni_appo.appo_loss(agent, batch, rewards, value_only)[0].backward()
    np.testing.assert_array_equal(agent.values.grad[:-1].numpy() != 0, valid)  # the value loss: valid steps


def test_learner_raises_the_probability_of_the_rewarded_action():
    """Fails if the advantage sign, the V-trace targets or the gradient flow is wrong."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    agent = oni_appo.Agent()
    optimizer = torch.optim.Adam(agent.parameters(), lr=3e-4)
    args = SimpleNamespace(gamma=0.99, clip_coef=0.1, vf_coef=0.5, ent_coef=0.0)
    T, B, good = 4, 32, 5
    obs = random_obs((T + 1, B), rng)
    h0 = torch.zeros(B, 512)
    end = torch.full((T, B), End.TERMINATED, dtype=torch.int8)  # one-step episodes

    def policy():
        with torch.no_grad():
            logits, values = agent.unroll(obs, h0, end == End.TERMINATED)
        return torch.softmax(logits[:-1], -1), values[:-1]

    start_prob = policy()[0][..., good].mean().item()
    for _ in range(30):
        probs, _ = policy()
        action = torch.distributions.Categorical(probs=probs).sample()
        rewards = (action == good).float()
        batch = {"obs": obs, "action": action, "end": end, "h0": h0,
                 "logprob": torch.log(probs.gather(-1, action[..., None]).squeeze(-1))}
        loss, _ = oni_appo.appo_loss(agent, batch, rewards, args)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    probs, values = policy()
    assert probs[..., good].mean().item() > 3 * start_prob
    # the critic learns the expected reward of the policy
    assert abs(values.mean().item() - probs[..., good].mean().item()) < 0.25


def test_episode_intrinsic_returns_follow_each_env_across_rollouts_and_resets():
    # two rollouts of the same two envs in one batch (columns 0-1, then 2-3), T = 3 each
    R, T, TR, RS = End.RUNNING, End.TERMINATED, End.TRUNCATED, End.RESET
    end = torch.tensor([[R, R, T, RS], [T, TR, R, R], [R, RS, R, T]], dtype=torch.int8)
    paid = torch.tensor([[1.0, 0.5, 2.0, 0.0], [0.25, 0.0, 0.0, 3.0], [4.0, 0.0, 0.0, 1.0]])
    totals, finished = np.zeros((2, 3)), [collections.deque() for _ in range(2)]
    oni_appo.add_intrinsic_episodes(totals, finished, paid, end, np.array([0, 1, 0, 1]))
    # env 0: 1 + 0.25 (ends), then 4 + 2 (ends at the second rollout's t=0), then 0 (in progress)
    assert [e["intrinsic_return"] for e in finished[0]] == [1.25, 6.0]
    assert [e["intrinsic_rewarded_fraction"] for e in finished[0]] == [1.0, 1.0]
    # env 1: 0.5 + 0 truncated (2 steps, 1 rewarded); the reset step belongs to no episode; 3 + 1 ends
    assert [(e["intrinsic_return"], e["intrinsic_rewarded_fraction"]) for e in finished[1]] == [
        (0.5, 0.5), (4.0, 1.0)]
    assert totals.tolist() == [[0.0, 0.0, 2.0], [0.0, 0.0, 0.0]]  # env 0: two steps in progress, unrewarded
    pending = [collections.deque([{"score": s, "env_steps": s} for s in scores])
               for scores in ([5, 9, 12], [7, 8])]
    joined = oni_appo.join_episodes(pending, finished)
    assert [(e["score"], e["intrinsic_return"]) for e in joined] == [(5, 1.25), (7, 0.5), (8, 4.0), (9, 6.0)]
    assert oni_appo.join_episodes(pending, finished, final=True) == [{"score": 12, "env_steps": 12}]


def test_the_learner_thread_keeps_the_process_threads_beside_a_reward_model_trainer(monkeypatch):
    """torch.set_num_threads in the trainer thread also sets the default of threads that start later."""
    import threading
    import reward_models
    intrinsic = reward_models.IntrinsicReward(oni_appo.Args(reward_type="classification"), "cpu")
    intrinsic.start()
    time.sleep(0.5)  # the trainer thread has set its own threads
    seen = []
    monkeypatch.setattr(oni_appo, "next_batch",
                        lambda run: seen.append(torch.get_num_threads()))  # then stops
    learner = threading.Thread(target=oni_appo.learn, args=(None,))
    learner.start()
    learner.join()
    intrinsic.close()
    assert oni_appo.TORCH_THREADS == torch.get_num_threads() and seen == [oni_appo.TORCH_THREADS]


def test_an_acting_process_killed_mid_message_is_a_clear_failure_not_a_hang():
    """Killed while it wrote a rollout message (kill -9, OOM): part of a message in the pipe. The learner kept
    its own copy of the pipe's write end, so the pipe never closed and recv() waited forever for the rest. Now
    the acting process holds it alone (start_acting closes the learner's) and the learner takes the pipe's end
    for its death."""
    import multiprocessing
    import struct
    learner_end, acting_end = multiprocessing.Pipe(duplex=False)
    os.write(acting_end.fileno(),
             struct.pack("!i", 1000) + b"part of a rollout message")  # a header, 1,000 promised
    acting_end.close()  # the process is gone
    run = SimpleNamespace(full_rollouts=learner_end, stop=SimpleNamespace(value=0), failure=None, ended=False,
                          tally=SimpleNamespace(pending=collections.defaultdict(list),
                                                counters={"episodes": 0, "collected_steps": 0}))
    assert oni_appo.next_message(run, 1) == (None, None)
    assert run.failure == "the acting process died" and run.stop.value == 1 and run.ended


def test_an_end_that_next_batch_read_is_not_waited_for_again():
    """A stop set while next_batch polls: the acting process's "end" arrives there, and next_batch returns.
    The same CI failure, at a second place: end_acting waited for another "end", and when the process (still
    stopping its workers when end_acting began) exited, took it for dead: "the acting process died" at a
    requested stop (pipeline_ceiling at 2 x 16 x 1,024, once in two runs)."""
    import multiprocessing
    learner_end, acting_end = multiprocessing.Pipe()

    class Exits:  # alive when end_acting begins, gone after
        alive = [True]

        def is_alive(self):
            return self.alive.pop() if self.alive else False
        join = kill = lambda self, timeout=None: None
    acting_end.send(("end", None, [], 5))
    run = SimpleNamespace(full_rollouts=learner_end, acting=Exits(), stop=SimpleNamespace(value=1),
                          failure=None,
                          tally=SimpleNamespace(pending=collections.defaultdict(list),
                                                counters={"episodes": 0, "collected_steps": 0}), ended=False)
    assert oni_appo.next_message(run, 0) == ("end", None)  # read by next_batch
    oni_appo.end_acting(run)
    assert run.failure is None


class CrashOnce:
    """A real env whose 6th step (counted over all instances) raises, as a broken game would."""
    calls = 0

    def __init__(self, env):
        self.env = env

    def reset(self):
        return self.env.reset()

    def step(self, action):
        CrashOnce.calls += 1
        if CrashOnce.calls == 6:
            raise RuntimeError("injected crash")
        return self.env.step(action)

    def close(self):
        self.env.close()


def test_worker_end_codes_truncation_and_crash_recovery(monkeypatch):
    import multiprocessing as mp

    import envs
    from nle import nethack
    real_make = envs.make_env
    monkeypatch.setattr(
        envs, "make_env",
        lambda task, seed=None, **kw: CrashOnce(real_make(task, seed=seed, max_episode_steps=4)))
    T = 8
    buffers = oni_appo.make_buffers(1, T, 1)  # one buffer, one env per half
    buffers["action"][:] = envs.ACTIONS.index(nethack.Command.SEARCH)
    parent, child = mp.get_context("fork").Pipe()  # fork: the child keeps the patched make_env
    worker = mp.get_context("fork").Process(target=oni_appo.env_worker,
                                            args=(0, "NetHackScoreExtendedActions-v1", 0, 2, buffers, child))
    worker.start()
    parent.send((0, 0, -1))
    parent.recv()
    episodes = []
    for t in range(T):
        parent.send((0, 0, t))
        half, finished = parent.recv()
        episodes += finished
    parent.send(None)
    worker.join(timeout=30)
    ends = buffers["end"][0, :, 0].tolist()
    R, TR, RS = End.RUNNING, End.TRUNCATED, End.RESET
    # 4 steps then the time limit; a reset step; 2 steps; the crash (a recreated env: reset); a step
    assert ends == [R, R, R, TR, RS, R, RS, R]
    assert buffers["blstats"][0, 4, 0].abs().sum() > 0  # the truncated episode's real last observation
    assert [(i, e["steps"]) for i, e in episodes] == [(0, 4)]  # (env index in the worker, statistics)
    assert buffers["step_count"][0, 5, 0] >= 1
    # reset: no message
    assert buffers["step_message"][0, 4].abs().sum() == 0 and buffers["step_count"][0, 4, 0] == 1


def drive_worker_until_an_episode_ends(task, seed, T=64, max_rollouts=200):
    """A real env worker (one env per half), random actions from a seeded stream, rollout after
    rollout in one buffer, until half 0's env terminates. Returns the buffers, t and every action."""
    import multiprocessing as mp

    import envs
    buffers = oni_appo.make_buffers(1, T, 1)
    parent, child = mp.get_context("fork").Pipe()
    worker = mp.get_context("fork").Process(target=oni_appo.env_worker,
                                            args=(0, task, seed, 2, buffers, child))
    worker.start()
    rng, actions = np.random.default_rng(seed), []
    try:
        parent.send((0, 0, -1))
        parent.recv()
        for _ in range(max_rollouts):
            buffers["action"][0, :, 0] = torch.from_numpy(rng.integers(len(envs.ACTIONS), size=T))
            for t in range(T):
                parent.send((0, 0, t))
                parent.recv()
                actions.append(int(buffers["action"][0, t, 0]))
                if buffers["end"][0, t, 0] == End.TERMINATED:
                    return buffers, t, actions
    finally:
        parent.send(None)
        worker.join(timeout=30)
    raise AssertionError("no episode ended")


def test_a_step_that_ends_an_episode_is_scored_with_its_own_last_message():
    import envs
    import reward_models
    task, seed = "NetHackScoreExtendedActions-v1", 5
    buffers, t, actions = drive_worker_until_an_episode_ends(task, seed)
    replica = envs.make_env(task, seed=seed)  # the same game and actions, outside the worker
    replica.reset()
    for a in actions:
        last_obs, _, terminated, _, info = replica.step(a)
    assert terminated
    last_message = envs.message_bytes(last_obs["message"])
    assert envs.message_bytes(buffers["step_message"][0, t, 0].numpy()) == last_message
    assert buffers["step_count"][0, t, 0] == info["message_count"]
    # the next observation already belongs to the next episode (its first message: the welcome, or the
    # moon's on a seed with a full or new moon): the reward must not look there
    welcome = envs.message_bytes(buffers["message"][0, t + 1, 0].numpy())
    assert welcome and welcome == envs.message_bytes(replica.reset()[0]["message"])

    def paid(labels):  # the learner's intrinsic reward (Retrieval with these labels) of the rollout's steps
        args = oni_appo.Args(reward_type="retrieval", extrinsic_coef=0.0, intrinsic_coef=1.0)
        intrinsic = reward_models.IntrinsicReward(args, "cpu")
        intrinsic.add_labels([{"caption": c, "label": v} for c, v in labels.items()])
        rewards, _, stats = intrinsic.rewards(torch.zeros(t + 1, 1), buffers["step_message"][0, :t + 1],
                                           buffers["step_count"][0, :t + 1],
                                           buffers["end"][0, :t + 1] == End.TERMINATED)
        return rewards[:, 0], stats

    rewards, stats = paid({welcome.decode("latin-1"): 1.0})
    assert rewards.abs().sum() == 0 and stats["terminal_step_reward"] == 0  # the welcome is paid on no step
    assert last_message  # a death's last words (an empty one could not tell the two messages apart)
    rewards, stats = paid({last_message.decode("latin-1"): 1.0})
    assert rewards[t].item() == pytest.approx(1.0 / info["message_count"] ** 3) and rewards[t].item() > 0
    assert stats["terminal_step_reward"] == rewards[t].item()


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="CUDA graphs need a GPU: CI (.ci/run, CPU only) skips it; run it on one (README)")
def test_inference_from_cuda_graphs_equals_eager_inference_after_weight_updates():
    """act() replays a CUDA graph per batch size; a graph that kept the weights it was captured with (were
    they replaced, not copied into) or mixed up its sizes would act with a stale or wrong policy, off-policy
    unseen."""
    torch.manual_seed(0)
    learner, acting = oni_appo.Agent().cuda(), oni_appo.Agent().cuda().eval()
    for n in (8, 24, 8, 24):
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(0.05 * torch.randn_like(p))
        acting.load_state_dict(learner.state_dict())  # as update_policy hands the weights over
        obs = {"chars": torch.randint(32, 127, (n, 21, 79), dtype=torch.uint8, device="cuda"),
               "colors": torch.randint(0, 16, (n, 21, 79), dtype=torch.uint8, device="cuda"),
               "blstats": torch.randint(0, 20, (n, 27), device="cuda").float(),
               "message": torch.randint(0, 127, (n, 256), dtype=torch.uint8, device="cuda")}
        h = torch.randn(n, 512, device="cuda")
        with torch.no_grad():
            fast, eager = [t.clone() for t in acting.fast_step(obs, h)], acting.step(obs, h)
        assert all(torch.equal(a, b) for a, b in zip(fast, eager))
    assert sorted(acting.graphs) == [8, 24]


def test_the_acting_process_samples_actions_with_the_policys_probabilities(monkeypatch):
    """The learner's log-prob checks recompute whatever act() picked, so a draw that ignored the policy's
    probabilities passed them all: a seeded chi-square test of act()'s actions against a known
    distribution."""
    args = SimpleNamespace(seed=1, device="cpu", num_workers=1, num_envs_per_worker=64)  # 2 slots of 32 envs
    agent = oni_appo.Agent()
    actor = oni_appo.Actor(args, oni_appo.make_buffers(2, 1, 32), oni_appo.SharedWeights(agent, 0), None,
                           None, None, 0)
    logits = torch.linspace(0.0, -4.0, agent.actor.out_features)  # probabilities from ~0.2 to ~0.004
    monkeypatch.setattr(actor.agent, "fast_step", lambda obs, h: (logits.expand(len(h), -1), None, h))
    counts, conn = np.zeros(len(logits)), SimpleNamespace(send=lambda message: None)
    for _ in range(200):  # 12,800 actions
        actor.slot_t = [0, 0]
        oni_appo.act(actor, [conn], [0, 1])
        counts += np.bincount(actor.arrays["action"][:, 0].ravel(), minlength=len(logits))
    expected = counts.sum() * logits.softmax(0).numpy()
    chi2, dof = ((counts - expected) ** 2 / expected).sum(), len(logits) - 1
    # p ~ 1e-5 for the right distribution; a wrong one: thousands
    assert chi2 < dof + 6 * np.sqrt(2 * dof), chi2
