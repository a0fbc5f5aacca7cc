"""ONI: APPO (PPO with V-trace) on NetHack, with an intrinsic reward learned online from LLM labels.

    python oni_appo.py --reward-type ranking

Env worker processes step their envs in two halves (double buffering) into shared-memory rollout buffers; one
acting process acts for the halves that are ready; this process, the learner, trains on full rollouts and
hands the new weights back. `annotator.py` (a subprocess) asks an LLM about the messages the agent sees and
`reward_models.py` turns its labels into the intrinsic reward. See README.md.

Sections, in the data's order, defining a thing before its use: config, policy, V-trace and loss, env workers;
then top-down, each function before the helpers it calls: acting process, learner, checkpoints and logs."""
import collections
import contextlib
import dataclasses
import enum
import json
import math
import multiprocessing.connection
import os
import signal
import sys
import time
from dataclasses import dataclass, field

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # Before torch, so that idle OpenMP threads sleep.
import numpy as np
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import tyro

import annotator
import envs
import llm_server
import reward_models
from run_files import git_state, hold, read_checkpoint, rewrite, write_checkpoint


# ---------------------------------------- config ----------------------------------------------------------
# The flags, parsed and checked; a resume takes its checkpoint's (load_checkpoint, in the last section).
@dataclass
class Args:
    task: str = "NetHackScoreExtendedActions-v1"
    """NetHack task (see envs.TASKS)"""
    reward_type: str = "none"
    """intrinsic reward: none | retrieval | classification | ranking (ONI) | ellm | motif (baselines)"""
    seed: int = 1
    """seed of torch, numpy, every env's stream of game seeds, the action sampling and the reward's draws"""
    total_env_steps: int = 2_000_000_000
    """env steps to train for (the paper: 2e9)"""
    num_workers: int | None = None
    """env worker processes (default: the machine's cores; with a GPU two fewer, for acting and learning)"""
    num_envs_per_worker: int | None = None
    """envs per worker, stepped in two halves while the other waits for actions (even; default 16, GPU 64)"""
    rollout: int = 32
    """steps per rollout (the V-trace / GRU unroll length)"""
    batch_size: int | None = None
    """env steps per update, a multiple of rollout * num_envs_per_worker / 2 (default 1024, GPU 4096)"""
    lr: float = 1e-4
    """Adam learning rate"""
    gamma: float = 0.99
    """discount"""
    ent_coef: float = 0.003
    """entropy bonus"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    clip_coef: float = 0.1
    """PPO ratio clip: the ratio is kept in [1/(1+c), 1+c]"""
    max_grad_norm: float = 4.0
    """gradient norm clip"""
    extrinsic_coef: float | None = None
    """c_ext; default 0.1 on Score, 10 on the Staircase and Oracle tasks (the paper); 0 = reward-free"""
    intrinsic_coef: float = 0.4
    """c_int, weight of the intrinsic reward R(message) / N^beta"""
    reward_scale: float = 0.1
    """env rewards are scaled by this, then clipped to +-reward_clip"""
    reward_clip: float = 10.0
    """clip of the scaled env reward"""
    count_beta: float = 3.0
    """beta in the count normalization 1/N^beta (N: times the message was seen this episode)"""
    max_episode_steps: int = envs.MAX_EPISODE_STEPS
    """time limit of an episode in steps (truncated, bootstrapped); NLE's default 5000"""
    raw_ranking: bool = False
    """ranking as the reference code: the model's raw output as R, pairs drawn by steps (see README)"""
    reward_model_share: float = 1.0
    """classification/ranking: the most of wall time their trainer may take (1: no rest, see README)"""
    llm_url: list[str] = field(default_factory=list)
    """base URLs of OpenAI-compatible LLM servers, requests spread over them (none: embedded llm_server.py)"""
    llm_model: str | None = None
    """model name to ask for (default: the first one the server lists)"""
    llm_concurrency: int | None = None
    """LLM requests in flight (default: 64 for --llm-url servers, which batch them; 1 for the embedded)"""
    llm_threads: int | None = None
    """CPU threads of the embedded LLM server (default: the cores left over by the env workers, >= 1)"""
    llm_share: float | None = None
    """the embedded LLM server's most CPU time over wall time (default 0.4 of a core: it shares the learner's
    cores); with --llm-url, the most of wall time a request is in flight (default 1)"""
    prompt_file: str | None = None
    """JSON file with your own prompt templates (see annotator.py)"""
    demos: str | None = None
    """the embedded labeler's demonstration pool: a label_sets.tsv-style file (its dev rows) or a run's
    labels.jsonl, e.g. one an 8B model labelled through --llm-url (default: label_sets.tsv, beside this)"""
    labels_from: str | None = None
    """seed the label table with a labels.jsonl of an earlier run; motif: the pairs to train on"""
    run_dir: str | None = None
    """where checkpoints, tensorboard events, labels.jsonl and summary.json go (default: runs/NAME)"""
    resume: str | None = None
    """continue a run from its directory or a checkpoint file, at its exact counters"""
    checkpoint_every_s: float = 600.0
    """seconds between periodic checkpoints"""
    device: str = "auto"
    """torch device for inference and learning: auto (cuda if there is one), cpu, cuda, cuda:1..."""
    track: bool = False
    """also log to Weights & Biases (needs `pip install wandb`)"""
    wandb_project: str = "oni"
    """wandb project"""


RESUME_OVERRIDES = ("total_env_steps", "num_workers", "device", "track", "llm_url", "llm_model",
                    "llm_concurrency", "llm_threads", "llm_share", "prompt_file", "checkpoint_every_s",
                    "reward_model_share")  # A resume takes these from its command line.


def fail(message: str):  # A clear one-line error for the user, with no traceback.
    raise SystemExit(f"error: {message}")


def given_flags(argv) -> set[str]:
    """The Args fields named in argv (--a-b, --a=v, --no-a), even at their defaults: a resume applies them."""
    names = {f.name for f in dataclasses.fields(Args)}
    flags = {token[2:].split("=", 1)[0].replace("-", "_") for token in argv if token.startswith("--")}
    return {name if name in names else name.removeprefix("no_") for name in flags} & names


