"""What the benchmarks share: the trees a `--baseline REV` run measures side by side, and a measurement in a
process of its own."""
import json
import os
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trees(baseline: str | None) -> dict[str, str]:
    """{name: root} of the trees to measure, in the order a run alternates them: a git worktree of commit
    `baseline` ("before (REV)") where one is given, then this tree ("now"). The worktree, named by the
    commit's hash, is made once under the temporary directory and kept, so that every benchmark and every
    later run of one measures the same checkout; a branch or HEAD~1 that has moved gets its new commit's."""
    if not baseline:
        return {"now": ROOT}
    resolved = git("rev-parse", "--verify", f"{baseline}^{{commit}}")
    if resolved.returncode:
        fail(baseline, "not a commit git knows", resolved)
    commit = resolved.stdout.strip()
    tree = os.path.join(tempfile.gettempdir(), f"oni-baseline-{commit}")
    if not os.path.isdir(tree):
        git("worktree", "prune")  # one whose folder is gone (a cleared /tmp) may still be registered
        made = git("worktree", "add", "--detach", tree, commit)
        if made.returncode:
            fail(baseline, "no worktree of it", made)
    head, changed = git("rev-parse", "HEAD", where=tree), git("status", "--porcelain", "-uno", where=tree)
    if head.stdout.strip() != commit or changed.returncode or changed.stdout:  # half made (killed) or edited
        raise SystemExit(f"error: --baseline {baseline}: {tree} is not a clean checkout of {commit}: "
                         f"remove it (git worktree remove --force {tree}) and run again")
    return {f"before ({baseline})": tree, "now": ROOT}


def git(*args, where=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", where, *args], capture_output=True, text=True)


def fail(baseline, what, result):  # one line with all of git's message: its last line may be only advice
    why = "; ".join(result.stderr.strip().splitlines())
    raise SystemExit(f"error: --baseline {baseline}: {what}: {why}")


def run_json(command: list[str], tree: str, what: str) -> dict:
    """Runs one measurement in a process of its own, in `tree`; returns the JSON of its output's last line."""
    result = subprocess.run(command, capture_output=True, text=True, cwd=tree)
    if result.returncode:
        raise SystemExit(f"error: {what} on {tree} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])
