"""What the benchmarks share: the trees a `--baseline REV` run measures side by side, and a measurement in a
process of its own."""
import json
import os
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trees(baseline: str | None) -> dict[str, str]:
    """{name: root} of the trees to measure, in the order a run alternates them: a git worktree of commit
    `baseline` ("before (REV)") where one is given, then this tree ("now"). The worktree is made once under the
    temporary directory and kept, so that every benchmark and every later run of one measures the same checkout."""
    if not baseline:
        return {"now": ROOT}
    tree = os.path.join(tempfile.gettempdir(), f"oni-baseline-{baseline}")
    if not os.path.isdir(tree):
        made = subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, baseline],
                              capture_output=True, text=True)
        if made.returncode:
            why = made.stderr.strip().rsplit("\n", 1)[-1]
            raise SystemExit(f"error: --baseline {baseline}: no worktree of it: {why}")
    return {f"before ({baseline})": tree, "now": ROOT}


def run_json(command: list[str], tree: str, what: str) -> dict:
    """Runs one measurement in a process of its own, in `tree`; returns the JSON of its output's last line."""
    result = subprocess.run(command, capture_output=True, text=True, cwd=tree)
    if result.returncode:
        raise SystemExit(f"error: {what} on {tree} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])