def parse_args(argv=None) -> Args:
    """The flags of argv (default: the command line) or of the checkpoint to resume, checked and completed."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = tyro.cli(Args, args=argv)
    args.demos = args.demos and os.path.abspath(args.demos)  # So that a resume from elsewhere finds it.
    if args.resume is not None:
        path, _, saved = load_checkpoint(args.resume)
        for name in sorted(given_flags(argv) - {"resume", "run_dir"}):
            if name in RESUME_OVERRIDES:
                setattr(saved, name, getattr(args, name))
            else:
                print(f"--resume: ignoring --{name.replace('_', '-')}; the run keeps its saved value",
                      file=sys.stderr)
        # A saved URL was named by whoever made the run: the key goes only where this command line sends it.
        if saved.llm_url and "llm_url" not in given_flags(argv):
            if os.environ.get(llm_server.KEY_VARIABLE):
                fail(f"--resume: the run asked {' '.join(saved.llm_url)}; {llm_server.KEY_VARIABLE} "
                     "goes only to servers named on this command line: give --llm-url again")
            print(f"--resume: asking the run's --llm-url {' '.join(saved.llm_url)}", file=sys.stderr)
        saved.resume, saved.run_dir = path, os.path.dirname(path)
        args = saved
    if args.task not in envs.TASKS:
        fail(f"unknown task {args.task!r}; known tasks: {', '.join(envs.TASKS)}")
    if args.reward_type not in reward_models.REWARD_TYPES:
        fail(f"unknown reward type {args.reward_type!r}; "
             f"choose one of {', '.join(reward_models.REWARD_TYPES)}")
    # Defaults by machine (benchmarks/README.md, On a GPU node) and task; a resumed run's are not None.
    gpu = torch.cuda.is_available() if args.device == "auto" else args.device.startswith("cuda")
    run_name = f"{args.task.split('Extended')[0]}__{args.reward_type}__{args.seed}__{int(time.time())}"
    defaults = dict(num_workers=max(1, (os.cpu_count() or 1) - 2 * gpu), batch_size=4096 if gpu else 1024,
                    num_envs_per_worker=64 if gpu else 16, run_dir=os.path.join("runs", run_name),
                    extrinsic_coef=0.1 if args.task.startswith("NetHackScore") else 10.0)
    for name, value in defaults.items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    annotator.check_llm_flags(args.llm_url, args.llm_concurrency)  # Before the run dir or any process.
    counts = args.num_workers, args.rollout, args.batch_size, args.total_env_steps
    if min(*counts, args.num_envs_per_worker - 1) < 1 or args.num_envs_per_worker % 2:
        fail("need --num-workers, --rollout, --batch-size, --total-env-steps >= 1 and an even "
             "--num-envs-per-worker >= 2")
    if (args.max_episode_steps < 1 or (args.llm_threads is not None and args.llm_threads < 1)
            or not 0 < args.reward_model_share <= 1
            or not 0 < (1 if args.llm_share is None else args.llm_share) <= 1):
        fail("need --max-episode-steps >= 1, --llm-threads >= 1, 0 < --reward-model-share <= 1 and "
             "0 < --llm-share <= 1")
    slot_steps = args.rollout * args.num_envs_per_worker // 2
    if args.batch_size % slot_steps:
        fail(f"--batch-size ({args.batch_size}) must be a multiple of rollout * num_envs_per_worker / 2"
             f" = {slot_steps}")
    earlier = [name for name in ("checkpoint.pt", "episodes.jsonl", "episodes.jsonl.gz",
                                 annotator.LABELS_FILE)
               if args.resume is None and os.path.exists(os.path.join(args.run_dir, name))]
    if earlier:  # A fresh start would overwrite its checkpoint and append to its logs (.gz: a committed run).
        remedy = "--resume it, or move them aside" if "checkpoint.pt" in earlier else "move them aside"
        fail(f"--run-dir {args.run_dir} holds a run ({', '.join(earlier)}): {remedy}")
    return args


def pick_device(name):
    name = ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name
    try:
        torch.empty(1, device=name)
    except Exception as error:
        fail(f"cannot use device {name!r}: {str(error).splitlines()[0]}")
    return torch.device(name)


# ---------------------------------------- policy ----------------------------------------------------------
# The agent: an encoder of what it sees, a GRU for memory, and an actor and a critic head.
CROP, HIDDEN = 12, 512  # The paper's crop of the map around the agent; the GRU's width.


def layer_init(layer, std=np.sqrt(2)):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


class Agent(nn.Module):
    """12x12 crop (char + colour embeddings, two convs), stats, message (MLPs) -> GRU 512 -> actor, critic."""
    def __init__(self, num_actions=len(envs.ACTIONS), hidden=HIDDEN):
        super().__init__()
        self.char_embed, self.color_embed = nn.Embedding(256, 32), nn.Embedding(16, 32)
        self.crop_net = nn.Sequential(layer_init(nn.Conv2d(32, 64, 3, padding=1)), nn.ELU(),
                                      layer_init(nn.Conv2d(64, 64, 3, stride=2, padding=1)), nn.ELU(),
                                      nn.Flatten(), layer_init(nn.Linear(64 * (CROP // 2) ** 2, 256)),
                                      nn.ELU())
        self.stats_net = nn.Sequential(layer_init(nn.Linear(27, 64)), nn.ELU(),
                                       layer_init(nn.Linear(64, 64)), nn.ELU())
        self.message_net = nn.Sequential(layer_init(nn.Linear(envs.MESSAGE_LEN, 128)), nn.ELU(),
                                         layer_init(nn.Linear(128, 128)), nn.ELU())
        self.fuse = nn.Sequential(layer_init(nn.Linear(256 + 64 + 128, hidden)), nn.ELU())
        self.gru = nn.GRUCell(hidden, hidden)
        self.actor = layer_init(nn.Linear(hidden, num_actions), std=0.01)
        self.critic = layer_init(nn.Linear(hidden, 1), std=1.0)
        # fast_step's CUDA graphs by batch size, and the memory pool and stream they share.
        self.graphs, self.capture = {}, None

    def encode(self, obs):
        """obs: chars/colors [N,21,79] uint8, blstats [N,27], message [N,256] -> [N, hidden]."""
        chars, colors, blstats = obs["chars"].long(), obs["colors"].long(), obs["blstats"].float()
        n, pad = chars.shape[0], CROP // 2  # The map is padded by half a crop on each side.
        x, y = blstats[:, envs.X].long().clamp(0, 78) + pad, blstats[:, envs.Y].long().clamp(0, 20) + pad
        offsets = torch.arange(-pad, CROP - pad, device=chars.device)
        rows, cols = (y[:, None] + offsets)[:, :, None], (x[:, None] + offsets)[:, None, :]
        batch = torch.arange(n, device=chars.device)[:, None, None]
        crop_chars = F.pad(chars, (pad, pad, pad, pad))[batch, rows, cols]
        crop_colors = F.pad(colors, (pad, pad, pad, pad))[batch, rows, cols]
        crop = (self.char_embed(crop_chars) + self.color_embed(crop_colors)).permute(0, 3, 1, 2)
        stats = torch.sign(blstats) * torch.log1p(blstats.abs())  # They span 1 to 1e6: a log scale.
        message = obs["message"].float() / 255.0
        features = [self.crop_net(crop), self.stats_net(stats), self.message_net(message)]
        return self.fuse(torch.cat(features, dim=1))

    def step(self, obs, h):
        h = self.gru(self.encode(obs), h)
        return self.actor(h), self.critic(h).squeeze(-1), h

    def fast_step(self, obs, h):
        """step(); on a GPU under no_grad, a bit-identical replay of a CUDA graph captured per batch size."""
        if h.device.type != "cuda":
            return self.step(obs, h)
        with torch.no_grad(), torch.cuda.device(h.device):  # On h's GPU, not the current one.
            if len(h) not in self.graphs:
                inputs, graph = ({k: v.clone() for k, v in obs.items()}, h.clone()), torch.cuda.CUDAGraph()
                self.step(*inputs)  # A warm-up: cuDNN and cuBLAS make their handles outside the capture.
                # All batch sizes share one memory pool and one stream; only this thread's work is captured.
                self.capture = self.capture or (torch.cuda.graph_pool_handle(), torch.cuda.Stream(h.device))
                with torch.cuda.graph(graph, *self.capture, capture_error_mode="thread_local"):
                    outputs = self.step(*inputs)
                self.graphs[len(h)] = graph, inputs, outputs  # Kept once captured.
            graph, (obs_in, h_in), outputs = self.graphs[len(h)]
            torch._foreach_copy_([*obs_in.values(), h_in], [*(obs[k] for k in obs_in), h])
            graph.replay()
        return outputs  # The next replay of any size rewrites them; act() is done with them by then.

    def unroll(self, obs, h0, cuts):
        """obs: [T+1, B, ...]; cuts[t]: the state resets before obs t+1. -> logits [T+1, B, A], values."""
        steps, batch = obs["chars"].shape[:2]
        features = self.encode({k: v.flatten(0, 1) for k, v in obs.items()}).view(steps, batch, -1)
        h, outputs = h0, []
        for t in range(steps):
            h = self.gru(features[t], h if t == 0 else h * (~cuts[t - 1]).float()[:, None])
            outputs.append(h)
        return self.actor(out := torch.stack(outputs)), self.critic(out).squeeze(-1)


# ---------------------------------------- V-trace and loss ------------------------------------------------
# What the learner computes from a batch: end codes, V-trace targets over a rollout, the APPO loss.
class End(enum.IntEnum):
    RUNNING = 0
    TERMINATED = 1  # Death or success: the return is cut, and the next observation starts a new episode.
    TRUNCATED = 2  # The time limit: bootstrapped from its last observation, which obs t+1 shows.
    RESET = 3  # The step after a truncation only reset the env: it is no transition of the policy.


def episode_cut(end):
    """Transitions after which the next observation starts a new episode (ints: numpy is slow on IntEnums)."""
    return (end == End.TERMINATED.value) | (end == End.RESET.value)


def carry_state(h, end):
    """The GRU state [..., hidden] the next observation starts from: zeroed after an episode's end."""
    return h * ~episode_cut(end).to(h.device)[..., None]


