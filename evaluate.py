"""Evaluate a checkpoint of oni_appo.py: play episodes with its policy and report their statistics.

    python evaluate.py runs/NAME --episodes 20            # the trained policy -> runs/NAME/eval.json
    python evaluate.py runs/NAME --episodes 20 --random   # the same games, uniformly random actions

The games come from the run's seed but from a stream no training run plays, so a policy and the
random baseline are compared on the same episodes. Actions are sampled, as in training.
(Its own file, as CleanRL keeps its evals apart from the training scripts.)
"""
import json
import os
from dataclasses import dataclass

import numpy as np
import torch
import tyro

import envs
from oni_appo import OBS_FIELDS, Agent, fail, load_checkpoint, pick_device


@dataclass
class Args:
    checkpoint: tyro.conf.Positional[str]
    """a checkpoint file of oni_appo.py or its run dir"""
    episodes: int = 10
    """episodes to play (16 at a time)"""
    random: bool = False
    """play the same episodes with uniformly random actions instead (a baseline)"""
    device: str = "auto"
    """torch device: auto (cuda if there is one), cpu, cuda, cuda:1..."""


def evaluate(args: Args) -> dict:
    if args.episodes < 1:
        fail("--episodes must be at least 1")
    device = pick_device(args.device)
    agent = Agent().to(device).eval()
    path, _, saved = load_checkpoint(args.checkpoint, agent)
    torch.manual_seed(saved.seed)  # the same actions each time, and the same random ones with --random
    n = min(args.episodes, 16)
    first_seed = 10_000_019 * (saved.seed + 1)  # episodes no training run plays
    pool = [envs.make_env(saved.task, seed=first_seed + i, max_episode_steps=saved.max_episode_steps) for i in range(n)]
    obs = [env.reset()[0] for env in pool]
    h = torch.zeros(n, agent.gru.hidden_size, device=device)
    results, started, active = [], n, list(range(n))
    with torch.no_grad():
        while active:
            batch = {k: torch.from_numpy(np.stack([obs[i][k] for i in active])).to(device) for k in OBS_FIELDS}
            logits, _, h[active] = agent.step(batch, h[active])
            if args.random:
                logits = torch.zeros_like(logits)
            actions = torch.distributions.Categorical(logits=logits).sample().tolist()
            for i, action in zip(list(active), actions):
                obs[i], _, terminated, truncated, info = pool[i].step(action)
                if terminated or truncated:
                    results.append(info["episode"])
                    if started < args.episodes:
                        started += 1
                        obs[i], h[i] = pool[i].reset()[0], 0.0
                    else:
                        active.remove(i)
    summary = {k: float(np.mean([r[k] for r in results])) for k in results[0]}
    print(f"{len(results)} episodes of {saved.task} with {'random actions' if args.random else path}:")
    for k, v in summary.items():
        print(f"  {k:10s} {v:12.2f} +- {np.std([r[k] for r in results]):.2f}")
    out = os.path.join(os.path.dirname(path), "eval_random.json" if args.random else "eval.json")
    with open(out, "w") as f:
        json.dump({"checkpoint": path, "random_actions": args.random, "episodes": results, "mean": summary}, f, indent=1)
    return summary


if __name__ == "__main__":
    evaluate(tyro.cli(Args))
