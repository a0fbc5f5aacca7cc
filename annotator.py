"""The annotator: a subprocess that asks an OpenAI-compatible LLM server about the agent's messages.

The learner puts captions (and, for Ranking, pairs of captions) on a queue; the annotator keeps a
bounded backlog, newest first, several requests in flight, timeouts and retries with backoff, and
writes each label into a `multiprocessing.Manager` dict (plus an append-only log the learner reads
incrementally) and into `labels.jsonl` in the run dir. A server that is down, slow or dies never
blocks training: its captions wait in the backlog until it answers again. An error that retrying
cannot fix stops the annotator and, through `LabelClient.check()`, the run.
"""
import collections
import concurrent.futures
import itertools
import json
import multiprocessing
import multiprocessing.managers
import os
import queue
import re
import signal
import sys
import time
import urllib.request

import llm_server

LABELS_FILE = "labels.jsonl"
MAX_BACKLOG = 10_000
CONCURRENCY = 4  # llama.cpp takes one prompt a request; vLLM batches concurrent requests itself
TIMEOUT_S = 60.0
MAX_BACKOFF_S = 30.0
TOKENIZE_BACKOFF_S = (0.5, 1.0, 2.0)  # start-up retries of the server's tokenize endpoint
CHECK_EVERY_S, MAX_RESTARTS = 5.0, 5  # LabelClient.check(): how often it reads the stats; restarts
UNPARSEABLE = object()

# ---------------------------------------------------------------------------------------------
# Prompts. Chat prompts ask an instruct model to reason first, as the paper does; completion
# prompts give a base model (the embedded default) worked examples and read the next token.
# ---------------------------------------------------------------------------------------------
GOAL = "maximize the score: kill monsters, collect gold, go down the stairs, gain experience levels"
PROMPTS = {
    "label_system": "You are a fair and knowledgeable judge of progress in the game NetHack.",
    "label_user": (
        "A player's goal in NetHack is to {goal}. During play the game showed this message:\n"
        "\"{caption}\"\n"
        "First recall what you know about NetHack that bears on this message, then judge in one "
        "sentence whether the event it reports is a clear step towards the goal. Messages about "
        "killing monsters, finding gold or items, descending, or levelling up are helpful; neutral, "
        "routine, unlucky or harmful events are not. End with <label>FOO</label> if the message is "
        "very helpful for progress, or <label>BAR</label> if it is not."),
    "pair_system": "You are a fair and knowledgeable judge of progress in the game NetHack.",
    "pair_user": (
        "A player's goal in NetHack is to {goal}. Here are two messages the game showed:\n"
        "description 1: \"{first}\"\ndescription 2: \"{second}\"\n"
        "Think about what each tells about the player's progress, using your knowledge of NetHack. "
        "Then answer with exactly one of (\"best_description\": 1), (\"best_description\": 2) or "
        "(\"best_description\": None) if neither is better."),
    "label_completion": (
        "NetHack messages, and whether each one reports progress (killing monsters, gold, "
        "descending, levelling up, finding things):\n"
        "Message: You kill the gecko!\nProgress: Yes\n"
        "Message: You hear a door open.\nProgress: No\n"
        "Message: You see here 8 gold pieces.\nProgress: Yes\n"
        "Message: The gecko bites!\nProgress: No\n"
        "Message: Welcome to experience level 3.\nProgress: Yes\n"
        "Message: You miss the gecko.\nProgress: No\n"
        "Message: You have a little trouble lifting the boulder.\nProgress: No\n"
        "Message: {caption}\nProgress:"),
}
# How much more logit " No" gets than " Yes" for completion prompts: the base model says Yes too
# readily. Calibrated on benchmarks/label_quality.py's dev set (not on its test set).
BIAS_TOWARDS_NO = 0.25
LABEL_TAG = re.compile(r"<label>\s*(FOO|BAR)\s*</label>", re.IGNORECASE)
PREFERENCE = re.compile(r"best_description\"?\s*:\s*\"?(1|2|None)", re.IGNORECASE)