def vtrace(rewards, values, bootstrap, discounts, rhos, cs):
    """V-trace (Espeholt et al. 2018, eq. 1): vs and advantages [T, B]; bootstrap: V(x_T) [B]."""
    next_values = torch.cat([values[1:], bootstrap[None]])
    deltas = rhos * (rewards + discounts * next_values - values)
    acc, vs = torch.zeros_like(bootstrap), torch.empty_like(values)
    for t in reversed(range(values.shape[0])):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs[t] = values[t] + acc
    return vs, rhos * (rewards + discounts * torch.cat([vs[1:], bootstrap[None]]) - values)


def vtrace_targets(end, rewards, values, ratio, gamma):
    """V-trace over a rollout; values: [T+1, B], the last bootstraps; the end codes as End describes them."""
    discounts = gamma * ((end == End.RUNNING) | (end == End.TRUNCATED)).float()
    clipped = ratio.clamp(max=1.0) * (end != End.RESET).float()  # rho_bar = c_bar = 1
    return vtrace(rewards, values[:-1], values[-1], discounts, clipped, clipped)


def appo_loss(agent, batch, rewards, args):
    """Clipped PPO on V-trace advantages, value loss, entropy; sample-factory v1's coefficients (ONI's)."""
    end = batch["end"]
    valid = (end != End.RESET).float()  # A reset step is no transition of the policy.
    logits, values = agent.unroll(batch["obs"], batch["h0"], episode_cut(end))
    log_probs = torch.log_softmax(logits[:-1], dim=-1)
    new_logp = log_probs.gather(-1, batch["action"][..., None]).squeeze(-1)
    ratio = torch.exp(new_logp - batch["logprob"]).clamp(0.05, 20.0)  # Far-off ratios are noise.
    with torch.no_grad():
        vs, advantages = vtrace_targets(end, rewards, values, ratio, args.gamma)
        n = valid.sum().clamp(min=1)
        mean = (advantages * valid).sum() / n
        std = (((advantages - mean) ** 2 * valid).sum() / n).sqrt()
        advantages = (advantages - mean) / std.clamp(min=1e-3)
    low, high = 1.0 / (1.0 + args.clip_coef), 1.0 + args.clip_coef
    surrogate = torch.min(ratio * advantages, ratio.clamp(low, high) * advantages)
    policy_loss = -(surrogate * valid).sum() / n
    value_loss = (((values[:-1] - vs) ** 2) * valid).sum() / n
    entropy = (-(log_probs.exp() * log_probs).sum(-1) * valid).sum() / n
    loss = policy_loss + args.vf_coef * value_loss - args.ent_coef * entropy
    clip_fraction = (((ratio < low) | (ratio > high)).float() * valid).sum().item() / n.item()
    return loss, {"policy_loss": policy_loss.item(), "value_loss": value_loss.item(),
                  "entropy": entropy.item(), "clip_fraction": clip_fraction}


# ---------------------------------------- env workers -----------------------------------------------------
# Env worker processes step their envs, half of them per command, into the shared rollout buffers.
OBS_FIELDS = ("chars", "colors", "blstats", "message")


def make_buffers(num_buffers, rollout, n):
    """Rollout buffers in shared memory, indexed [buffer, t, env of the slot]."""
    def shared(*shape, dtype):
        return torch.zeros(num_buffers, *shape, dtype=dtype).share_memory_()
    return {
        "chars": shared(rollout + 1, n, 21, 79, dtype=torch.uint8),
        "colors": shared(rollout + 1, n, 21, 79, dtype=torch.uint8),
        "blstats": shared(rollout + 1, n, 27, dtype=torch.float32),
        "message": shared(rollout + 1, n, envs.MESSAGE_LEN, dtype=torch.uint8),
        # The reward's input: each step's own message and its count N (at an episode's end not message[t+1]).
        "step_message": shared(rollout, n, envs.MESSAGE_LEN, dtype=torch.uint8),
        "step_count": shared(rollout, n, dtype=torch.int32), "action": shared(rollout, n, dtype=torch.int64),
        "logprob": shared(rollout, n, dtype=torch.float32), "reward": shared(rollout, n, dtype=torch.float32),
        "end": shared(rollout, n, dtype=torch.int8), "version": shared(rollout, dtype=torch.int64),
        "h0": shared(n, HIDDEN, dtype=torch.float32)}


def env_worker(index, task, seed, num_envs, buffers, conn, max_episode_steps=envs.MAX_EPISODE_STEPS):
    """Steps half of its envs per command (half, buffer, t): the actions at [buffer, t] in; the reward, end
    code (End), the step's own message at t and the next observation at t+1 out (t=-1: a reset into 0)."""
    torch.set_num_threads(1)
    bufs, half_size = {k: v.numpy() for k, v in buffers.items()}, num_envs // 2
    needs_reset = [False] * num_envs
    seeds = [seed + index * num_envs + i for i in range(num_envs)]
    pool = [envs.make_env(task, seed=s, max_episode_steps=max_episode_steps) for s in seeds]
    with contextlib.suppress(EOFError, OSError):  # The acting process is gone (killed): never outlive it.
        for half, b, t in iter(conn.recv, None):
            episodes = []
            for j, i in enumerate(range(half * half_size, (half + 1) * half_size)):  # j: the buffers' column.
                reward, end, message, count, stepped = 0.0, End.RESET, 0, 1, False  # A reset has no message.
                try:
                    if t < 0 or needs_reset[i]:
                        (obs, _), needs_reset[i] = pool[i].reset(), False
                    else:
                        obs, reward, terminated, truncated, info = pool[i].step(bufs["action"][b, t, j])
                        end = End.TERMINATED if terminated else End.TRUNCATED if truncated else End.RUNNING
                        # A copy, since the reset below refills the observation's arrays.
                        message, count, stepped = obs["message"].copy(), info["message_count"], True
                        if terminated or truncated:
                            episodes.append((i, info["episode"]))
                        if terminated:
                            obs, _ = pool[i].reset()
                        needs_reset[i] = truncated
                except Exception as error:  # A crashed game must not stop the run: replace it.
                    print(f"worker {index}: env {i} crashed ({error!r}); recreating it", file=sys.stderr)
                    with contextlib.suppress(Exception):
                        pool[i].close()
                    seeds[i] += 1_000_003  # Another stream of games.
                    pool[i] = envs.make_env(task, seed=seeds[i], max_episode_steps=max_episode_steps)
                    (obs, _), needs_reset[i] = pool[i].reset(), False
                    if not stepped:  # Else the step ended its episode, only the reset failed: keep it.
                        reward, end = 0.0, End.RESET
                for k in OBS_FIELDS:  # At t = -1 (the first reset) this writes at 0.
                    bufs[k][b, t + 1, j] = obs[k]
                if t >= 0:
                    bufs["step_message"][b, t, j], bufs["step_count"][b, t, j] = message, count
                    bufs["reward"][b, t, j], bufs["end"][b, t, j] = reward, end
            conn.send((half, episodes))
    for env in pool:
        env.close()


