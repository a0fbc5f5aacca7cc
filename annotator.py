"""The annotator: a subprocess that asks OpenAI-compatible LLM servers about the agent's messages.

Captions (with the pay weight each has accrued unlabelled) and pairs come from the learner on a queue into a
bounded backlog, asked most worth first; each answer goes to `labels.jsonl` and to a LabelTable in a
`multiprocessing.Manager`, which the learner reads in bulk. A server that is down, slow or dies never blocks
training; an error that retrying cannot fix stops the run."""
import collections
import concurrent.futures
import contextlib
import gzip
import hashlib
import heapq
import itertools
import json
import multiprocessing.managers
import os
import queue
import re
import secrets
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib

import llm_server

LABELS_FILE, MAX_BACKLOG = "labels.jsonl", 10_000  # The run's answers; the most items waiting to be asked.
URL_CONCURRENCY = 64  # Requests in flight to --llm-url servers: vLLM batches concurrent requests itself.
EMBEDDED_CONCURRENCY = 1  # llama.cpp answers one at a time and caches one prompt, which a bisection reuses.
TIMEOUT_S, MAX_BACKOFF_S = 60.0, 30.0  # A request's limit; the longest pause of a server that keeps failing.
TOKENIZE_BACKOFF_S = (0.5, 1.0, 2.0)  # Start-up retries of the server's tokenize endpoint.
CHECK_EVERY_S, MAX_RESTARTS = 5.0, 5  # How often LabelClient.check() reads the stats; restarts allowed.
UNKNOWN_RETRY_S = 60.0  # A caption answered with no label is asked again after this, if sent again.
EMBEDDED_SHARE = 0.4  # The embedded server's most CPU time over wall time (of 2 cores, a fifth of the box).
MAX_CREDIT_S = 5.0  # An idle labeler saves up at most this much of its share for a burst.
UNPARSEABLE = object()

# --- Prompts: chat ones let an instruct model reason first (the paper's); completion ones show examples.
GOAL = "maximize the score: kill monsters, collect gold, go down the stairs, gain experience levels"
PROMPTS = {
    "label_system": "You are a fair and knowledgeable judge of progress in the game NetHack.",
    "label_user": (
        "A player's goal in NetHack is to {goal}. During play the game showed this message:\n\"{caption}\"\n"
        "First recall what you know about NetHack that bears on this message, then judge in one sentence "
        "whether the event it reports is a clear step towards the goal. Messages about killing monsters, "
        "finding gold or items, descending, or levelling up are helpful; neutral, routine, unlucky or "
        "harmful events are not. End with <label>FOO</label> if the message is very helpful for progress, "
        "or <label>BAR</label> if it is not."),
    "pair_system": "You are a fair and knowledgeable judge of progress in the game NetHack.",
    "pair_user": (
        "A player's goal in NetHack is to {goal}. Here are two messages the game showed:\ndescription 1: "
        "\"{first}\"\ndescription 2: \"{second}\"\nThink about what each tells about the player's progress, "
        "using your knowledge of NetHack. Then answer with exactly one of (\"best_description\": 1), "
        "(\"best_description\": 2) or (\"best_description\": None) if neither is better."),
    "label_completion": ("NetHack messages, and whether each one reports progress (killing monsters, gold, "
                         "descending, levelling up, finding things):\n"
                         "{examples}Message: {caption}\nProgress:"),
}
# A base model copies the labels of similar messages far better than it applies a stated goal: a prompt shows
# the DEMOS_PER_LABEL nearest messages of each label (by trigrams) in a pool, by default label_sets.tsv's dev.
DEMOS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "label_sets.tsv")
DEMOS_PER_LABEL = 4  # At 2 a label, even kills scored too low.
# Helpful when Labeler.score > THRESHOLD, chosen by `label_quality.py --calibrate` (benchmarks/README.md).
THRESHOLD, TIE_MARGIN = 0.80, 0.5  # For pairs, see preference().
SCORE_SPAN, BISECTIONS = 8.0, 6  # A score without log-probabilities: to 8 / 2^6, clamped 8 from THRESHOLD.
LABEL_TAG = re.compile(r"<label>\s*(FOO|BAR)\s*</label>", re.IGNORECASE)
PREFERENCE = re.compile(r"best_description\"?\s*:\s*\"?(1|2|None)", re.IGNORECASE)


def preference(first: float, second: float):
    """1 or 2, the pair's message with the better score, or None, a tie. Scores on one side of THRESHOLD tie,
    as the labeler calls both alike (a gap between unhelpful ones taught the ranking model to pay "It's a
    wall." above the rest); so do scores closer than TIE_MARGIN, hardly told apart."""
    if (first > THRESHOLD) == (second > THRESHOLD) or abs(first - second) < TIE_MARGIN:
        return None
    return 1 if first > second else 2


