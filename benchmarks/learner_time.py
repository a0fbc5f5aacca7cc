"""Where the learner's time goes: per function of its loop in real training runs, or per stage of one update.

    python benchmarks/learner_time.py --steps 50000    # the learner's functions in a `none` and a ranking run
    python benchmarks/learner_time.py --update         # one update: 20 after 3 warm-up ones, torch's threads
    python benchmarks/learner_time.py --update --threads 1 --bf16

Training runs (the default): `--reward-type none` and `ranking` (its LLM an instant stub server in a process
of its own, tests/fake_openai.py), one after the other. Each function of the learner's loop (oni_appo.py:
next_batch - waiting for rollouts -, take_batch, the intrinsic reward, add_intrinsic_episodes, update_policy;
the label intake: LabelClient.check, new_records, request, LabelRequests.add_labels, label_requests) is
wrapped with a timer; the table is ms per update. What ranking adds to none there is ONI's cost on the
learner's critical path.

--update: the policy update of oni_appo.py on a batch shaped like a real one (--batch-size steps in rollouts
of 32, the observations of a real NLE run), stage by stage. Stages, timed with the real functions: the
encoder's forward pass alone (`Agent.encode`, no grad), the whole forward pass and loss (`appo_loss`: encoder,
GRU unroll, V-trace), the backward pass, gradient clipping and Adam's step, and the copy of the weights into
the acting agent. "GRU unroll + V-trace + loss" is the forward pass minus the encoder alone.

Then the ceiling: the update's floating-point operations in matrix products and convolutions (counted by
torch's FlopCounterMode, forward and backward) over its time, beside a 1024x1024 matrix product's rate on the
same threads. Their quotient is how much faster the same operations could run on these cores if every
operation ran at matrix-product speed and nothing else took time: the bound on a faster update that does the
same operations on a CPU (a different formulation of the same math could do fewer). The matrix-product rate is
taken after every update, under the same load. Then the policy's inference (`Agent.step`, as `act` runs it on
a CPU) in us per env step by batch size. --bf16 also times forward + backward under torch's CPU bfloat16
autocast, alternated with float32, with both losses and the gradients' relative difference: faster, but not
the same math.
"""
import argparse
import collections
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # the method; tests/fake_openai.py
# Training runs time the learner as it trains, under the OMP_WAIT_POLICY=PASSIVE that oni_appo sets before
# torch loads; --update's figures were taken under torch's own policy, so there torch loads first.
if "--update" in sys.argv:
    import torch
import annotator  # noqa: E402
import envs  # noqa: E402
import fake_openai  # noqa: E402
import oni_appo  # noqa: E402
import reward_models  # noqa: E402
import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

SPENT = collections.defaultdict(float)
TIMED = ([(oni_appo, name) for name in ("next_batch", "take_batch", "add_intrinsic_episodes",
                                        "update_policy")]
         + [(annotator.LabelClient, name) for name in ("check", "new_records", "request")]
         + [(reward_models.IntrinsicReward, "rewards")]
         + [(reward_models.LabelRequests, name) for name in ("add_labels", "label_requests")])


def timed(function, key):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            SPENT[key] += time.perf_counter() - start
    return wrapper


def time_runs(args):
    """The learner's functions timed in a `none` and a `ranking` run: their ms per update."""
    for owner, name in TIMED:
        setattr(owner, name, timed(getattr(owner, name),
                                   f"{getattr(owner, '__name__', '')}.{name}".lstrip(".")))
    stub, url = fake_openai.serve_apart()  # not on the learner's GIL
    columns = {}
    for kind, extra in (("none", []), ("ranking", ["--llm-url", url])):
        SPENT.clear()
        summary = oni_appo.train(oni_appo.parse_args(
            ["--reward-type", kind, *extra, "--total-env-steps", str(args.steps), "--num-workers",
             str(args.num_workers), "--run-dir", tempfile.mkdtemp(prefix="oni-learner-time-"),
             "--checkpoint-every-s", "1e9",
             *args.oni_args.split()]))
        columns[kind] = {key: 1e3 * value / summary["updates"] for key, value in SPENT.items()}
        columns[kind]["steps/s"] = summary.get("session_sps", summary["sps"])  # collected a second
    stub.stdin.close()
    stub.wait()
    print(f"| ms per update | none | ranking |\n|---|---|---|")
    for key in sorted(set(columns["none"]) | set(columns["ranking"]),
                      key=lambda k: -columns["ranking"].get(k, 0)):
        print(f"| {key} | {columns['none'].get(key, 0):.1f} | {columns['ranking'].get(key, 0):.1f} |")