# ---------------------------------------- acting process --------------------------------------------------
# One process acts for all env workers and hands full rollouts to the learner; SharedWeights brings weights.
LOCK_WAIT_S = 10.0  # A copy of the weights is quick: a lock held this long is held by a process that died.


class SharedWeights:
    """The learner's weights and version in shared memory, copied whole under a lock: never half an update."""
    def __init__(self, agent, version):
        self.tensors = {k: v.detach().cpu().clone().share_memory_() for k, v in agent.state_dict().items()}
        self.version, self.lock = torch.tensor([version]).share_memory_(), mp.get_context("spawn").Lock()

    def push(self, agent, version):
        if self.lock.acquire(timeout=LOCK_WAIT_S):  # Else the acting process died holding it.
            torch._foreach_copy_(list(self.tensors.values()), list(agent.state_dict().values()))
            self.version[0] = version
            self.lock.release()

    def pull(self, agent, version) -> int:
        """Newer weights copied into agent (in place: act's CUDA graphs read them there); their version."""
        # A lock not taken in time: the learner is gone, and these weights stay.
        if int(self.version[0]) != version and self.lock.acquire(timeout=LOCK_WAIT_S):
            agent.load_state_dict(self.tensors)
            version = int(self.version[0])
            self.lock.release()
        return version


def act_process(args, buffers, weights, full_rollouts, free_buffers, stop, collected_steps):
    """The acting process: it starts the env workers, acts for their ready slots, hands full rollouts over."""
    torch.set_num_threads(1)  # Small ops: more threads wake in vain (benchmarks/README.md, pipeline_ceiling).
    actor = Actor(args, buffers, weights, full_rollouts, free_buffers, stop, collected_steps)
    conns, workers = start_workers(actor)
    try:  # An exception prints its traceback; the learner, sent an end it did not ask for, stops the run.
        collect(actor, conns)
    finally:
        stop_workers(conns, workers)
        with contextlib.suppress(OSError):  # The learner is gone (kill -9).
            actor.full_rollouts.send(("end", None, actor.episodes, actor.collected_steps))


class Actor:
    """The acting process's state: its slots (half a worker's envs each), their buffers, the policy. Pipes:
    full_rollouts sends the learner (kind, what, episodes, collected steps), free_buffers the reverse."""
    def __init__(self, args, buffers, weights, full_rollouts, free_buffers, stop, collected_steps):
        self.args, self.buffers, self.weights, self.stop = args, buffers, weights, stop
        self.full_rollouts, self.free_buffers = full_rollouts, free_buffers
        self.arrays = {k: v.numpy() for k, v in buffers.items()}  # The same memory: numpy indexes it faster.
        self.collected_steps, self.device = collected_steps, pick_device(args.device)
        self.agent = Agent().to(self.device).eval()
        self.version = weights.pull(self.agent, -1)  # The updates that made the weights in agent.
        num_slots, self.envs_per_slot = 2 * args.num_workers, args.num_envs_per_worker // 2
        self.empty_buffers, self.episodes = [], []  # The episodes: those ended since the last message.
        self.slot_buffer, self.slot_t = list(range(num_slots)), [0] * num_slots
        self.hidden = torch.zeros(num_slots, self.envs_per_slot, self.agent.gru.hidden_size,
                                  device=self.device)
        # Each slot samples its own stream: a seed gives the same actions however the slots are batched.
        self.samplers = [np.random.default_rng(args.seed * 1_000_003 + 7919 * s + self.version)
                         for s in range(num_slots)]