def parse_label(text: str):  # 1 (FOO) or 0 (BAR) from a chat answer's last <label> tag, else UNPARSEABLE.
    tags = LABEL_TAG.findall(text or "")
    return (1 if tags[-1].upper() == "FOO" else 0) if tags else UNPARSEABLE


def parse_preference(text: str):  # 1, 2 or None from the last best_description: a reply may restate it.
    answers = PREFERENCE.findall(text or "")
    return UNPARSEABLE if not answers else None if answers[-1].lower() == "none" else int(answers[-1])


def parse_choice(text: str, options: dict):  # A one-token answer; options: lower-case answer -> value.
    return options.get((text or "").strip().lower(), UNPARSEABLE)


def as_asked(text: str) -> str:  # One space between words, as in the pool: NetHack's padding moves a score.
    return " ".join(text.split())


def trigrams(text: str) -> collections.Counter:
    text = f"  {text.lower()} "
    return collections.Counter(text[i:i + 3] for i in range(len(text) - 2))


def load_demos(path=None) -> list:
    """The demonstration pool, (message, label, its trigrams): the dev rows of a label_sets.tsv-style file (a
    header naming the tab-separated `message` and `label`; all rows if no `split`), or a run's labels.jsonl,
    e.g. an 8B model's labels for the laptop labeler to copy. A message's last label counts. Raises Fatal."""
    path = path or DEMOS_FILE
    try:
        if path.endswith((".jsonl", ".jsonl.gz")):  # As a resume reads it: a last line cut short is skipped.
            pairs = [(r["caption"], r["label"]) for r in read_labels(path) if r.get("label") is not None]
        else:
            with open(path) as f:
                rows = [(n, line.rstrip("\n").split("\t")) for n, line in enumerate(f, 1) if line.strip()]
            pairs, header = [], rows.pop(0)[1] if rows else []
            if not {"message", "label"} <= set(header):
                raise ValueError("its first line must name the tab-separated columns message and label")
            for n, row in rows:  # A bad row is an error that names its line and what is wrong with it.
                field, where = dict(zip(header, row)), f"{path} line {n}"
                if missing := {"message", "label", "split"} & set(header) - set(field):
                    raise Fatal(f"the demonstrations {where} has no {' or '.join(sorted(missing))} column")
                if field.get("split", "dev") == "dev":
                    if field["label"].strip() not in ("0", "1"):
                        raise Fatal(f"the demonstrations {where}: label {field['label']!r} is not 0 or 1")
                    pairs.append((field["message"], int(field["label"])))
    except (OSError, ValueError, KeyError) as error:
        raise Fatal(f"cannot read the demonstrations {path}: {type(error).__name__}: {error}") from None
    pool = {as_asked(message): label for message, label in pairs}
    if set(pool.values()) != {0, 1}:
        only = "none" if not pool else f"all labelled {next(iter(pool.values()))}"
        raise Fatal(f"the demonstrations {path} hold {len(pool)} labelled messages, {only}: "
                    "a pool needs both labels, 0 and 1")
    return [(message, int(label), trigrams(message)) for message, label in pool.items()]


def similarity(grams: collections.Counter, demo) -> float:  # The cosine of trigram counts with a pool entry.
    norm = (sum(n * n for n in grams.values()) * sum(n * n for n in demo[2].values())) ** 0.5
    return sum(n * demo[2][g] for g, n in grams.items()) / (norm or 1.0)


def demos_record(path=None) -> dict:  # The pool's file and sha256 (None: unreadable), for the run record.
    path = path or DEMOS_FILE
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return {"file": path, "sha256": hashlib.sha256(f.read()).hexdigest()}
    return {"file": path, "sha256": None}


def demonstrations(caption: str, pool: list, per_label=None) -> str:
    """Each label's per_label `pool` messages nearest `caption`, nearest last: small models copy the last."""
    per_label, grams = per_label or DEMOS_PER_LABEL, trigrams(caption)  # Read now: label_quality sets it.
    near = {id(d): similarity(grams, d) for d in pool}
    nearest = [d for label in (1, 0)
               for d in sorted((d for d in pool if d[1] == label), key=lambda d: near[id(d)])[-per_label:]]
    return "".join(f"Message: {m}\nProgress: {'Yes' if label else 'No'}\n" for m, label, _ in
                   sorted(nearest, key=lambda d: near[id(d)]))


def item_key(item) -> str:  # The LabelTable's key of a caption (itself) or of a (first, second) pair.
    return json.dumps(list(item)) if isinstance(item, tuple) else item


def valid_record(r) -> bool:
    """A labels.jsonl line: {"caption": str, "label": 1|0|null} or {"pair": [a, b], "preference": 1|2|null},
    the pair's with the "scores" [a's, b's] and their "scorer" (Labeler.scorer) where a base model's scores
    answered it."""
    if isinstance(r, dict) and "pair" in r:
        scores = r.get("scores", [0.0, 0.0])
        return (isinstance(r["pair"], list) and len(r["pair"]) == 2
                and all(isinstance(m, str) for m in r["pair"]) and r.get("preference", 0) in (1, 2, None)
                and isinstance(scores, list) and len(scores) == 2 and isinstance(r.get("scorer", ""), str)
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in scores))
    return isinstance(r, dict) and isinstance(r.get("caption"), str) and r.get("label", 2) in (0, 1, None)


