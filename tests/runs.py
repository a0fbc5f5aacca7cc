"""Reading recorded runs for the offline benchmarks: each message's steps, label, pay and pay weight.

A message's pay weight is what an R of 1 would have paid it under the count normalization: 1 / N^beta summed
over its steps, N its sightings so far in the episode. It is close to the number of episodes it was seen in,
so a message on 1% of the steps, seen once an episode, can weigh more than a wall bumped into fifty times an
episode: messages.tsv's `firsts` column. A run's messages.tsv and labels.jsonl may be gzipped (.gz: results/
keeps them so); each is read by either name (learning_curves.run_file)."""
import os
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import annotator  # noqa: E402
from learning_curves import open_text, run_file  # noqa: E402
LABEL_SETS = os.path.join(ROOT, "label_sets.tsv")


@dataclass
class Message:
    steps: int
    label: int | None  # the run's LLM label, None if never labelled
    reward_now: float
    paid: float
    weight: float  # the pay weight: the `firsts` column


def read_messages(run_dir: str) -> dict[str, Message]:
    """{message: Message} of a run's messages.tsv, the empty message left out."""
    out = {}
    with open_text(run_file(run_dir, "messages.tsv")) as f:
        header = f.readline().rstrip("\n").split("\t")
        if "firsts" not in header:  # A set brought back from git from before the column (free_1m_rerun).
            raise SystemExit(f"error: {run_dir}/messages.tsv has no firsts column (a run older than the "
                             "column): read it with tests/runs.py from e76273f^, which estimates it")
        for line in f:
            row = dict(zip(header, line.rstrip("\n").split("\t")))
            if row["message"] != "(none)":
                label = int(row["label"]) if row["label"] else None
                out[row["message"]] = Message(int(row["steps"]), label, float(row["reward_now"]),
                                              float(row["paid"]), float(row["firsts"]))
    return out


def pay_shares(messages: dict[str, Message], kinds: dict) -> dict[str, float]:
    """{kind: the share of the run's pay to the messages where kinds[kind](message, Message) holds}, pay being
    R/N^beta summed over the run (`paid`), negative pay included: older Ranking runs paid some."""
    total = sum(v.paid for v in messages.values()) or 1.0
    return {kind: sum(v.paid for m, v in messages.items() if inside(m, v)) / total
            for kind, inside in kinds.items()}


def hand_labels(path: str = LABEL_SETS) -> dict[str, tuple[int, str]]:
    """{message: (label, split)} of label_sets.tsv, every split."""
    with open(path) as f:
        rows = [line.rstrip("\n").split("\t") for line in f][1:]
    return {message: (int(label), split) for message, _, label, split, *_ in rows}


def llm_labels(*run_dirs: str) -> dict[str, int]:
    """{caption: label} from the labels.jsonl of runs (captions only, the last answer wins, unknowns left
    out), read as a resume reads it: a last line that a crash or a running run cut short is skipped."""
    out = {}
    for run_dir in run_dirs:
        path = run_file(run_dir, annotator.LABELS_FILE)
        for record in annotator.read_labels(path) if os.path.exists(path) else []:
            if "caption" in record and record["label"] is not None:
                out[" ".join(record["caption"].split())] = record["label"]
    return out


def run_dirs(root: str) -> list[str]:
    """Every run under root (a directory holding messages.tsv or its .gz, and summary.json), sorted, symlinks
    followed."""
    found = []
    for here, dirs, files in os.walk(root, followlinks=True):
        if os.path.exists(run_file(here, "messages.tsv")) and "summary.json" in files:
            found.append(here)
    return sorted(found)