def start_workers(actor):
    """One process per worker, each stepping its envs into the shared buffers on command."""
    args, ctx, conns, workers = actor.args, mp.get_context("spawn"), [], []
    for w in range(args.num_workers):
        parent, child = ctx.Pipe()
        seed = args.seed * 1_000_003 + actor.version  # A resume plays other games than the run's start.
        proc = ctx.Process(target=env_worker, daemon=True, args=(
            w, args.task, seed, args.num_envs_per_worker, actor.buffers, child, args.max_episode_steps))
        proc.start()
        conns.append(parent)
        workers.append(proc)
    for s in range(len(actor.slot_buffer)):  # Every slot resets its envs into its first buffer.
        conns[s // 2].send((s % 2, actor.slot_buffer[s], -1))
    return conns, workers


def collect(actor, conns):  # Until stopped: act for ready slots, hand full rollouts to the learner.
    waiting = []
    while not actor.stop.value:
        ready = waiting + receive(actor, conns)  # Slots that waited for an empty buffer go first.
        # Back-pressure: a full slot waits while no buffer is empty (the learner is behind).
        waiting = [s for s in ready if actor.slot_t[s] == actor.args.rollout and not hand_over(actor, s)]
        acting = [s for s in ready if s not in waiting]
        if acting:
            act(actor, conns, acting)


def receive(actor, conns):
    """The slots whose envs finished a step (the episodes they ended noted); free buffers from the learner."""
    ready, learner = [], multiprocessing.parent_process().sentinel
    signalled = multiprocessing.connection.wait([*conns, actor.free_buffers, learner], timeout=0.1)
    if learner in signalled:
        actor.stop.value = 1  # The learner's process is gone (kill -9): never outlive it.
        return []
    for conn in signalled:
        if conn is actor.free_buffers:
            actor.empty_buffers += actor.free_buffers.recv()
            continue
        w = conns.index(conn)
        while conn.poll():
            try:
                half, episodes = conn.recv()
            except (EOFError, OSError):
                actor.full_rollouts.send(("failure", f"env worker {w} died", [], actor.collected_steps))
                actor.stop.value = 1
                break
            ready.append(2 * w + half)
            first_env = w * actor.args.num_envs_per_worker
            actor.episodes += [(first_env + i, dict(episode, env_steps=actor.collected_steps))
                               for i, episode in episodes]
    return ready


def hand_over(actor, s):
    """Slot s's rollout is full: send it to the learner, go on in an empty buffer (False: none is empty)."""
    if not actor.empty_buffers:
        return False
    new, old, T = actor.empty_buffers.pop(), actor.slot_buffer[s], actor.args.rollout
    actor.hidden[s] = carry_state(actor.hidden[s], actor.buffers["end"][old, T - 1])
    for k in OBS_FIELDS:
        actor.buffers[k][new, 0] = actor.buffers[k][old, T]
    actor.buffers["h0"][new] = actor.hidden[s].cpu()
    actor.full_rollouts.send(("rollout", (old, s), actor.episodes, actor.collected_steps))
    actor.slot_buffer[s], actor.slot_t[s], actor.episodes = new, 0, []
    return True


def act(actor, conns, slots):
    """One batched inference step for these slots, into their buffers at their t; then workers step."""
    arrays, n = actor.arrays, actor.envs_per_slot
    places = [(actor.slot_buffer[s], actor.slot_t[s]) for s in slots]  # A slot's observations are one slice.
    obs = {k: torch.from_numpy(np.concatenate([arrays[k][b, t] for b, t in places])).to(actor.device)
           for k in OBS_FIELDS}
    # At t = 0 the state was carried over at the hand-over; after that, it resets where an episode ended.
    cut = np.concatenate([episode_cut(arrays["end"][b, t - 1]) if t else np.zeros(n, bool)
                          for b, t in places])
    h = torch.cat([actor.hidden[s] for s in slots]) * torch.from_numpy(~cut[:, None]).to(actor.device)
    actor.version = actor.weights.pull(actor.agent, actor.version)  # The newest whole update.
    with torch.no_grad():
        logits, _, h_new = actor.agent.fast_step(obs, h)
        log_probs = torch.log_softmax(logits.float(), dim=-1).cpu().numpy()
    for i, (s, (b, t)) in enumerate(zip(slots, places)):  # Gumbel-max, from each slot's own noise.
        noise = actor.samplers[s].random((n, log_probs.shape[1]), np.float32)
        mine = log_probs[i * n:(i + 1) * n]
        arrays["action"][b, t] = action = (mine - np.log(-np.log(np.maximum(noise, 1e-20)))).argmax(-1)
        arrays["logprob"][b, t], arrays["version"][b, t] = mine[np.arange(n), action], actor.version
        actor.hidden[s] = h_new[i * n:(i + 1) * n]
        with contextlib.suppress(OSError):  # A dead worker: receive() finds its pipe closed, stops the run.
            conns[s // 2].send((s % 2, b, t))
        actor.slot_t[s] = t + 1
    actor.collected_steps += len(slots) * n


def stop_workers(conns, workers):
    for conn in conns:
        with contextlib.suppress(OSError):  # A dead worker's pipe is broken.
            conn.send(None)
    for proc in workers:
        proc.join(timeout=5)
        proc.kill()  # If still alive (a no-op for one that ended); it ignores SIGTERM (start_acting).


# ---------------------------------------- learner ---------------------------------------------------------
# This process: full rollouts -> rewards -> APPO updates -> weights; the last section checkpoints and logs.
TORCH_THREADS = torch.get_num_threads()  # The learner's, read before any thread changes the default.


def train(args):
    """A run: the learner's side, the acting process, learning to --total-env-steps or a stop, the summary."""
    run = set_up(args)
    start_acting(run)
    run.tally.start_time = run.tally.last_log = run.tally.last_checkpoint = time.time()
    print(f"training {args.task} with reward {args.reward_type}: {args.num_workers} workers x "
          f"{args.num_envs_per_worker} envs on {run.device}; run dir {args.run_dir}", flush=True)
    try:
        learn(run)
    except SystemExit as error:  # A fatal LLM error: finish() saves the run and says it.
        run.failure = str(error).removeprefix("error: ")
    finally:
        end_acting(run)
        if run.client is not None:
            run.client.close()
        run.intrinsic.close()
    try:
        return finish(run)
    finally:
        run.lock.close()  # The run dir is free for the next learner, in this process too.


@dataclass
class Tally:
    """What the learner counts of a run and logs, and the totals it resumed from (each field says which)."""
    counters: dict  # collected_steps (ahead of learned_steps(run)), updates (the policy version), episodes.
    saved_totals: dict  # The run's totals at the checkpoint it resumed from; run_totals adds this session's.
    sessions: list  # The run_record() of each session, this one last.
    pending: list  # Per env, the episodes the workers finished; joined with the next list in the log.
    finished: list  # Per env, the learner's intrinsic totals of them.
    intrinsic_totals: np.ndarray  # Per env, the intrinsic sums of its episode in progress.
    start_steps: int  # This session's first step: a resume collects again from the steps learned.
    updates: collections.deque = field(default_factory=collections.deque)  # Figures of each update, to log.
    losses: dict = field(default_factory=dict)
    sums: collections.Counter = field(default_factory=collections.Counter)  # This session's, for the totals.
    start_time: float = field(default_factory=time.time)  # Set again once the acting process runs.
    last_log: float = field(default_factory=time.time)
    last_checkpoint: float = field(default_factory=time.time)


@dataclass
class Run:
    """The learner's side of a run, this process. It shares the rollout buffers, the weights, the stop flag
    and two pipes (full rollouts in, free buffers out) with the acting process: each has a GIL of its own."""
    args: Args
    device: torch.device
    agent: Agent
    optimizer: torch.optim.Optimizer
    intrinsic: reward_models.IntrinsicReward
    client: annotator.LabelClient | None  # The annotator's: label requests go out, labels come in.
    writer: object  # Tensorboard's SummaryWriter; wandb syncs from it with --track.
    buffers: dict  # The rollout buffers (make_buffers): enough for the slots in flight and one batch.
    weights: SharedWeights
    envs_per_slot: int
    buffers_per_batch: int
    tally: Tally
    lock: object  # The run dir's lock file, held open while this learner runs (hold).
    acting: object = None  # The acting process, and the learner's ends of its two pipes (start_acting).
    full_rollouts: object = None
    free_buffers: object = None
    failure: str | None = None  # A fatal LLM error, a dead env worker or acting process: saved, then said.
    ended: bool = False  # Nothing more comes from the acting process: its "end" was read, or its pipe closed.
    stop: object = field(default_factory=lambda: mp.get_context("spawn").RawValue("b", 0))
    stopped_by: int = 0  # The signal that stopped the run (Ctrl-C, SIGTERM), if one did: the exit code tells.


def set_up(args) -> Run:
    """The learner's side of a run (on a resume, from the checkpoint), its label client, trainer started."""
    lock = hold(args.run_dir)
    sessions = [run_record(args)]
    print(f"run record: {json.dumps(sessions[0])}", flush=True)  # First, so that a console.log opens with it.
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    agent = Agent().to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    counters, saved_totals = {"collected_steps": 0, "updates": 0, "episodes": 0}, {}
    intrinsic = reward_models.IntrinsicReward(args, device)
    if args.resume:
        checkpoint = restore(args, agent, optimizer, intrinsic, counters)
        saved_totals, sessions = checkpoint.get("totals", {}), checkpoint.get("sessions", []) + sessions
    client = annotator.LabelClient(args) if args.reward_type in reward_models.NEEDS_LLM else None
    writer = make_writer(args)
    if client is not None:  # The annotator subprocess and, without --llm-url, the embedded server.
        client.start(args.run_dir, known=intrinsic.known_keys(), asks=intrinsic.piece.asks)
    intrinsic.start(args.reward_model_share)
    envs_per_slot = args.num_envs_per_worker // 2  # A slot is one half of a worker's envs, stepped together.
    buffers_per_batch = args.batch_size // (args.rollout * envs_per_slot)
    # The slots in flight and one batch, which fills while the learner learns; more would only add policy lag.
    buffers = make_buffers(2 * args.num_workers + buffers_per_batch, args.rollout, envs_per_slot)
    num_envs = args.num_workers * args.num_envs_per_worker
    pending, finished = ([collections.deque() for _ in range(num_envs)] for _ in range(2))
    tally = Tally(counters=counters, saved_totals=saved_totals, sessions=sessions, pending=pending,
                  finished=finished, intrinsic_totals=np.zeros((num_envs, 3)),
                  start_steps=counters["collected_steps"])
    return Run(args=args, device=device, agent=agent, optimizer=optimizer, intrinsic=intrinsic, client=client,
               writer=writer, buffers=buffers, weights=SharedWeights(agent, counters["updates"]),
               envs_per_slot=envs_per_slot, buffers_per_batch=buffers_per_batch, tally=tally, lock=lock)


def start_acting(run):
    """Starts the acting process deaf to Ctrl-C and SIGTERM (sent to the group): the stop flag stops it."""
    run.full_rollouts, full_rollouts_out = mp.Pipe(duplex=False)
    free_buffers_in, run.free_buffers = mp.Pipe(duplex=False)
    # Slot s starts in buffer s: the rest are free.
    run.free_buffers.send(list(range(2 * run.args.num_workers, len(run.buffers["h0"]))))
    run.acting = mp.get_context("spawn").Process(target=act_process, args=(  # No daemon: it starts workers.
        run.args, run.buffers, run.weights, full_rollouts_out, free_buffers_in, run.stop,
        run.tally.counters["collected_steps"]))
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)  # Inherited at the spawn: no child dies mid-import either.
    run.acting.start()
    full_rollouts_out.close()  # The acting process's end alone now: the pipe closes when it dies.

    def request_stop(signum, frame):  # Again: the stop is under way, and it ends with the checkpoint saved.
        again = "still " * bool(run.stop.value)
        print(f"\nsignal {signum}: {again}stopping, saving a checkpoint", flush=True)
        run.stop.value, run.stopped_by = 1, run.stopped_by or signum
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)