def parse_label(text: str):
    """1 (FOO) / 0 (BAR) from the last <label> tag of a chat answer, else UNPARSEABLE."""
    tags = LABEL_TAG.findall(text or "")
    return (1 if tags[-1].upper() == "FOO" else 0) if tags else UNPARSEABLE


def parse_preference(text: str):
    """1, 2, or None (a tie) from the last best_description answer (a reply may restate the
    format before it answers), else UNPARSEABLE."""
    answers = PREFERENCE.findall(text or "")
    if not answers:
        return UNPARSEABLE
    return None if answers[-1].lower() == "none" else int(answers[-1])


def parse_choice(text: str, options: dict):
    """A completion's one-token answer: options maps an answer (lower case) to its value."""
    return options.get((text or "").strip().lower(), UNPARSEABLE)


def preference_probability(preference) -> float:
    """Soft Bradley-Terry target: p(first message is better)."""
    return {1: 1.0, 2: 0.0}.get(preference, 0.5)


def pair_key(first: str, second: str) -> str:
    return json.dumps([first, second])


def valid_record(r) -> bool:
    """A line of labels.jsonl: {"caption": str, "label": 1|0|null} or {"pair": [str, str], "preference": 1|2|null}."""
    if isinstance(r, dict) and "pair" in r:
        return (isinstance(r["pair"], list) and len(r["pair"]) == 2 and all(isinstance(m, str) for m in r["pair"])
                and r.get("preference", 0) in (1, 2, None))
    return isinstance(r, dict) and isinstance(r.get("caption"), str) and r.get("label", 2) in (0, 1, None)


def read_labels(path: str) -> list[dict]:
    try:
        with open(path) as f:
            records = [(n, json.loads(line)) for n, line in enumerate(f, 1) if line.strip()]
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: cannot read labels from {path}: {error}")
    for n, record in records:
        if not valid_record(record):
            raise SystemExit(f"error: {path} line {n} is not a label or a pair record: {json.dumps(record)[:80]}")
    return [record for _, record in records]


class Fatal(Exception):
    """An error that retrying cannot fix: the annotator stops asking."""


def fatal_reason(error):
    """One line saying why retrying cannot help, else None: down, slow, 5xx, 408 and 429 are retried;
    any other 4xx (no such model, a request the backend rejects) is fatal."""
    status = getattr(error, "status_code", None)
    if isinstance(error, Fatal) or status is None or status >= 500 or status in (408, 429):
        return str(error) if isinstance(error, Fatal) else None
    body = getattr(error, "body", None)  # the openai client keeps the server's error object here
    detail = body.get("message", body) if isinstance(body, dict) else body or error
    return " ".join(f"HTTP {status} from {error.request.url}: {detail}".split())[:500]


def fill(prompts, name, **fields):
    try:
        return prompts[name].format(goal=GOAL, **fields)
    except (KeyError, IndexError, ValueError) as error:  # e.g. literal braces: write {{ and }}
        raise Fatal(f"prompt template {name!r}: {type(error).__name__}: {error}") from None


def prompt_style(model: str, prompts: dict) -> str:
    if "style" in prompts:
        return prompts["style"]
    name = model.lower()
    return "chat" if any(k in name for k in ("instruct", "chat", "-it")) else "completion"


