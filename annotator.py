"""The annotator: a subprocess that asks an OpenAI-compatible LLM server about the agent's messages.

The learner puts captions (and, for Ranking, pairs of captions) on a queue; the annotator keeps a
bounded backlog, newest first, several requests in flight, timeouts and retries with backoff, and
writes each label into a `multiprocessing.Manager` dict (plus an append-only log the learner reads
incrementally) and into `labels.jsonl` in the run dir. A server that is down, slow or dies never
blocks training: its captions wait in the backlog until it answers again.
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
import time
import urllib.request

LABELS_FILE = "labels.jsonl"
MAX_BACKLOG = 10_000
CONCURRENCY = 4  # llama.cpp takes one prompt a request; vLLM batches concurrent requests itself
TIMEOUT_S = 60.0
MAX_BACKOFF_S = 30.0
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
# Added to the logit of " No" against " Yes" for completion prompts: the base model says Yes too
# readily. Calibrated on benchmarks/label_quality.py's dev set (not on its test set).
NO_BIAS = 0.5
LABEL_TAG = re.compile(r"<label>\s*(FOO|BAR)\s*</label>", re.IGNORECASE)
PREFERENCE = re.compile(r"best_description\"?\s*:\s*\"?(1|2|None)", re.IGNORECASE)


def parse_label(text: str):
    """1 (FOO) / 0 (BAR) from the last <label> tag of a chat answer, else UNPARSEABLE."""
    tags = LABEL_TAG.findall(text or "")
    return (1 if tags[-1].upper() == "FOO" else 0) if tags else UNPARSEABLE


def parse_preference(text: str):
    """1, 2, or None (a tie) from the first best_description answer, else UNPARSEABLE."""
    match = PREFERENCE.search(text or "")
    if not match:
        return UNPARSEABLE
    return None if match.group(1).lower() == "none" else int(match.group(1))


def parse_choice(text: str, options: dict):
    """A completion's one-token answer: options maps an answer (lower case) to its value."""
    return options.get((text or "").strip().lower(), UNPARSEABLE)


def preference_probability(preference) -> float:
    """Soft Bradley-Terry target: p(first message is better)."""
    return {1: 1.0, 2: 0.0}.get(preference, 0.5)


def pair_key(first: str, second: str) -> str:
    return json.dumps([first, second])


def read_labels(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: cannot read labels from {path}: {error}")


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
            self.token_ids = {w: self.token_id(w) for w in (" Yes", " No")}
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
        """One greedy token restricted to the options' tokens (+bias), where the server can."""
        ids = {w: self.token_ids.get(w) for w in options}
        logit_bias = ({str(i): 100.0 + bias.get(w, 0.0) for w, i in ids.items()}
                      if None not in ids.values() else None)
        answer = self.client().completions.create(model=self.model, prompt=prompt, max_tokens=1,
                                                  temperature=0.0, logit_bias=logit_bias)
        return parse_choice(answer.choices[0].text, {w.strip().lower(): v for w, v in options.items()})

    def ask(self, item):
        """item: a caption (str) or a (first, second) pair. Returns the parsed answer."""
        p, is_pair = self.prompts, isinstance(item, tuple)
        fields = {"goal": GOAL}
        fields.update({"first": item[0], "second": item[1]} if is_pair else {"caption": item})
        if self.style == "chat":
            kind = "pair" if is_pair else "label"
            answer = self.client().chat.completions.create(
                model=self.model, temperature=0.1, max_tokens=512,
                messages=[{"role": "system", "content": p[f"{kind}_system"]},
                          {"role": "user", "content": p[f"{kind}_user"].format(**fields)}])
            text = answer.choices[0].message.content
            return parse_preference(text) if is_pair else parse_label(text)
        if not is_pair:
            return self.complete(p["label_completion"].format(**fields), {" Yes": 1, " No": 0},
                                 {" No": NO_BIAS})
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
    counts = collections.Counter()
    backoff, resume_at, model_known = 1.0, 0.0, False
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
        done.add(key)
        labels[key] = answer
        log.append(entry)
        out.write(json.dumps(entry) + "\n")
        out.flush()
        counts["labels"] += 1

    while not stop.is_set():
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
            except Exception:
                counts["failures"] += 1
                resume_at, backoff = now + backoff, min(backoff * 2, MAX_BACKOFF_S)
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
            except Exception:  # down, 5xx, timeout: the item waits for the server to come back
                counts["failures"] += 1
                resume_at, backoff = time.time() + backoff, min(backoff * 2, MAX_BACKOFF_S)
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
    requests, and reads new labels in bulk from the shared log."""

    def __init__(self, args):
        self.args, self.server, self.process, self.final_stats = args, None, None, None
        self.read = 0
        self.prompts = dict(PROMPTS)
        if args.prompt_file:
            try:
                with open(args.prompt_file) as f:
                    self.prompts.update(json.load(f))
            except (OSError, ValueError) as error:
                raise SystemExit(f"error: cannot read --prompt-file {args.prompt_file}: {error}")

    def start(self, run_dir, known):
        urls = list(self.args.llm_url)
        if not urls:
            import llm_server
            self.server, url = llm_server.start(log_path=os.path.join(run_dir, "llm_server.log"))
            urls = [url]
            print(f"embedded LLM server at {url}", flush=True)
        ctx = multiprocessing.get_context("spawn")
        # the learner decides when everything stops: Ctrl-C must not kill the Manager under it
        self.manager = multiprocessing.managers.SyncManager(ctx=ctx)
        self.manager.start(signal.signal, (signal.SIGINT, signal.SIG_IGN))
        self.labels, self.log, self.stats_ = self.manager.dict(), self.manager.list(), self.manager.dict()
        self.requests, self.stop = ctx.Queue(maxsize=1000), ctx.Event()
        self.process = ctx.Process(target=_serve_process, daemon=True, args=(
            urls, self.args.llm_model, self.prompts, self.requests, self.labels, self.log,
            self.stats_, self.stop, run_dir, known))
        self.process.start()

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
        try:
            return dict(self.stats_) if self.process is not None else {}
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
            import llm_server
            llm_server.stop(self.server)