def learn(run):
    """Batch by batch: rewards, an APPO update, weights out, labels in; logs, checkpoints between updates."""
    torch.set_num_threads(TORCH_THREADS)  # The reward model's trainer thread sets its own: not this thread's.
    while (rollouts := next_batch(run)) is not None:
        batch, step_message, env_ids, lag = take_batch(run, rollouts)
        started = time.perf_counter()  # rewards = c_ext * clip(env reward) + c_int * paid; paid = R / N^beta.
        rewards, paid, reward_stats = run.intrinsic.rewards(
            batch["reward"], step_message, batch["step_count"], batch["end"] == End.TERMINATED)
        rewarded = time.perf_counter()
        losses = update_policy(run, batch, rewards)
        if run.client is not None:  # Labels come in, to pay from the next batch; what to ask goes out.
            run.intrinsic.exchange(run.client, stopping=run.stop.value)
        note_update(run, batch, paid, env_ids, lag, reward_stats, losses, (started, rewarded))
        log_and_save(run)


def next_batch(run):
    """The (buffer, slot) of the next buffers_per_batch full rollouts; None once stopped or all learned."""
    rollouts = []
    while len(rollouts) < run.buffers_per_batch:
        if run.stop.value or learned_steps(run) >= run.args.total_env_steps:
            return None
        if (message := next_message(run, 0.5))[0] == "rollout":
            rollouts.append(message[1])
    return rollouts


def next_message(run, timeout):
    """The acting process's next message (kind, what) or (None, None); steps, episodes noted."""
    if not run.full_rollouts.poll(timeout):
        return None, None
    try:
        kind, what, episodes, run.tally.counters["collected_steps"] = run.full_rollouts.recv()
    except (EOFError, OSError):  # The pipe closed before an "end": it died (kill -9, OOM), mid-message.
        run.ended, run.failure, run.stop.value = True, run.failure or "the acting process died", 1
        return None, None
    run.ended |= kind == "end"
    for env, episode in episodes:
        run.tally.pending[env].append(episode)
    run.tally.counters["episodes"] += len(episodes)
    if kind == "failure" or (kind == "end" and not run.stop.value):  # An end not asked for: an exception.
        run.failure = run.failure or what or "the acting process failed (its traceback is above)"
        run.stop.value = 1
    return kind, what


def take_batch(run, rollouts):
    """Copies the rollouts out of their buffers ([buffer, t, env] -> [t, buffer * env]) and frees them."""
    ids = [b for b, _ in rollouts]  # One slice of a buffer each: stacked, quicker than a gather.
    data = {k: torch.stack([v[b] for b in ids], 1).flatten(1, 2)
            for k, v in run.buffers.items() if k not in ("h0", "version")}
    batch = {k: data[k].to(run.device) for k in ("action", "logprob", "end", "reward", "step_count")}
    batch["obs"] = {k: data[k].to(run.device) for k in OBS_FIELDS}
    batch["h0"] = run.buffers["h0"][ids].flatten(0, 1).to(run.device)
    env_ids = np.concatenate([s * run.envs_per_slot + np.arange(run.envs_per_slot) for _, s in rollouts])
    lag = run.tally.counters["updates"] - run.buffers["version"][ids].float()
    with contextlib.suppress(OSError):  # A dead acting process closed the pipe: next_message will say so.
        run.free_buffers.send(ids)
    return batch, data["step_message"], env_ids, lag  # The messages stay on the CPU, for np.unique.


def update_policy(run, batch, rewards):
    loss, losses = appo_loss(run.agent, batch, rewards, run.args)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    losses["grad_norm"] = nn.utils.clip_grad_norm_(run.agent.parameters(), run.args.max_grad_norm).item()
    run.optimizer.step()
    run.tally.counters["updates"] += 1
    run.weights.push(run.agent, run.tally.counters["updates"])
    return losses


def learned_steps(run) -> int:
    """Env steps learned from: what checkpoints, summary.json and --total-env-steps count."""
    return run.tally.counters["updates"] * run.args.batch_size


def end_acting(run):
    """Stops the acting process; its last message brings the steps and episodes of its last moments."""
    run.stop.value, deadline = 1, time.time() + 60
    while not run.ended and time.time() < deadline:
        next_message(run, 0.1)
    run.acting.join(timeout=10)
    run.acting.kill()  # It is wedged; a no-op for one that ended.


# ---------------------------------------- checkpoints and logs --------------------------------------------
# What the learner logs, checkpoints and reads back (run_files.py keeps the files whole); finish comes last.
LLM_COUNTS = ("requests", "labels", "failures", "parse_failures", "dropped", "restarts")  # Summed in totals.
PAY_WEIGHTS = ("pay_weight", "pay_weight_judged", "pay_weight_new")  # Of the rewards' statistics, summed too.
CHECKPOINT_DICTS = ("model", "args", "counters")  # The dicts every checkpoint of oni_appo.py holds.
CHECKPOINT_FORMAT = 1  # The layout of what save() writes: a change to it is a new number.


def note_update(run, batch, paid, env_ids, lag, reward_stats, losses, times):
    """An update's figures: each env's intrinsic sums, the session's sums (per step, not batch), the log's."""
    tally, terminal = run.tally, batch["end"] == End.TERMINATED
    add_intrinsic_episodes(tally.intrinsic_totals, tally.finished, paid, batch["end"], env_ids)
    tally.sums.update(lag_sum=lag.sum().item(), lag_steps=lag.numel(), terminal_steps=terminal.sum().item(),
                      terminal_paid=paid[terminal].sum().item(),
                      **{k: reward_stats.pop(k) for k in PAY_WEIGHTS})
    tally.sums["max_reward"] = max(tally.sums.get("max_reward", -math.inf), paid.max().item())
    tally.losses = dict(losses, **run.intrinsic.train_stats(), time_intrinsic_s=times[1] - times[0],
                        time_policy_s=time.perf_counter() - times[1])
    tally.updates.append(dict(reward_stats, lag_mean=lag.mean().item(), lag_max=lag.max().item()))