# ---------------------------------------------------------------------------------------------
# One request
# ---------------------------------------------------------------------------------------------
class Labeler:
    """Turns one caption or pair into a label with one HTTP request to one of the servers."""

    def __init__(self, urls, model, prompts, timeout_s):
        from openai import OpenAI
        self.clients = [OpenAI(base_url=u, api_key="none", timeout=timeout_s, max_retries=0) for u in urls]
        self.next_client = itertools.cycle(range(len(urls)))
        self.model, self.prompts = model, prompts
        self.labels = {}  # completion style: labels of single messages, reused across pairs

    def client(self):
        return self.clients[next(self.next_client)]

    def resolve_model(self):
        if self.model is None:
            self.model = self.client().models.list().data[0].id
        self.style = prompt_style(self.model, self.prompts)
        if self.style == "completion":
            for wait_s in (0, *TOKENIZE_BACKOFF_S):
                time.sleep(wait_s)
                self.token_ids = {w: self.token_id(w) for w in (" Yes", " No")}
                if None not in self.token_ids.values():
                    break
            self.restricted = None not in self.token_ids.values()
            if not self.restricted:
                print("annotator: the server did not tokenize ' Yes'/' No': answers are not restricted to them",
                      file=sys.stderr, flush=True)
        return self.model

    def token_id(self, word):
        """The server's token for `word`, to restrict and bias the next token (llama.cpp's
        /extras/tokenize or vLLM's /tokenize); None if the server cannot say."""
        root = str(self.clients[0].base_url).rstrip("/").removesuffix("/v1")
        for path, body in (("/extras/tokenize", {"input": word}), ("/tokenize", {"model": self.model, "prompt": word})):
            try:
                request = urllib.request.Request(root + path, data=json.dumps(body).encode(),
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=10) as response:
                    tokens = json.load(response)["tokens"]
                return tokens[-1] if len(tokens) <= 2 else None  # [BOS,] token; else no single token
            except Exception:
                continue
        return None

    def complete(self, prompt, options: dict, bias: dict):
        """One greedy token restricted to the options' tokens where the server can: the favourite
        gets a logit bias of 100, the most every backend accepts; the others that less their bias."""
        ids, logit_bias = {w: self.token_ids.get(w) for w in options}, None
        if None not in ids.values():
            top = max(bias.get(w, 0.0) for w in options)
            logit_bias = {str(i): 100.0 - top + bias.get(w, 0.0) for w, i in ids.items()}
            if not all(-100.0 <= b <= 100.0 for b in logit_bias.values()):  # a backend would clamp it
                raise Fatal(f"logit biases {logit_bias} are outside [-100, 100]")
        answer = self.client().completions.create(model=self.model, prompt=prompt, max_tokens=1,
                                                  temperature=0.0, logit_bias=logit_bias)
        return parse_choice(answer.choices[0].text, {w.strip().lower(): v for w, v in options.items()})

    def ask(self, item):
        """item: a caption (str) or a (first, second) pair. Returns the parsed answer."""
        p, is_pair = self.prompts, isinstance(item, tuple)
        fields = {"first": item[0], "second": item[1]} if is_pair else {"caption": item}
        if self.style == "chat":
            kind = "pair" if is_pair else "label"
            answer = self.client().chat.completions.create(
                model=self.model, temperature=0.1, max_tokens=512,
                messages=[{"role": "system", "content": p[f"{kind}_system"]},
                          {"role": "user", "content": fill(p, f"{kind}_user", **fields)}])
            text = answer.choices[0].message.content
            return parse_preference(text) if is_pair else parse_label(text)
        if not is_pair:
            return self.complete(fill(p, "label_completion", **fields), {" Yes": 1, " No": 0},
                                 {" No": BIAS_TOWARDS_NO})
        # A small base model cannot compare two messages (the 270M default answers by position,
        # not content): a pair's preference comes from the two messages' own labels.
        first, second = (self.labels.get(m) if m in self.labels else self.ask(m) for m in item)
        if UNPARSEABLE in (first, second):
            return UNPARSEABLE
        self.labels.update({item[0]: first, item[1]: second})
        return None if first == second else 1 if first > second else 2