def real_batch(args, rollout=32):
    """Observations of random play on real NLE, as the learner gets them: [T+1, B, ...]."""
    envs_per_rollout = args.batch_size // rollout
    env = envs.make_env("NetHackScoreExtendedActions-v1", seed=0)
    rng = np.random.default_rng(0)
    obs, frames = env.reset()[0], []
    for _ in range((rollout + 1) * envs_per_rollout):
        frames.append({k: obs[k].copy() for k in oni_appo.OBS_FIELDS})
        obs, _, terminated, truncated, _ = env.step(int(rng.integers(len(envs.ACTIONS))))
        if terminated or truncated:
            obs = env.reset()[0]
    stacked = {k: torch.from_numpy(np.stack([f[k] for f in frames])) for k in oni_appo.OBS_FIELDS}
    shape = (rollout + 1, envs_per_rollout)
    batch = {"obs": {k: v.view(*shape, *v.shape[1:]) for k, v in stacked.items()},
             "h0": torch.zeros(envs_per_rollout, 512),
             "action": torch.from_numpy(rng.integers(len(envs.ACTIONS), size=(rollout, envs_per_rollout))),
             "logprob": torch.full((rollout, envs_per_rollout), -np.log(len(envs.ACTIONS)),
                                   dtype=torch.float32),
             "end": torch.zeros(rollout, envs_per_rollout, dtype=torch.int8)}
    batch["end"][10, ::3] = oni_appo.End.TERMINATED  # some episode ends inside the rollouts
    return batch, torch.from_numpy(rng.normal(0, 0.1, (rollout, envs_per_rollout)).astype(np.float32))


