"""A small OpenAI-compatible server on 127.0.0.1: the tests inject faults into the annotator with it, and the
benchmarks stand it in for an LLM server (`serve_apart`: in a process of its own).

It judges like a model would: messages that mention killing or gold are helpful. Named like a base
model (the default), it answers /completions with " Yes"/" No"; named like an instruct model
("fake-instruct"), /chat/completions with some reasoning, then a <label> tag or a best_description.
Like vLLM, it serves /tokenize (with `llama_cpp` set, llama-cpp-python's /extras/tokenize instead), answers
404 for a model it does not have, and like OpenAI it rejects
(400) logit biases outside [-100, 100]. Asked for log-probabilities (`logprobs`) it answers logp(" Yes") -
logp(" No") = `margins[caption]` (default +2 helpful, -2 not), unless `logprobs` is "error" (HTTP 500, as
llama.cpp without --logits_all) or "absent" (no log-probabilities in the answer). It records every call in
`calls`; `delay` is a fixed latency of every (chat) completion, and `max_active` the most of them it answered
at once. With a `key`, as llama.cpp and vLLM with theirs, it answers `key_status` (401) to any request without
"Authorization: Bearer KEY"; `authorizations` holds every request's Authorization header (None: none).
`redirects` maps a path to a URL that a request to it is redirected to (302)."""
import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKENS = {" Yes": [2, 7010], " No": [2, 1294]}  # [BOS, token], as a Gemma or Llama tokenizer answers


def good(text):
    return "kill" in text or "gold" in text


class Server(ThreadingHTTPServer):
    request_queue_size = 256  # many requests in flight connect at once
    daemon_threads = True


class FakeOpenAI:
    def __init__(self, port=0, model="fake-base"):
        self.port, self.server, self.model = port, None, model
        self.mode, self.delay, self.fail_next, self.fail_status = "ok", 0.0, 0, 500
        self.tokenize_fails = 0  # the next this many /tokenize calls get HTTP 500
        self.llama_cpp = False  # tokenize as llama-cpp-python does, at /extras/tokenize
        self.logprobs, self.margins = "ok", {}
        self.requests, self.calls = 0, []  # requests: (chat) completions asked for
        self.active = self.max_active = 0  # (chat) completions being answered now; the most at once
        self.key, self.key_status, self.authorizations, self.redirects = None, 401, [], {}
        self.lock = threading.Lock()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def refused(self):
                with fake.lock:
                    fake.authorizations.append(self.headers.get("Authorization"))
                if self.path in fake.redirects:
                    self.send_response(302)
                    self.send_header("Location", fake.redirects[self.path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return True
                if fake.key is not None and self.headers.get("Authorization") != f"Bearer {fake.key}":
                    self.reply(fake.key_status, {"detail": "Invalid API key"})  # llama.cpp's answer
                    return True
                return False

            def do_GET(self):
                if self.refused():
                    return
                self.reply(200, {"object": "list", "data": [{"id": fake.model, "object": "model",
                                                             "owned_by": "test"}]})

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.refused():
                    return
                with fake.lock:
                    fake.calls.append((self.path, request))
                    if self.path == ("/extras/tokenize" if fake.llama_cpp else "/tokenize"):
                        failing = fake.tokenize_fails > 0
                        fake.tokenize_fails -= failing
                    elif self.path in ("/v1/completions", "/v1/chat/completions"):
                        fake.requests, fake.active = fake.requests + 1, fake.active + 1
                        fake.max_active = max(fake.max_active, fake.active)
                        failing = fake.fail_next > 0
                        fake.fail_next -= failing
                    else:
                        return self.reply(404, {"error": {"message": "not found"}})
                if self.path.endswith("/tokenize"):
                    if failing:
                        return self.reply(500, {"error": {"message": "injected failure"}})
                    word = request["input" if fake.llama_cpp else "prompt"]
                    return self.reply(200, {"tokens": TOKENS.get(word, [2, 11, 12, 13])})
                if fake.delay:
                    time.sleep(fake.delay)
                with fake.lock:  # before the reply: a client may send its next request as soon as it has it
                    fake.active -= 1
                if failing or fake.mode == "500":
                    return self.reply(fake.fail_status, {"error": {"message": "injected failure"}})
                if request["model"] != fake.model:
                    return self.reply(404, {"object": "error", "code": 404,
                                            "message": f"The model `{request['model']}` does not exist."})
                if any(abs(b) > 100 for b in (request.get("logit_bias") or {}).values()):
                    return self.reply(400, {"error": {"message": "logit_bias values must be in [-100, 100]"}})
                if self.path == "/v1/completions":
                    if request.get("logprobs") and fake.logprobs == "error":
                        return self.reply(500, {"error": {"message": "logprobs is not supported for models "
                                                                     "created with logits_all=False"}})
                    return self.reply(200, fake.completion(request["prompt"], request.get("logprobs"),
                                                           request.get("logit_bias")))
                self.reply(200, fake.chat(request["messages"][-1]["content"]))

        self.server = Server(("127.0.0.1", self.port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def completion(self, prompt, logprobs=None, logit_bias=None):
        """The greedy token is the most likely after logit_bias, as llama.cpp and vLLM choose it."""
        caption = re.findall(r"^Message: (.*)$", prompt, re.M)[-1]
        margin = self.margins.get(caption, 2.0 if good(caption) else -2.0)
        top = ({" banana": -0.1, " apple": -3.0} if self.mode == "garbage" else
               {" Yes": -1.0 + margin / 2, " No": -1.0 - margin / 2, " banana": -9.0})
        bias = {word: (logit_bias or {}).get(str(ids[-1]), 0.0) for word, ids in TOKENS.items()}
        token = max(top, key=lambda word: top[word] + bias.get(word, 0.0))
        scored = {"tokens": [token], "token_logprobs": [top.get(token)], "top_logprobs": [
            dict(sorted(top.items(), key=lambda kv: -kv[1])[:logprobs])], "text_offset": [len(prompt)]}
        return {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": self.model,
                "choices": [{"index": 0, "text": token, "finish_reason": "length",
                             "logprobs": scored if logprobs and self.logprobs == "ok" else None}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    def chat(self, prompt):
        """Restates the answer format first, as instruct models do, then answers."""
        quoted = re.findall(r'"(.*)"$', prompt, re.M)  # the message(s), each ending its line
        if self.mode == "garbage":
            text = "Hard to say without seeing the map."
        elif len(quoted) == 2:
            better = {(True, False): 1, (False, True): 2}.get((good(quoted[0]), good(quoted[1])))
            text = (f'I must answer with ("best_description": 1) or ("best_description": 2). Killing and '
                    f'gold are progress. ("best_description": {better})')
        else:
            text = (f"I must end with <label>FOO</label> or <label>BAR</label>. This message reports "
                    f"{'progress' if good(quoted[0]) else 'no progress'}. "
                    f"<label>{'FOO' if good(quoted[0]) else 'BAR'}</label>")
        return {"id": "chat-fake", "object": "chat.completion", "created": 0, "model": self.model,
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def serve_apart(model="fake-base"):
    """A FakeOpenAI in a process of its own, as an LLM server elsewhere (its CPU and memory are not the
    caller's): (the process, its URL). Closing the process's stdin stops it."""
    process = subprocess.Popen([sys.executable, os.path.abspath(__file__), model], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    return process, process.stdout.readline().strip()


if __name__ == "__main__":  # serve_apart's process: it serves until its stdin closes
    print(FakeOpenAI(model=sys.argv[1]).start().url, flush=True)
    sys.stdin.read()
