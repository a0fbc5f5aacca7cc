"""Steps/s of each task beside raw NLE with the same observation keys and actions, in one run.

    python benchmarks/env_throughput.py --seconds 10

Both sides take the same random actions; measurements alternate in chunks so that machine noise
hits both alike. The ratio (task / raw) is the cost of our wrappers; the goal is >= 0.85.
"""
import argparse
import os
import sys
import time

import numpy as np
from nle.env import base

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import envs  # noqa: E402


class RawNLE(base.NLE):
    """NLE with the same keys and actions, each game seeded from NetHack's side as envs.py does (reset(seed=)
    seeds only gym's): with fix_moon_phase its moon then follows the seeds, not the clock."""

    def __init__(self, seed):
        super().__init__(observation_keys=envs.OBS_KEYS, actions=envs.ACTIONS, fix_moon_phase=True)
        self.seeds = np.random.default_rng(seed)

    def reset(self, **kwargs):
        self.seed(*(int(s) for s in self.seeds.integers(1, 2**62, size=2)), reseed=False)
        return super().reset(**kwargs)


def run_chunk(env, rng, steps):
    start = time.perf_counter()
    for _ in range(steps):
        _, _, terminated, truncated, _ = env.step(int(rng.integers(len(envs.ACTIONS))))
        if terminated or truncated:
            env.reset()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="time per side and task")
    parser.add_argument("--chunk", type=int, default=2000, help="steps per alternation")
    args = parser.parse_args()
    print(f"{'task':42s} {'raw NLE/s':>10s} {'task/s':>10s} {'ratio':>6s}")
    for task in envs.TASKS:
        raw = RawNLE(seed=0)
        ours = envs.make_env(task, seed=0)
        raw.reset()
        ours.reset()
        totals = {"raw": [0, 0.0], "ours": [0, 0.0]}
        rng_raw, rng_ours = np.random.default_rng(0), np.random.default_rng(0)
        while min(t[1] for t in totals.values()) < args.seconds:
            for name, env, rng in (("raw", raw, rng_raw), ("ours", ours, rng_ours)):
                totals[name][1] += run_chunk(env, rng, args.chunk)
                totals[name][0] += args.chunk
        raw_sps, ours_sps = (totals[k][0] / totals[k][1] for k in ("raw", "ours"))
        print(f"{task:42s} {raw_sps:10.0f} {ours_sps:10.0f} {ours_sps / raw_sps:6.2f}", flush=True)
        raw.close()
        ours.close()


if __name__ == "__main__":
    main()