def time_update(args):
    """One policy update stage by stage, its arithmetic against a matrix product's rate, and inference."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    train_args = oni_appo.Args()
    agent, acting_agent = oni_appo.Agent(), oni_appo.Agent().eval()
    optimizer = torch.optim.Adam(agent.parameters(), lr=train_args.lr, eps=1e-5)
    batch, rewards = real_batch(args)
    flat_obs = {k: v.flatten(0, 1) for k, v in batch["obs"].items()}
    times = {name: [] for name in ("encoder forward", "forward + loss", "backward", "clip + Adam step",
                                   "weights to the acting agent")}
    # a burst of matrix products after each update: the same load as the update it is compared to
    matmul_rates = []
    for update in range(3 + args.updates):
        marks = [time.perf_counter()]
        with torch.no_grad():
            agent.encode(flat_obs)
        marks.append(time.perf_counter())
        loss, _ = oni_appo.appo_loss(agent, batch, rewards, train_args)
        marks.append(time.perf_counter())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(agent.parameters(), train_args.max_grad_norm)
        optimizer.step()
        marks.append(time.perf_counter())
        acting_agent.load_state_dict(agent.state_dict())
        marks.append(time.perf_counter())
        if update >= 3:
            for name, start, end in zip(times, marks, marks[1:]):
                times[name].append(end - start)
            matmul_rates.append(matmul_gflops())
    ms = {name: 1e3 * float(np.median(v)) for name, v in times.items()}
    update_ms = sum(ms.values()) - ms["encoder forward"]  # the encoder runs again inside forward + loss
    print(f"one update of {args.batch_size} steps, {torch.get_num_threads()} torch threads, "
          f"median of {args.updates}: {update_ms:.0f} ms")
    rows = [("encoder forward (inside forward + loss)", ms["encoder forward"]),
            ("GRU unroll + V-trace + loss (forward)", ms["forward + loss"] - ms["encoder forward"]),
            *[(name, ms[name]) for name in ("backward", "clip + Adam step", "weights to the acting agent")]]
    print("| stage | ms | share |\n|---|---|---|")
    for name, value in rows:
        print(f"| {name} | {value:.1f} | {value / update_ms:.0%} |")
    with FlopCounterMode(display=False) as counter:
        loss, _ = oni_appo.appo_loss(agent, batch, rewards, train_args)
        loss.backward()
    update_gflop, matmul = counter.get_total_flops() / 1e9, float(np.median(matmul_rates))
    rate = update_gflop / (update_ms / 1e3)
    print(f"arithmetic: {update_gflop:.3f} GFLOP per update (matrix products and convolutions) = {rate:.0f} "
          f"GFLOP/s; a 1024x1024 matrix product: {matmul:.0f} GFLOP/s on the same threads = "
          f"{rate / matmul:.0%} of it; with its operations at matrix-product speed the update would be "
          f"{matmul / rate:.2f}x faster")
    with torch.no_grad():
        per_step = {n: inference_us(acting_agent, {k: v[:n] for k, v in flat_obs.items()})
                    for n in (8, 16, 32, 64, 128)
                    if n <= len(flat_obs["chars"])}
    print("inference (Agent.step, no grad), us per env step by batch size: " +
          ", ".join(f"{n}: {us:.0f}" for n, us in per_step.items()))
    if args.bf16:
        compare_bf16(agent, batch, rewards, train_args, args.updates)


def inference_us(agent, obs, repeats=20):
    n = len(obs["chars"])
    h = torch.zeros(n, agent.gru.hidden_size)
    agent.step(obs, h)
    start = time.perf_counter()
    for _ in range(repeats):
        agent.step(obs, h)
    return 1e6 * (time.perf_counter() - start) / repeats / n


def compare_bf16(agent, batch, rewards, train_args, updates):
    """Forward + backward in float32 and under bf16 autocast, alternated (the box's load moves); their losses
    and the gradients' relative difference on the same weights."""
    times, losses, grads = {False: [], True: []}, {}, {}
    for update in range(2 + updates):
        for bf16 in (False, True):
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss, _ = oni_appo.appo_loss(agent, batch, rewards, train_args)
            agent.zero_grad(set_to_none=True)
            loss.backward()
            if update >= 2:
                times[bf16].append(time.perf_counter() - start)
            losses[bf16] = loss.item()
            grads[bf16] = torch.cat([p.grad.flatten() for p in agent.parameters()])
    fp32_ms, bf16_ms = (1e3 * float(np.median(times[bf16])) for bf16 in (False, True))
    grad_error = ((grads[True] - grads[False]).norm() / grads[False].norm()).item()
    print(f"forward + backward: float32 {fp32_ms:.0f} ms, loss {losses[False]:.6f}; bfloat16 autocast "
          f"{bf16_ms:.0f} ms, loss {losses[True]:.6f}: {fp32_ms / bf16_ms:.2f}x faster, loss off by "
          f"{abs(losses[True] / losses[False] - 1):.1e}, gradient off by {grad_error:.1e} (relative norm)")


def matmul_gflops(n=1024, repeats=5):
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n ** 3 * repeats / (time.perf_counter() - start) / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--update", action="store_true",
                        help="one policy update stage by stage, not training runs")
    runs = parser.add_argument_group("training runs (the default)")
    runs.add_argument("--steps", type=int, default=50_000)
    runs.add_argument("--num-workers", type=int, default=2)
    runs.add_argument("--oni-args", default="", help="more flags of oni_appo.py, e.g. '--num-envs-per-worker "
                      "16 --batch-size 1024' (on a GPU its defaults are 64 and 4096)")
    update = parser.add_argument_group("--update")
    update.add_argument("--batch-size", type=int, default=1024)
    update.add_argument("--updates", type=int, default=20)
    update.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    update.add_argument("--bf16", action="store_true",
                        help="also time forward + backward under bf16 autocast")
    args = parser.parse_args()
    other = runs if args.update else update  # the other mode's flags would be ignored: an error instead
    parser.set_defaults(**{action.dest: None for action in other._group_actions})  # None: not given
    again = parser.parse_args()
    given = [action.option_strings[0] for action in other._group_actions
             if getattr(again, action.dest) is not None]
    if given:
        parser.error(f"{', '.join(given)}: only {'without' if args.update else 'with'} --update")
    (time_update if args.update else time_runs)(args)


if __name__ == "__main__":
    main()