# ---------------------------------------------------------------------------------------------
# The subprocess
# ---------------------------------------------------------------------------------------------
def serve(urls, model, prompts, requests, labels, log, stats, stop, run_dir, known, timeout_s=TIMEOUT_S):
    """Main loop of the annotator process."""
    labeler = Labeler(urls, model, prompts, timeout_s)
    backlog, queued = collections.deque(), set()
    done, attempts, in_flight = set(known), collections.Counter(), {}
    latencies = collections.deque(maxlen=1000)
    counts = collections.Counter(stats.copy())  # a restarted annotator goes on counting
    backoff, resume_at, model_known, fatal = 1.0, 0.0, False, None
    out = open(os.path.join(run_dir, LABELS_FILE), "a")
    pool = concurrent.futures.ThreadPoolExecutor(CONCURRENCY)

    def enqueue(item):
        key = pair_key(*item) if isinstance(item, tuple) else item
        if not key or key in done or key in queued:
            return
        if len(backlog) >= MAX_BACKLOG:
            oldest = backlog.popleft()
            queued.discard(pair_key(*oldest) if isinstance(oldest, tuple) else oldest)
            counts["dropped"] += 1
        backlog.append(item)
        queued.add(key)

    def record(item, answer):
        if isinstance(item, tuple):
            key, entry = pair_key(*item), {"pair": list(item), "preference": answer}
        else:
            key, entry = item, {"caption": item, "label": answer}
        if answer is not None or isinstance(item, tuple):  # an unknown label may be asked again later
            done.add(key)
        labels[key] = answer
        log.append(entry)
        out.write(json.dumps(entry) + "\n")
        out.flush()
        counts["labels"] += 1

    while not stop.is_set() and not fatal:
        try:
            captions, pairs = requests.get(timeout=0.05)
            for item in itertools.chain(captions, pairs):
                enqueue(tuple(item) if isinstance(item, (list, tuple)) else item)
        except queue.Empty:
            pass
        now = time.time()
        if not model_known and now >= resume_at:
            try:
                labeler.resolve_model()
                model_known, backoff = True, 1.0
                if labeler.style == "completion":
                    counts["answers_restricted"] = int(labeler.restricted)
            except Exception as error:
                counts["failures"] += 1
                resume_at, backoff = now + backoff, min(backoff * 2, MAX_BACKOFF_S)
                fatal = fatal_reason(error)
        while model_known and backlog and len(in_flight) < CONCURRENCY and now >= resume_at:
            item = backlog.pop()  # newest first
            key = pair_key(*item) if isinstance(item, tuple) else item
            queued.discard(key)
            in_flight[pool.submit(labeler.ask, item)] = (item, time.time())
        for future in [f for f in in_flight if f.done()]:
            item, started = in_flight.pop(future)
            counts["requests"] += 1
            try:
                answer = future.result()
            except Exception as error:  # down, 5xx, timeout: the item waits for the server to come back
                counts["failures"] += 1
                resume_at, backoff = time.time() + backoff, min(backoff * 2, MAX_BACKOFF_S)
                fatal = fatal or fatal_reason(error)
                enqueue(item)
                continue
            backoff = 1.0
            latencies.append(time.time() - started)
            if answer is UNPARSEABLE:
                counts["parse_failures"] += 1
                attempts[item] += 1
                if attempts[item] < 2:
                    enqueue(item)  # once more
                    continue
                answer = None  # unknown label / a tie
            record(item, answer)
        ordered = sorted(latencies)
        stats.update(dict(counts), backlog=len(backlog), in_flight=len(in_flight),
                     latency_p50=ordered[len(ordered) // 2] if ordered else 0.0,
                     latency_p95=ordered[int(len(ordered) * 0.95)] if ordered else 0.0)
    if fatal:
        stats["fatal"] = fatal
    pool.shutdown(wait=False, cancel_futures=True)
    out.close()


def _serve_process(*args):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the learner decides when we stop
    serve(*args)


# ---------------------------------------------------------------------------------------------
# The learner's side
# ---------------------------------------------------------------------------------------------
class LabelClient:
    """Starts the annotator (and the embedded LLM server when no --llm-url is given), sends it
    requests, reads new labels in bulk from the shared log, and restarts it if it dies."""

    def __init__(self, args):
        self.args, self.server, self.process, self.final_stats = args, None, None, None
        self.read, self.restarts, self.next_check = 0, 0, 0.0
        self.prompts = dict(PROMPTS)
        if args.prompt_file:
            try:
                with open(args.prompt_file) as f:
                    self.prompts.update(json.load(f))
            except (OSError, ValueError) as error:
                raise SystemExit(f"error: cannot read --prompt-file {args.prompt_file}: {error}")
            try:  # a template that cannot be filled in is an error now, not after start-up
                for name in ("label_user", "pair_user", "label_completion"):
                    fill(self.prompts, name, caption="c", first="a", second="b")
            except Fatal as error:
                raise SystemExit(f"error: --prompt-file {args.prompt_file}: {error}")

    def start(self, run_dir, known):
        self.urls, self.run_dir, self.known = list(self.args.llm_url), run_dir, set(known)
        if not self.urls:
            self.server, url = llm_server.start(log_path=os.path.join(run_dir, "llm_server.log"),
                                                threads=getattr(self.args, "llm_threads", None),
                                                num_workers=getattr(self.args, "num_workers", 0))
            self.urls = [url]
            print(f"embedded LLM server at {url}", flush=True)
        try:
            self.ctx = multiprocessing.get_context("spawn")
            # the learner decides when everything stops: Ctrl-C must not kill the Manager under it
            self.manager = multiprocessing.managers.SyncManager(ctx=self.ctx)
            self.manager.start(signal.signal, (signal.SIGINT, signal.SIG_IGN))
            self.labels, self.log, self.stats_ = self.manager.dict(), self.manager.list(), self.manager.dict()
            self.stop = self.ctx.Event()
            self.launch()
        except BaseException:
            self.close()  # the embedded server must not outlive a failed start
            raise

    def launch(self):
        """(Re)starts the annotator on the same Manager objects, with a new queue (a process that died
        could hold the old one's lock), knowing every label so far."""
        self.requests = self.ctx.Queue(maxsize=1000)
        process = self.ctx.Process(target=_serve_process, daemon=True, args=(
            self.urls, self.args.llm_model, self.prompts, self.requests, self.labels, self.log,
            self.stats_, self.stop, self.run_dir, self.known | set(self.labels.keys())))
        process.start()
        self.process = process  # only once started: close() joins it

    def check(self):
        """Once per learner update, cheap (reads the stats every CHECK_EVERY_S at most). Restarts a
        dead annotator. A fatal error raises SystemExit, on which the learner saves a checkpoint and
        stops the run: nothing is lost; fix the cause and --resume."""
        alive = self.process is not None and self.process.is_alive()
        if self.process is None or alive and time.time() < self.next_check:
            return
        self.next_check = time.time() + CHECK_EVERY_S
        if fatal := self.stats().get("fatal"):
            raise SystemExit(f"error: annotator: {fatal}")
        if not alive:
            self.restarts += 1
            why = f"annotator: its process died (exit code {self.process.exitcode}), {self.restarts} times so far"
            if self.restarts > MAX_RESTARTS:
                raise SystemExit(f"error: {why}")
            print(f"{why}: restarting it", file=sys.stderr, flush=True)
            self.launch()

    def request(self, captions, pairs):
        if captions or pairs:
            try:
                self.requests.put_nowait((captions, pairs))
            except queue.Full:  # the annotator is far behind: these will come round again
                pass

    def new_records(self) -> list[dict]:
        records = self.log[self.read:]  # one round trip for everything new
        self.read += len(records)
        return records

    def stats(self) -> dict:
        if self.final_stats is not None:
            return self.final_stats
        try:  # copy(): one round trip (dict() of a proxy makes one a key)
            return {**self.stats_.copy(), "restarts": self.restarts} if self.process is not None else {}
        except Exception:  # the manager is gone
            return {}

    def close(self):
        if self.process is not None:
            self.stop.set()
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.terminate()
            self.final_stats = self.stats()
            self.manager.shutdown()
        if self.server is not None:
            llm_server.stop(self.server)
