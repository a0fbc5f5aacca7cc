"""The measurement scripts still run against the code they measure (their figures are in the README)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_profile_update_times_every_stage_of_a_real_update():
    result = subprocess.run([sys.executable, "benchmarks/profile_update.py", "--batch-size", "64", "--updates", "2"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.strip("|").split("|") for line in result.stdout.splitlines() if line.startswith("| ") and "ms" not in line]
    assert [r[0].strip() for r in rows] == ["encoder forward (inside forward + loss)", "GRU unroll + V-trace + loss (forward)",
                                            "backward", "clip + Adam step", "weights to the acting agent"]
    stages_ms = [float(r[1]) for r in rows]
    update_ms = float(result.stdout.split("median of 2: ")[1].split(" ms")[0])
    assert all(ms >= 0 for ms in stages_ms) and abs(sum(stages_ms) - update_ms) < 1  # the stages make the update
