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
import math
import multiprocessing
import os
import queue
import re
import time

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
        "Message: You kill the jackal!\nProgress: Yes\n"
        "Message: It's a wall.\nProgress: No\n"
        "Message: You see here 12 gold pieces.\nProgress: Yes\n"
        "Message: The grid bug bites!\nProgress: No\n"
        "Message: Welcome to experience level 3.\nProgress: Yes\n"
        "Message: You miss the newt.\nProgress: No\n"
        "Message: You find a hidden passage.\nProgress: Yes\n"
        "Message: You are beginning to feel hungry.\nProgress: No\n"
        "Message: You descend the stairs.\nProgress: Yes\n"
        "Message: Never mind.\nProgress: No\n"
        "Message: {caption}\nProgress:"),
    "pair_completion": (
        "Which NetHack message reports more progress (killing monsters, gold, descending, "
        "levelling up)?\n"
        "1: It's a wall.\n2: You kill the newt!\nBetter: 2\n"
        "1: You see here 7 gold pieces.\n2: The jackal bites!\nBetter: 1\n"
        "1: Welcome to experience level 2.\n2: You hear some noises.\nBetter: 1\n"
        "1: You miss the grid bug.\n2: You find a hidden door.\nBetter: 2\n"
        "1: {first}\n2: {second}\nBetter:"),
}
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


def parse_choice(top_logprobs: dict, options: dict, margin: float = 0.0):
    """A completion's answer from its next-token log-probabilities: options maps a token (stripped,
    lower-case) to a value; the most probable one wins by more than `margin`, else the last
    option (the negative/tie one) does. UNPARSEABLE when none of them is among the top tokens."""
    best = {}
    for token, logprob in (top_logprobs or {}).items():
        key = token.strip().lower()
        if key in options:
            best[options[key]] = max(best.get(options[key], -math.inf), logprob)
    if not best:
        return UNPARSEABLE
    values = list(dict.fromkeys(options.values()))
    scores = [best.get(v, -math.inf) for v in values]
    winner = max(range(len(values)), key=lambda i: scores[i])
    runner_up = max(s for i, s in enumerate(scores) if i != winner) if len(scores) > 1 else -math.inf
    return values[winner] if scores[winner] - runner_up > margin else values[-1]


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

    def client(self):
        return self.clients[next(self.next_client)]

    def resolve_model(self):
        if self.model is None:
            self.model = self.client().models.list().data[0].id
        self.style = prompt_style(self.model, self.prompts)
        return self.model

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
        prompt = p["pair_completion" if is_pair else "label_completion"].format(**fields)
        answer = self.client().completions.create(model=self.model, prompt=prompt, max_tokens=1,
                                                  temperature=0.0, logprobs=10)
        top = answer.choices[0].logprobs.top_logprobs[0] if answer.choices[0].logprobs else {}
        if is_pair:
            return parse_choice(top, {"1": 1, "2": 2, "none": None})
        return parse_choice(top, {"yes": 1, "no": 0})


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
    import signal
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
        self.manager = ctx.Manager()
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