def log_and_save(run):  # Every 5 s a log, every --checkpoint-every-s a checkpoint.
    if (now := time.time()) - run.tally.last_log > 5:
        log_progress(run, join_episodes(run.tally.pending, run.tally.finished), now)
        run.tally.last_log = now
    if now - run.tally.last_checkpoint > run.args.checkpoint_every_s:
        save(run)
        run.tally.last_checkpoint = now


def add_intrinsic_episodes(totals, finished, paid, end, env_ids):
    """paid (R / N^beta), end: [T, B]: rollouts side by side, each env's in time order (one env may have two);
    env_ids: [B]. Sums each env's episode in totals [envs, 3]; its return, rewarded share go to finished."""
    order = np.argsort(env_ids, kind="stable")  # One run of steps per env, in time order: a segmented sum.
    paid = paid.cpu().numpy()[:, order].T.ravel().astype(np.float64)
    end = end.cpu().numpy()[:, order].T.ravel()
    env = np.repeat(env_ids[order], len(end) // len(order))
    steps = np.stack([paid, paid != 0, np.ones_like(paid)], 1) * (end != End.RESET)[:, None]
    first, last = np.r_[True, env[1:] != env[:-1]], np.r_[env[1:] != env[:-1], True]
    steps[first] += totals[env[first]] * (end[first] != End.RESET)[:, None]  # Episodes in progress go on.
    done = (end == End.TERMINATED) | (end == End.TRUNCATED)
    starts = np.flatnonzero(first | (end == End.RESET) | np.r_[False, done[:-1]])  # Resets drop episodes.
    sums, ends = np.add.reduceat(steps, starts), np.r_[starts[1:], len(end)] - 1
    totals[env[first]], going_on = 0.0, last[ends] & ~done[ends]
    totals[env[ends[going_on]]] = sums[going_on]
    for i, (total, rewarded, n) in zip(ends[done[ends]], sums[done[ends]]):
        finished[env[i]].append({"intrinsic_return": total, "intrinsic_rewarded_fraction": rewarded / n})


def join_episodes(pending, finished, final=False):
    """Workers' episodes joined with the learner's intrinsic totals (per env, both in order); final: all."""
    out = []
    for worker_episodes, learner_episodes in zip(pending, finished):
        while worker_episodes and (learner_episodes or final):
            intrinsic = learner_episodes.popleft() if learner_episodes else {}
            out.append({**worker_episodes.popleft(), **intrinsic})
    return sorted(out, key=lambda e: e["env_steps"])


def make_writer(args):  # Tensorboard's, in the run dir; with --track, wandb syncs from it.
    from torch.utils.tensorboard import SummaryWriter
    if args.track:
        try:
            import wandb
        except ImportError:
            fail("--track needs wandb: pip install wandb")
        wandb.init(project=args.wandb_project, config=dataclasses.asdict(args), sync_tensorboard=True,
                   name=os.path.basename(args.run_dir), dir=args.run_dir, resume="allow")
    writer = SummaryWriter(args.run_dir)
    writer.add_text("args", "\n".join(f"{k}: {v}" for k, v in dataclasses.asdict(args).items()))
    return writer


def log_progress(run, episodes, now):
    """Tensorboard's figures at the collected steps, episodes.jsonl and a line on the console."""
    steps, writer = run.tally.counters["collected_steps"], run.writer
    sps = (steps - run.tally.start_steps) / (now - run.tally.start_time)
    window = [run.tally.updates.popleft() for _ in range(len(run.tally.updates))]  # Since the last log.
    figures = {k: [u[k] for u in window if k in u] for k in {k for u in window for k in u}}
    figures = {k: max(v) if k.endswith("max") or k.startswith("max") else float(np.mean(v))
               for k, v in figures.items()}
    lag_mean, lag_max = figures.pop("lag_mean", 0.0), int(figures.pop("lag_max", 0))
    llm = run.client.stats() if run.client is not None else {}
    if llm:  # The whole run's counts, as in summary.json (new: after close(), stats() returns its own).
        llm = {**llm, **{k.removeprefix("llm_"): v for k, v in run_totals(run, llm).items()
                         if k.startswith("llm_")}}
    charts = {"SPS": sps, "policy_lag_mean": lag_mean, "policy_lag_max": lag_max,
              "updates": run.tally.counters["updates"]}
    for prefix, values in (("charts", charts), ("losses", run.tally.losses), ("intrinsic", figures),
                           ("llm", llm)):
        add_scalars(writer, prefix, values, steps)
    for e in episodes:
        add_scalars(writer, "charts", {"episodic_return": e["return"], "episodic_length": e["steps"]}, steps)
        add_scalars(writer, "episode", {k: v for k, v in e.items() if k != "env_steps"}, steps)
    if episodes:
        with open(os.path.join(run.args.run_dir, "episodes.jsonl"), "a") as f:
            f.writelines(json.dumps(e) + "\n" for e in episodes)
    mean_return = f"{np.mean([e['return'] for e in episodes]):8.2f}" if episodes else "     n/a"
    labels = (f" | llm labels {llm.get('labels', 0):,} fail {llm.get('failures', 0):,} "
              f"backlog {llm.get('backlog', 0):,}") if llm else ""
    print(f"steps {steps:>13,} | {sps:8,.0f} steps/s | episodes {run.tally.counters['episodes']:>7,} | "
          f"return {mean_return} | lag {lag_mean:4.1f}/{lag_max:<3d} | "
          f"updates {run.tally.counters['updates']:,}{labels}", flush=True)


def add_scalars(writer, prefix, values, step):
    for k, v in values.items():
        if isinstance(v, (int, float)):  # Not the annotator's "fatal" line: that one ends the run.
            writer.add_scalar(f"{prefix}/{k}", v, step)


def save(run):  # The checkpoint at the steps learned (a resume collects again the rest); returns the totals.
    totals = run_totals(run, run.client.stats() if run.client is not None else {})
    counters = dict(learned_steps=learned_steps(run), updates=run.tally.counters["updates"],
                    episodes=run.tally.counters["episodes"])
    state = dict(format=CHECKPOINT_FORMAT, model=run.agent.state_dict(), optimizer=run.optimizer.state_dict(),
                 counters=counters, args=dataclasses.asdict(run.args), intrinsic=run.intrinsic.state_dict(),
                 totals=totals, sessions=run.tally.sessions)
    write_checkpoint(state, os.path.join(run.args.run_dir, "checkpoint.pt"))
    return totals


def run_totals(run, llm) -> dict:
    """The run's sums: the checkpoint's plus this session's (learner sums, time, steps learned, LLM's)."""
    session = dict(run.tally.sums, wall_time_s=time.time() - run.tally.start_time,
                   learned_steps=learned_steps(run) - run.tally.start_steps,
                   **{f"llm_{k}": llm.get(k, 0) for k in LLM_COUNTS})
    totals = {k: run.tally.saved_totals.get(k, 0) + session.get(k, 0)
              for k in {*run.tally.saved_totals, *session} - {"max_reward"}}
    totals["max_reward"] = max(run.tally.saved_totals.get("max_reward", -math.inf),
                               run.tally.sums.get("max_reward", -math.inf))
    return totals


def load_checkpoint(path, agent=None):
    """(file, checkpoint, Args) of a checkpoint or run dir of this format, the policy into agent."""
    path = os.path.join(path, "checkpoint.pt") if os.path.isdir(path) else path
    if not os.path.isfile(path):
        fail(f"no checkpoint at {path}")
    checkpoint = read_checkpoint(path)
    ours = isinstance(checkpoint, dict) and all(isinstance(checkpoint.get(k), dict) for k in CHECKPOINT_DICTS)
    if not ours:
        fail(f"{path} is not a checkpoint of oni_appo.py")
    if checkpoint.get("format") != CHECKPOINT_FORMAT:
        fail(f"{path} is a checkpoint of format {checkpoint.get('format', 'none')}; this code reads format "
             f"{CHECKPOINT_FORMAT}: use the commit that wrote it (its summary.json's sessions name it)")
    known = {f.name for f in dataclasses.fields(Args)}  # A flag this code does not know is dropped.
    saved = Args(**{k: v for k, v in checkpoint["args"].items() if k in known})
    try:
        if agent is not None:
            agent.load_state_dict(checkpoint["model"])
    except RuntimeError as error:
        fail(f"checkpoint {path} does not match this policy: {str(error).splitlines()[1].strip()}")
    return path, checkpoint, saved


def restore(args, agent, optimizer, intrinsic, counters):
    """Loads args.resume's checkpoint (policy, optimizer, reward, counters), the run's episodes and labels."""
    _, checkpoint, _ = load_checkpoint(args.resume, agent)
    optimizer.load_state_dict(checkpoint["optimizer"])
    saved = checkpoint["counters"]
    steps = saved["learned_steps"]  # Collection restarts at the steps learned.
    counters.update(collected_steps=steps, updates=saved["updates"], episodes=saved["episodes"])
    episodes, kept = os.path.join(args.run_dir, "episodes.jsonl"), []
    if os.path.exists(episodes):  # The steps after the checkpoint are played again, their episodes too.
        with open(episodes, errors="replace") as f:
            lines = f.read().split("\n")
        for n, line in enumerate(lines[:-1], 1):  # The last is empty, or a write a crash cut short.
            try:
                if line.strip() and json.loads(line)["env_steps"] <= steps:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError, RecursionError) as error:
                fail(f"{episodes} line {n} is not an episode record ({type(error).__name__}: {error}): "
                     "mend or remove it, then --resume again")
        rewrite(episodes, kept)
        counters["episodes"] = len(kept)
    labels = os.path.join(args.run_dir, annotator.LABELS_FILE)
    if os.path.exists(labels):  # The labels so far come back from the run's file, not asked for again.
        intrinsic.add_labels(records := annotator.read_labels(labels))
        rewrite(labels, [json.dumps(r) + "\n" for r in records])  # Whole lines: the annotator appends.
    intrinsic.load_state_dict(checkpoint.get("intrinsic", {}))
    print(f"resumed from {args.resume} at {steps:,} env steps")
    return checkpoint