def read_labels(path: str) -> list[dict]:  # A labels.jsonl, or the gzipped copy results/ keeps (.gz).
    try:
        with gzip.open(path, "rt") if os.fspath(path).endswith(".gz") else open(path) as f:
            lines = f.read().split("\n")
    except (OSError, ValueError, EOFError, zlib.error) as error:  # The last two: a .gz cut or damaged.
        raise SystemExit(f"error: cannot read labels from {path}: {error}")
    records = []
    for n, line in enumerate(lines, 1):
        try:
            records += [(n, json.loads(line))] if line.strip() else []
        except (ValueError, RecursionError) as error:  # The file's line: json's line and column are its own.
            if n == len(lines):  # A last line with no newline may be a write that a crash cut short.
                break
            where = f"line {n} column {error.colno}: {error.msg}" if isinstance(error, json.JSONDecodeError) \
                else f"line {n}: {error}"
            raise SystemExit(f"error: cannot read labels from {path}: {where}")
    for n, record in records:
        if not valid_record(record):
            raise SystemExit(f"error: {path} line {n} is not a label or a pair record: "
                             f"{json.dumps(record)[:80]}")
    return [record for _, record in records]


class Fatal(Exception):
    """An error that retrying cannot fix: the annotator stops asking."""


def fatal_reason(error):
    """Why retrying cannot help, else None: down, slow, 5xx, 408, 429 are retried; any other 4xx is fatal."""
    if not isinstance(error, urllib.error.HTTPError) or error.code >= 500 or error.code in (408, 429):
        return str(error) if isinstance(error, Fatal) else None
    if error.code in (401, 403):  # Servers word a refused key each their own way: this says what to do.
        key = llm_server.KEY_VARIABLE
        said = f"refused the key in {key}" if os.environ.get(key) else "wants a key"
        return f"the LLM server at {error.url} {said} (HTTP {error.code}): set {key} to its key"
    try:  # The server's error object: OpenAI's {"error": {"message": ...}}, vLLM's {"message": ...}.
        body = json.loads(error.read())
        body = body.get("error", body) if isinstance(body, dict) else body
        detail = body.get("message", body) if isinstance(body, dict) else body
    except ValueError:
        detail = error.reason
    return " ".join(f"HTTP {error.code} from {error.url}: {detail}".split())[:500]


def fill(prompts, name, **fields):
    try:
        return prompts[name].format(goal=GOAL, **fields)
    except (KeyError, IndexError, ValueError) as error:  # Literal braces, say, which are written {{ and }}.
        raise Fatal(f"prompt template {name!r}: {type(error).__name__}: {error}") from None


