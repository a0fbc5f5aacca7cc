"""A small OpenAI-compatible server on 127.0.0.1 for injecting faults into the annotator.

It answers like a completion model: "Yes" for messages that mention killing or gold, "No"
otherwise."""
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def good(text):
    return "kill" in text or "gold" in text


class FakeOpenAI:
    def __init__(self, port=0):
        self.port, self.server = port, None
        self.mode, self.delay, self.fail_next = "ok", 0.0, 0
        self.requests = 0
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

            def do_GET(self):
                self.reply(200, {"object": "list", "data": [{"id": "fake-base", "object": "model",
                                                             "owned_by": "test"}]})

            def do_POST(self):
                if not self.path.endswith("/completions"):
                    return self.reply(404, {"error": {"message": "not found"}})
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests += 1
                    failing = fake.fail_next > 0
                    fake.fail_next -= failing
                if fake.delay:
                    time.sleep(fake.delay)
                if failing or fake.mode == "500":
                    return self.reply(500, {"error": {"message": "injected failure"}})
                self.reply(200, fake.completion(request["prompt"]))

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def completion(self, prompt):
        if self.mode == "garbage":
            token, top = " banana", {" banana": -0.1, " split": -2.0}
        else:
            caption = re.findall(r"^Message: (.*)$", prompt, re.M)[-1]
            token = " Yes" if good(caption) else " No"
            top = {token: -0.1, " No" if token == " Yes" else " Yes": -2.5}
        return {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake-base",
                "choices": [{"index": 0, "text": token, "finish_reason": "length",
                             "logprobs": {"tokens": [token], "token_logprobs": [top[token]],
                                          "top_logprobs": [top], "text_offset": [0]}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