def run_record(args) -> dict:
    """What made this session: its code, flags and, for an LLM's reward, the demonstrations and servers."""
    commit, dirty = git_state()
    record = {"started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "commit": commit,
              "uncommitted_changes": dirty, "flags": dataclasses.asdict(args)}
    if args.reward_type in reward_models.NEEDS_LLM:
        record.update(demonstrations=annotator.demos_record(args.demos),
                      llm={"urls": args.llm_url or "embedded", "model": args.llm_model or "the first listed"})
    return record


def finish(run):
    """The last log, checkpoint, messages.tsv and summary.json; a stop for a failure is a one-line error."""
    args, counters = run.args, run.tally.counters
    log_progress(run, join_episodes(run.tally.pending, run.tally.finished, final=True), time.time())
    llm = run.client.stats() if run.client is not None else {}
    if llm.get("model"):  # The model the server answered as, and where the embedded one was.
        run.tally.sessions[-1]["llm"].update(urls=run.client.urls, model=llm["model"])
    totals = save(run)  # Last, the client closed: final totals, and sessions' times sum to the run's.
    run.intrinsic.write_messages(os.path.join(args.run_dir, "messages.tsv"))
    elapsed = totals["wall_time_s"] - run.tally.saved_totals.get("wall_time_s", 0.0)
    # The whole run's figures count the steps learned; the session_ ones this session's steps collected.
    summary = {"env_steps": learned_steps(run), "updates": counters["updates"],
               "episodes": counters["episodes"], "sps": totals["learned_steps"] / totals["wall_time_s"],
               "wall_time_s": totals["wall_time_s"],
               "session_sps": (counters["collected_steps"] - run.tally.start_steps) / elapsed,
               "session_wall_time_s": elapsed,
               "policy_lag_mean": totals.get("lag_sum", 0.0) / max(totals.get("lag_steps", 0), 1),
               "intrinsic_max_reward": totals["max_reward"] if totals["max_reward"] > -math.inf else None,
               "intrinsic_terminal_step_reward": totals["terminal_paid"] / totals["terminal_steps"]
               if totals.get("terminal_steps") else None,
               # The pay weight (sum of 1/N^beta over steps with a message) paid with the LLM's judgement of
               # the message in hand, and that of messages in the batch that first showed them (no label yet).
               **{f"{name}_pay_share": totals.get(key, 0) / max(totals.get("pay_weight", 0), 1e-9)
                  for name, key in (("judged", "pay_weight_judged"), ("first_seen", "pay_weight_new"))},
               # A reward model's trainer: its steps in the run, and this session's busy share of wall time
               # and publications (on a CPU it shares the learner's cores: where ONI's speed goes besides
               # the labeler; each publication scores the reference or the gate's labels anew).
               **{("" if key.endswith("steps") else "session_") + key: value
                  for key, value in run.intrinsic.train_stats().items() if key in (
                      "reward_model_steps", "reward_model_time_share", "reward_model_publications")}}
    path = os.path.join(args.run_dir, "episodes.jsonl")  # All the run's episodes, resumed runs included.
    episodes = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    summary["mean_episode_return"] = float(np.mean([e["return"] for e in episodes])) if episodes else None
    numbers = {k for e in episodes for k, v in e.items() if not isinstance(v, str)} - {"return", "env_steps"}
    for k in sorted(numbers):
        summary[f"mean_{k}"] = float(np.mean([e[k] for e in episodes if k in e]))
    summary["ends"] = dict(collections.Counter(e["end"] for e in episodes if "end" in e))  # How they ended.
    labels = os.path.join(args.run_dir, annotator.LABELS_FILE)  # A kill -9 loses the annotator's own counts.
    summary.update({"llm_labels": len(annotator.read_labels(labels)) if os.path.exists(labels) else 0,
                    "llm_failures": totals["llm_failures"],
                    "llm_parse_failures": totals["llm_parse_failures"],
                    "annotator_restarts": totals["llm_restarts"],
                    "llm_answers_restricted": llm.get("answers_restricted"),
                    "llm_answers_scored": llm.get("answers_scored"), "stopped_by": run.stopped_by,
                    "sessions": run.tally.sessions})
    rewrite(os.path.join(args.run_dir, "summary.json"), [json.dumps(summary, indent=1)])  # Drivers read it.
    run.writer.close()
    if run.failure:
        fail(f"{run.failure}; checkpoint saved, continue with --resume {args.run_dir}")
    print(f"done: {summary['env_steps']:,} env steps, {summary['session_sps']:,.0f} steps/s; "
          f"{args.run_dir}/summary.json", flush=True)
    return summary


def main():
    """The command: one `error:` line for what the run could not write (what it saved stays whole), and the
    exit code of the signal that stopped it (130 for Ctrl-C), so that a script tells a stop from an end."""
    try:
        summary = train(parse_args())
    except OSError as error:  # A full disk, a read-only one; without a file, a pipe to a process that died.
        fail(f"cannot write {error.filename}: {error.strerror}" if error.filename else f"{error!r}")
    sys.exit(128 + summary["stopped_by"] if summary.get("stopped_by") else 0)


if __name__ == "__main__":
    main()