class Labeler:  # A caption or a pair to a label, with one HTTP request to one of the servers.
    def __init__(self, urls, model, prompts, timeout_s, scored=True, demos=None, key=None):
        self.urls, self.timeout_s = [u.rstrip("/") for u in urls], timeout_s
        self.model, self.prompts, self.demos = model, prompts, demos  # The demos' pool; None: the default.
        # The style once the model is known; messages' scores, reused, and what they depend on (a hash).
        self.style, self.scores, self.scorer = None, {}, None
        self.wants_scores, self.llama_cpp = scored, False  # Ranking's pairs compare scores; the rest, labels.
        self.logprobs = None if scored else False  # Whether the server returns them; None: not known yet.
        self.fallback_said = threading.Lock()
        self.key = llm_server.auth_headers(key)  # On every request: a server may want it at each endpoint.

    def call(self, url, body=None, timeout_s=None):
        """JSON answer to POST `body` (GET without). Not openai: its CPU cost slows the one-core annotator."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **self.key}
        request = urllib.request.Request(url, data=data, headers=headers)
        with llm_server.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
            return json.load(response)

    def resolve_model(self, server=0):
        self.model = self.model or self.call(self.urls[server] + "/models")["data"][0]["id"]
        chat = any(k in self.model.lower() for k in ("instruct", "chat", "-it"))  # Else a base model.
        style = self.prompts.get("style", "chat" if chat else "completion")
        if style == "completion":
            for wait_s in (0, *TOKENIZE_BACKOFF_S):
                time.sleep(wait_s)
                self.token_ids = {w: self.token_id(w, server) for w in (" Yes", " No")}
                if None not in self.token_ids.values():
                    break
            self.restricted = None not in self.token_ids.values()
            if not self.restricted:  # A greedy token cannot carry THRESHOLD: scores, if the server has them.
                self.logprobs = None
                print("annotator: the server did not tokenize ' Yes'/' No': "
                      "answers are not restricted to them", file=sys.stderr, flush=True)
            elif self.llama_cpp:  # Its log-probabilities cost ~7 labels: bisection instead.
                self.logprobs = False
            self.demos = self.demos or load_demos()
            # What a score depends on besides the message: a saved one is reused only where all are the same.
            # How it is read counts too: bisection (llama.cpp), log-probabilities, or an unbiased argmax.
            scorer = [self.model, self.prompts["label_completion"], GOAL, DEMOS_PER_LABEL,
                      [demo[:2] for demo in self.demos], self.restricted, self.llama_cpp, THRESHOLD,
                      SCORE_SPAN, BISECTIONS]
            self.scorer = hashlib.sha256(json.dumps(scorer).encode()).hexdigest()[:12]
        self.style = style
        return self.model

    def token_id(self, word, server):  # Its token (llama.cpp's /extras/tokenize, vLLM's /tokenize), or None.
        root = self.urls[server].removesuffix("/v1")
        for path, body in (("/extras/tokenize", {"input": word}),
                           ("/tokenize", {"model": self.model, "prompt": word})):
            with contextlib.suppress(Exception):  # No such endpoint, or no answer: the next one is tried.
                tokens = self.call(root + path, body, timeout_s=10)["tokens"]
                self.llama_cpp = path == "/extras/tokenize"
                return tokens[-1] if len(tokens) <= 2 else None  # [BOS,] token; else it is no single token.
        return None

    def first_token(self, prompt, server, **options):
        return self.call(self.urls[server] + "/completions", {"model": self.model, "prompt": prompt,
                         "max_tokens": 1, "temperature": 0.0, **options})["choices"][0]

    def score(self, caption, server, precise=True):
        """A base model's score of a caption, helpful above THRESHOLD: logp(" Yes") - logp(" No"), read from
        the log-probabilities where the server returns them (vLLM). llama.cpp computes them over every prompt
        token (~7x the cost of a label), so there greedy tokens restricted to ' Yes'/' No' by logit biases
        answer "is the score above t?" (the favourite +100, the most every backend accepts, ' Yes' t less):
        t = THRESHOLD gives the label; where a `precise` score is wanted (Ranking's pairs), BISECTIONS more
        halve its interval, each ~15 ms as the server's cache holds the prompt."""
        prompt = fill(self.prompts, "label_completion", caption=caption,
                      examples=demonstrations(caption, self.demos))
        if self.logprobs is not False:
            try:
                choice = self.first_token(prompt, server, logprobs=5)
            except urllib.error.HTTPError as error:  # llama.cpp without --logits_all says so in an HTTP 500.
                if error.code != 500 or b"logprobs" not in error.read():
                    raise
                choice = {}
            top = ((choice.get("logprobs") or {}).get("top_logprobs") or [{}])[0]
            self.logprobs = bool(top)  # Whether the server returns log-probabilities.
            if top:
                floor = min(top.values())  # A word not among the top ones is at most as likely as the last.
                return (top.get(" Yes", floor) - top.get(" No", floor) if " Yes" in top or " No" in top
                        else UNPARSEABLE)
            if self.fallback_said.acquire(blocking=False):  # Once, whichever request found out first.
                print("annotator: the server returns no log-probabilities: scores come from greedy Yes/No "
                      "answers under logit biases", file=sys.stderr, flush=True)
        if not self.restricted:  # The model's own greedy answer: argmax, a label with no THRESHOLD.
            label = parse_choice(self.first_token(prompt, server, logit_bias=None)["text"],
                                 {"yes": 1, "no": 0})
            return label if label is UNPARSEABLE else THRESHOLD + (1.0 if label else -1.0)
        yes, no = (str(self.token_ids[word]) for word in (" Yes", " No"))

        def above(t):
            bias = {yes: 100.0 - max(0.0, t), no: 100.0 - max(0.0, -t)}
            return parse_choice(self.first_token(prompt, server, logit_bias=bias)["text"],
                                {"yes": True, "no": False})
        if (label := above(THRESHOLD)) is UNPARSEABLE:
            return UNPARSEABLE
        low, high = (THRESHOLD, THRESHOLD + SCORE_SPAN) if label else (THRESHOLD - SCORE_SPAN, THRESHOLD)
        precise = precise and self.wants_scores
        for _ in range(BISECTIONS if precise else 0):
            if (side := above((low + high) / 2)) is UNPARSEABLE:
                return UNPARSEABLE
            low, high = ((low + high) / 2, high) if side else (low, (low + high) / 2)
        return (low + high) / 2 if precise else THRESHOLD + (1.0 if label else -1.0)

    def known(self, item):  # A pair's preference from the scores of both its messages, else UNPARSEABLE.
        if self.style != "completion" or not isinstance(item, tuple):
            return UNPARSEABLE
        first, second = (self.scores.get(as_asked(m), UNPARSEABLE) for m in item)
        return UNPARSEABLE if UNPARSEABLE in (first, second) else preference(first, second)

    def worth(self, item, worth) -> float:  # A base model's pair is answered from scores, each reused free.
        return item_worth(item, worth, self.scores if self.style == "completion" else {})

    def ask(self, item, server=0):  # The parsed answer about a caption (str) or a (first, second) pair.
        is_pair = isinstance(item, tuple)
        item = tuple(map(as_asked, item)) if is_pair else as_asked(item)
        if self.style == "chat":
            kind, fields = (("pair", {"first": item[0], "second": item[1]}) if is_pair
                            else ("label", {"caption": item}))
            messages = [{"role": "system", "content": self.prompts[f"{kind}_system"]},
                        {"role": "user", "content": fill(self.prompts, f"{kind}_user", **fields)}]
            text = self.call(self.urls[server] + "/chat/completions", {
                "model": self.model, "temperature": 0.1, "max_tokens": 512, "messages": messages,
            })["choices"][0]["message"]["content"]
            return parse_preference(text) if is_pair else parse_label(text)
        if not is_pair:
            score = self.score(item, server, precise=False)
            return score if score is UNPARSEABLE else int(score > THRESHOLD)
        # A small base model compares two messages by position: a pair's preference comes from both scores.
        first, second = (self.scores[m] if m in self.scores else self.score(m, server) for m in item)
        if UNPARSEABLE in (first, second):
            return UNPARSEABLE
        self.scores.update({item[0]: first, item[1]: second})
        return preference(first, second)


class LabelTable:
    """The one label channel, in the Manager's process (it outlives a restarted annotator): the records as
    written (repeats too) until the learner reads them, as keeping all would fill memory; the keys settled."""
    def __init__(self):
        self.written, self.read, self.done = [], 0, set()  # Read: the records the learner took, dropped.

    def put(self, entries):  # [(key, record)]: one turn of the annotator's loop, in one round trip.
        # Not asked again: pairs (a tie is an answer) and labels (an unknown one, None, may be asked again).
        self.done.update(key for key, record in entries if record.get("label", 0) is not None)
        self.written += [record for _, record in entries]

    def since(self, cursor: int):  # The records written after the first `cursor` ones, and the new cursor.
        del self.written[:max(0, cursor - self.read)]
        self.read = max(self.read, cursor)
        end = len(self.written)  # Read first: a record appended between two reads would be skipped for good.
        return self.written[:end], self.read + end

    def settled(self) -> list:
        return list(self.done)


class Manager(multiprocessing.managers.SyncManager):
    """A SyncManager that also serves LabelTables."""


Manager.register("LabelTable", LabelTable, exposed=("put", "since", "settled"))


def cpu_seconds(pid):  # The CPU time a process (all its threads) has used, from /proc; None if unreadable.
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # Its utime + stime.
    except (OSError, ValueError, IndexError):
        return None


def item_worth(item, worth, scores=None) -> float:
    """A caption's worth is the number it came with; a pair's, its messages' pay weights less those of the
    messages whose score is in hand (scores)."""
    if not isinstance(worth, tuple | list):
        return worth
    return sum(w for message, w in zip(item, worth) if as_asked(message) not in (scores or {}))


class Backlog:
    """What waits to be asked, the most worth first (the oldest of equals): a caption's worth is the pay
    weight it has accrued while unlabelled (the learner's figure), so a message paid often is asked before a
    rare one seen earlier; a pair's, the pay weights of its messages not scored yet (price: Labeler.worth),
    so that the scores most pairs need come first. Full, it keeps the 90% worth most (a heap, stale entries
    skipped)."""
    def __init__(self, price=item_worth):
        self.items, self.worth, self.heap, self.order = {}, {}, [], itertools.count()
        self.price, self.raw = price, {}  # The worth as sent: a number, or a pair's number a message.

    def __len__(self): return len(self.items)

    def put(self, key, item, worth=0.0) -> int:  # How many the bound dropped.
        # Totals, so the largest sent stands: a lost or late one is harmless. A retry sends 0.0: no news.
        old = self.raw.get(key)
        if isinstance(worth, tuple | list):
            worth = tuple(map(max, old, worth)) if isinstance(old, tuple) else tuple(worth)
        elif old is not None:
            worth = old if isinstance(old, tuple) else max(old, worth)
        self.raw[key], self.items[key] = worth, item
        self.worth[key] = self.price(item, worth)
        heapq.heappush(self.heap, (-self.worth[key], next(self.order), key))
        if len(self.items) <= MAX_BACKLOG and len(self.heap) <= 4 * MAX_BACKLOG:
            return 0
        keep = len(self.items) if len(self.items) <= MAX_BACKLOG else int(0.9 * MAX_BACKLOG)  # Else: stale.
        kept = heapq.nsmallest(keep, ((-self.worth[k], n, k) for n, k in enumerate(self.items)))
        dropped = len(self.items) - len(kept)
        self.items, self.heap = {k: self.items[k] for _, _, k in kept}, kept
        heapq.heapify(self.heap)
        return dropped

    def peek(self):  # The key worth most (the oldest of equals), or None.
        while self.heap:
            worth, _, key = self.heap[0]
            if key in self.items and -worth == self.worth[key]:
                if (now := self.price(self.items[key], self.raw[key])) >= self.worth[key]:
                    return key
                self.worth[key] = now  # A message of the pair was scored since it came: it costs less now.
                heapq.heappush(self.heap, (-now, next(self.order), key))
                continue
            heapq.heappop(self.heap)  # Asked already, or its worth changed since: a newer entry stands.
        return None

    def pop(self, key):
        return self.items.pop(key)

    def forget(self, key):  # Answered for good, wherever it waits: a pair answered free may still be queued.
        self.items.pop(key, None)
        self.worth.pop(key, None)
        self.raw.pop(key, None)


def serve(*, urls, model, prompts, concurrency, run_dir, known, requests, table, stats, stop, scored,
          demos=None, timeout_s=TIMEOUT_S, share=1.0, key=None, server_pid=None):
    """The annotator process: `concurrency` requests in flight, each to the least busy server not pausing,
    within `share`: the CPU time of the server at server_pid (the embedded one, on the learner's cores) over
    wall time, else the share of wall time with a request in flight."""
    labeler = Labeler(urls, model, prompts, timeout_s, scored, demos, key)
    path = os.path.join(run_dir, LABELS_FILE)
    cut_partial_line(path)
    saved = saved_scores(path)
    asking = set()  # The keys in flight: a retry of one must not ask it twice.
    backlog, attempts, in_flight = Backlog(labeler.worth), collections.Counter(), {}
    credit, last_turn = MAX_CREDIT_S * min(share, 1.0), time.time()  # Credit: the work the share allows now.
    last_cpu = server_pid and cpu_seconds(server_pid)
    answered, unknown_until = [], {}  # This turn's answers, written together; when to ask an unknown again.
    done = set(known) | set(table.settled())  # A restarted annotator does not ask again what is answered.
    latencies, counts = collections.deque(maxlen=1000), collections.Counter(stats.copy())  # Counts go on.
    # Per server, as a dead one must not stall the rest: the next pause, when this one ends, when it began.
    pause_s, resume_at, paused_at = [1.0] * len(urls), [0.0] * len(urls), [0.0] * len(urls)
    fatal, out = None, open(path, "a", buffering=1)  # Each line is flushed.
    pool = concurrent.futures.ThreadPoolExecutor(concurrency)  # A thread per request in flight.

    def enqueue(item, worth=0.0):  # A dropped one waits: the learner sends again what stays unlabelled.
        if ((key := item_key(item)) and key not in done and key not in asking
                and time.time() >= unknown_until.get(key, 0.0)):
            if (known := labeler.known(item)) is not UNPARSEABLE:  # A pair of scored messages costs nothing.
                answered.append(settle(item, known))
            else:
                counts["dropped"] += backlog.put(key, item, worth)

    def settle(item, value):  # The record of an answer; a final one is not asked again.
        key, pair = item_key(item), isinstance(item, tuple)
        if value is not None or pair:
            done.add(key)
            backlog.forget(key)
        else:  # An unknown label may be asked again, later.
            unknown_until[key] = time.time() + UNKNOWN_RETRY_S
        if not pair:
            return key, {"caption": item, "label": value}
        scores = [labeler.scores.get(as_asked(message)) for message in item]  # Kept for a restart.
        return key, {"pair": list(item), "preference": value,
                     **({"scores": scores, "scorer": labeler.scorer} if None not in scores else {})}

    def failed(server, error, started):  # Down, 5xx, a timeout: the server pauses, twice as long each time.
        nonlocal fatal
        counts["failures"] += 1
        if started >= paused_at[server]:  # One outage, one doubling: requests sent before it fail with it.
            paused_at[server] = time.time()
            resume_at[server] = paused_at[server] + pause_s[server]
            pause_s[server] = min(pause_s[server] * 2, MAX_BACKOFF_S)
        fatal = fatal or fatal_reason(error)
    while not stop.is_set() and not fatal:
        with contextlib.suppress(queue.Empty):
            for items in requests.get(timeout=0.05):  # {caption: worth}, {(first, second): (each's)}
                for item, worth in items.items():
                    enqueue(item, worth)
        now = time.time()
        cpu = server_pid and cpu_seconds(server_pid)
        spent = cpu - last_cpu if None not in (cpu, last_cpu) else (now - last_turn) * bool(in_flight)
        credit = min(credit + (now - last_turn) * share - spent, MAX_CREDIT_S * share)
        last_turn, last_cpu = now, cpu
        ready = [s for s in range(len(urls)) if now >= resume_at[s]]
        if labeler.style is None and ready:
            try:
                labeler.resolve_model(ready[0])
                if labeler.style == "completion":
                    counts["answers_restricted"] = int(labeler.restricted)
                    labeler.scores.update(saved.get(labeler.scorer, {}))
            except Exception as error:
                failed(ready[0], error, now)
        busy = collections.Counter(server for _, server, _ in in_flight.values())
        while labeler.style and ready and (key := backlog.peek()) is not None:
            if (known := labeler.known(backlog.items[key])) is not UNPARSEABLE:  # Scored since it came.
                answered.append(settle(backlog.pop(key), known))
                continue
            if len(in_flight) >= concurrency or (share < 1 and credit <= 0):
                break
            server = min(ready, key=busy.__getitem__)  # An even spread; a slower server gets fewer.
            busy[server] += 1
            item = backlog.pop(key)
            in_flight[pool.submit(labeler.ask, item, server)] = (item, server, time.time())
            asking.add(key)
        for future in [f for f in in_flight if f.done()]:
            item, server, started = in_flight.pop(future)
            asking.discard(item_key(item))
            counts["requests"] += 1
            try:
                answer = future.result()
            except Exception as error:  # The item waits for a server to answer.
                failed(server, error, started)
                enqueue(item)
                continue
            pause_s[server] = 1.0
            latencies.append(time.time() - started)
            if scored and labeler.logprobs is not None:  # Scores from log-probabilities (1) or bisection (0).
                counts["answers_scored"] = int(labeler.logprobs)
            if answer is UNPARSEABLE:
                counts["parse_failures"] += 1
                attempts[item] += 1
                if attempts[item] < 2:  # It is asked once more.
                    enqueue(item)
                    continue
                answer = None  # An unknown label, or a tie.
            answered.append(settle(item, answer))
        if answered:  # On disk first: an annotator killed between the writes loses no label a resume needs.
            out.write("".join(json.dumps(record) + "\n" for _, record in answered))
            table.put(answered)  # One round trip for all of this turn's answers.
            counts["labels"] += len(answered)
            answered = []
        ordered = sorted(latencies) or [0.0]
        stats.update(dict(counts), model=labeler.model, backlog=len(backlog), in_flight=len(in_flight),
                     scores_cached=len(labeler.scores),
                     latency_p50=ordered[len(ordered) // 2], latency_p95=ordered[int(len(ordered) * 0.95)])
    if fatal:
        stats["fatal"] = fatal
    pool.shutdown(wait=False, cancel_futures=True)
    out.close()


def cut_partial_line(path):
    """A line a killed annotator left half written is cut: appended to, it would spoil the next record."""
    with contextlib.suppress(FileNotFoundError), open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def saved_scores(path) -> dict:
    """{scorer: {message as asked: score}} of a run's labels.jsonl: a restarted annotator or a resumed run
    reuses a base model's scores, each 1 + BISECTIONS requests on llama.cpp, under the same scorer."""
    saved = collections.defaultdict(dict)
    for record in read_labels(path) if os.path.exists(path) else ():
        if "scores" in record:
            saved[record.get("scorer")].update(zip(map(as_asked, record["pair"]), record["scores"]))
    return saved


def _serve_process(**kwargs):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # The learner decides when the annotator stops.
    try:
        serve(**kwargs)
    except (ConnectionError, EOFError):  # The Manager's table died with the learner (kill -9): no traceback.
        print("annotator: the learner's label table is gone: stopping", file=sys.stderr, flush=True)
        os._exit(1)  # Now: nobody will read the answers of the requests in flight.


def _manager_process(parent):  # The learner decides when the manager stops; it ignores Ctrl-C itself.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # A SIGTERM to the group must not stop it either.
    llm_server.die_with_parent(parent, signal.SIGKILL)  # The trainer's death kills it, and so the annotator.


def check_llm_flags(urls, concurrency=None):
    """--llm-url and --llm-concurrency, before anything starts (a URL that is no http(s) one was retried for
    the whole run as a server that is down): raises SystemExit with one line."""
    for url in urls or []:
        with contextlib.suppress(ValueError):  # A port that is no number.
            parts = urllib.parse.urlsplit(url)
            if parts.scheme in ("http", "https") and parts.hostname and parts.port != 0:
                continue
        raise SystemExit(f"error: --llm-url {url!r} is no http:// or https:// URL (http://HOST:PORT/v1)")
    if concurrency is not None and concurrency < 1:
        raise SystemExit(f"error: --llm-concurrency must be at least 1, not {concurrency}")


class LabelClient:
    """Starts the annotator (and the LLM server without --llm-url), feeds it, reads labels, restarts it."""
    def __init__(self, args):
        self.args, self.server, self.process, self.final_stats = args, None, None, None
        check_llm_flags(getattr(args, "llm_url", None), getattr(args, "llm_concurrency", None))
        self.records_read, self.restarts, self.next_check = 0, 0, 0.0  # Records read: the table's cursor.
        try:  # Read now: a bad pool is an error before anything starts, not in the annotator later.
            self.demos = load_demos(getattr(args, "demos", None))
        except Fatal as error:
            raise SystemExit(f"error: --demos: {error}")
        self.prompts = dict(PROMPTS)
        if args.prompt_file:
            try:
                with open(args.prompt_file) as f:
                    self.prompts.update(json.load(f))
                for name in ("label_user", "pair_user", "label_completion"):  # Now, not after start-up.
                    fill(self.prompts, name, caption="c", first="a", second="b", examples="")
            except (OSError, ValueError) as error:
                raise SystemExit(f"error: cannot read --prompt-file {args.prompt_file}: {error}")
            except Fatal as error:
                raise SystemExit(f"error: --prompt-file {args.prompt_file}: {error}")

    def start(self, run_dir, known, asks="pairs"):  # asks: the reward piece's, "captions" or "pairs".
        self.urls, self.run_dir, self.known = list(self.args.llm_url), run_dir, set(known)
        # Only pairs use a score beyond its label: captions get the same label faster from a greedy token.
        self.scored = asks == "pairs"
        self.concurrency = getattr(self.args, "llm_concurrency", None) or (
            URL_CONCURRENCY if self.urls else EMBEDDED_CONCURRENCY)
        self.share = getattr(self.args, "llm_share", None) or (1.0 if self.urls else EMBEDDED_SHARE)
        self.key = None if self.urls else secrets.token_urlsafe(24)  # None: OPENAI_API_KEY's, if set.
        if not self.urls:  # The embedded server, behind this run's own key: other local users get HTTP 401.
            self.server, url = llm_server.start(log_path=os.path.join(run_dir, "llm_server.log"),
                                                threads=getattr(self.args, "llm_threads", None), key=self.key,
                                                num_workers=getattr(self.args, "num_workers", 0))
            self.urls = [url]
            print(f"embedded LLM server at {url}", flush=True)
        try:
            self.ctx = multiprocessing.get_context("spawn")
            self.manager = Manager(ctx=self.ctx)
            self.manager.start(_manager_process, (os.getpid(),))  # The death signal is tied to this thread.
            self.table, self.shared_stats = self.manager.LabelTable(), self.manager.dict()
            self.stop = self.ctx.Event()
            self.launch()
        except BaseException:
            self.close()  # The embedded server must not outlive a failed start.
            raise

    def launch(self):  # (Re)starts the annotator: the same table and stats, a new queue (the old may lock).
        self.requests = self.ctx.Queue(maxsize=1000)
        self.requests.cancel_join_thread()  # Exit must not wait to flush requests that no process will read.
        process = self.ctx.Process(target=_serve_process, daemon=True, kwargs=dict(
            urls=self.urls, model=self.args.llm_model, prompts=self.prompts, concurrency=self.concurrency,
            run_dir=self.run_dir, known=self.known, requests=self.requests, table=self.table,
            stats=self.shared_stats, stop=self.stop, scored=self.scored, demos=self.demos, share=self.share,
            key=self.key, server_pid=self.server and self.server.pid))
        process.start()
        self.process = process  # Only once started, as close() joins it.

    def check(self):
        """Once per learner update; reads the stats every CHECK_EVERY_S at most. Restarts a dead annotator
        (True: the learner asks again what is unanswered); a fatal error raises SystemExit (the run saves)."""
        alive = self.process is not None and self.process.is_alive()
        if self.process is None or alive and time.time() < self.next_check:
            return
        self.next_check = time.time() + CHECK_EVERY_S
        if fatal := self.stats().get("fatal"):
            raise SystemExit(f"error: annotator: {fatal}")
        if not alive:
            self.restarts += 1
            why = (f"annotator: its process died (exit code {self.process.exitcode}), "
                   f"{self.restarts} times so far")
            if self.restarts > MAX_RESTARTS:
                raise SystemExit(f"error: {why}")
            print(f"{why}: restarting it", file=sys.stderr, flush=True)
            self.launch()
            return True

    def request(self, captions: dict, pairs: dict):  # Each with its worth (Backlog).
        if captions or pairs:
            with contextlib.suppress(queue.Full):  # The annotator is far behind: these will come round again.
                self.requests.put_nowait((captions, pairs))

    def new_records(self) -> list[dict]:  # The records written since the last call, in one round trip.
        records, self.records_read = self.table.since(self.records_read)
        return records

    def stats(self) -> dict:
        if self.final_stats is not None or self.process is None:
            return self.final_stats or {}
        try:  # copy() is one round trip; dict() of a proxy makes one a key.
            return {**self.shared_stats.copy(), "restarts": self.restarts}
        except Exception:  # The manager is gone.
            return {}

    def close(self):
        if self.process is not None:
            self.stop.set()
            self.process.join(timeout=10)
            self.process.terminate()  # If it is still alive; a no-op for one that ended.
            self.final_stats = self.stats()
            self.manager.shutdown()
        if self.server is not None:
            llm_server.stop(self.server)
