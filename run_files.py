"""A run directory's files kept safe, whatever the run: one learner at a time (its lock), files replaced
whole (a crash or a full disk leaves the last whole one), checkpoints that load without pickle, and the commit
of the code that wrote them. oni_appo.py keeps its runs with these; nothing here is particular to ONI."""
import collections
import contextlib
import errno
import fcntl
import os
import re
import socket
import subprocess
import warnings

import numpy as np

LOCK_FILE = "learner.lock"  # Held by the learner of a run dir (hold).
# What torch.load(weights_only=True) reads besides tensors, dicts, lists and tuples.
SCALARS = {str, int, float, bool, type(None)}
# Torch is imported where a checkpoint is read or written: the readers of a run's logs need none.


def hold(run_dir):
    """The run dir, made if need be and locked for this learner: a second one there would interleave its logs
    and labels with this one's. The kernel frees the lock when this process dies, kill -9 too."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        lock = open(os.path.join(run_dir, LOCK_FILE), "a+")
    except OSError as error:
        raise SystemExit(f"error: cannot write to --run-dir {run_dir}: {error.strerror}")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        raise SystemExit(f"error: --run-dir {run_dir} is in use by another learner "
                         f"({lock.read().strip() or 'its pid unknown'})")
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
    return lock


@contextlib.contextmanager
def replacing(path):
    """The name to write path's new contents to: they replace path once whole, so a crash cannot lose it."""
    try:
        yield path + ".tmp"
        os.replace(path + ".tmp", path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        raise


def rewrite(path, lines):
    with replacing(path) as temporary, open(temporary, "w") as f:
        f.writelines(lines)


def write_checkpoint(state, path):
    import torch
    try:
        with replacing(path) as temporary:
            torch.save(loadable(state), temporary)
    except RuntimeError as error:
        if "write" in str(error):  # Torch's writer on a full disk.
            raise OSError(errno.ENOSPC, "the checkpoint could not be written (a full disk?)", path) from error
        raise


def loadable(value):
    """value in the types torch.load(weights_only=True) reads, so that a checkpoint cannot run code."""
    import torch
    if type(value) in SCALARS or isinstance(value, torch.Tensor):
        return value
    kinds = {*SCALARS, torch.Tensor}
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict | tuple | list):  # Whole if loadable: quick, and a state_dict keeps _metadata.
        items = (*value, *value.values()) if isinstance(value, dict) else value
        if type(value) in (dict, collections.OrderedDict, tuple, list) and {*map(type, items)} <= kinds:
            return value
        if isinstance(value, dict):
            return {loadable(k): loadable(v) for k, v in value.items()}
        return tuple(map(loadable, value)) if isinstance(value, tuple) else list(map(loadable, value))
    raise TypeError(f"a checkpoint cannot hold a {type(value).__name__}")


def read_checkpoint(path):
    """The contents, read weights_only: a shared file cannot run code. One that needs pickle is refused."""
    import torch
    try:
        with warnings.catch_warnings(action="ignore"):  # Torch's warning on pickles: the error says enough.
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        if unsafe := re.search(r"Unsupported global: GLOBAL (\S+)", str(error)):
            raise SystemExit(f"error: {path} needs pickle to load ({unsafe[1]}), which can run any code it "
                             "holds: it is no checkpoint oni_appo.py writes, and it is not loaded")
        # Torch's reason in one line: its first sentence (what follows advises pickle or repeats).
        reason = re.split(r"(?<=\w)\. ", (str(error).splitlines() or [""])[0])[0]
        raise SystemExit(f"error: cannot read checkpoint {path} (cut short, or not a checkpoint): "
                         f"{': '.join(filter(None, (type(error).__name__, reason)))}")


def git_state(root=os.path.dirname(os.path.abspath(__file__))):
    """(commit, tracked files changed) of `root`'s code, else "unknown"; untracked results/ do not count."""
    try:
        def git(*argv):
            return subprocess.run(["git", *argv], cwd=root, capture_output=True, text=True, timeout=60,
                                  check=True).stdout.strip()
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "unknown", "unknown"
