"""Agreement of an LLM labeler with obvious labels on real NetHack messages.

    python benchmarks/label_quality.py                 # the embedded default (starts it)
    python benchmarks/label_quality.py --llm-url URL   # any OpenAI-compatible server

Each message's label is obvious under the paper's goal (score: kill monsters, collect gold,
descend, level up; finding passages helps; misses, bites, walls, hunger and death do not).
Prints agreement, the Yes-rate, and the messages it got wrong.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import annotator  # noqa: E402
import llm_server  # noqa: E402

GOOD = [
    "You kill the newt!", "You kill the jackal!", "You kill the grid bug!", "You kill the sewer rat!",
    "You destroy the kobold zombie!", "You kill the gnome lord!", "You kill the hill orc!",
    "You kill the giant rat!", "You kill it!", "You destroy the gnome mummy!",
    "You see here 23 gold pieces.", "You see here 4 gold pieces.", "There are 12 gold pieces here.",
    "$ - 31 gold pieces.", "You see here 150 gold pieces.",
    "Welcome to experience level 2.", "Welcome to experience level 4.", "Welcome to experience level 7.",
    "You descend the stairs.", "There is a staircase down here.",
    "You find a hidden passage.", "You find a hidden door.",
    "You feel more confident in your weapon skills.", "You feel more confident in your combat skills.",
    "You kill the fox!",
]
BAD = [
    "It's a wall.", "It's solid stone.", "You miss the newt.", "You miss the jackal.",
    "The jackal bites!", "The newt bites!", "The grid bug bites!", "The sewer rat bites!",
    "You are beginning to feel hungry.", "You are beginning to feel weak.", "You die...",
    "Never mind.", "You can't go down here.", "You can't go up here.", "Unknown command '^M'.",
    "You don't have anything to eat.", "Ouch!  You bump into a door.", "This door is locked.",
    "You hear some noises in the distance.", "You stumble.", "You faint from lack of food.",
    "The jackal hits!", "You are hit by an arrow!", "You see no objects here.",
    "There is nothing here to pick up.",
]
# A separate development set, only for choosing annotator.NO_BIAS (--calibrate).
DEV_GOOD = ["You kill the lichen!", "You kill the gnome!", "You destroy the ghoul!", "You kill the dingo!",
            "You see here 61 gold pieces.", "You see here 2 gold pieces.", "Welcome to experience level 6.",
            "You kill the homunculus!", "There are 40 gold pieces here.", "Welcome to experience level 9."]
DEV_BAD = ["The gnome hits!", "You miss the lichen.", "The lichen touches you!", "It's a doorway.",
           "You hear a door open.", "This door is broken.", "You can't move diagonally out of an intact doorway.",
           "The dingo bites!", "You feel a little sleepy.", "You hear bubbling water."]


def agreement(labeler, good, bad):
    wrong, yes = [], 0
    for message, truth in [(m, 1) for m in good] + [(m, 0) for m in bad]:
        answer = labeler.ask(message)
        yes += answer == 1
        if answer != truth:
            wrong.append((message, truth, answer))
    n = len(good) + len(bad)
    return 1 - len(wrong) / n, yes / n, wrong


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llm-url", default=None, help="an OpenAI-compatible base URL (default: embedded)")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--calibrate", action="store_true", help="sweep NO_BIAS on the dev set first")
    args = parser.parse_args()
    NO_BIAS = annotator.NO_BIAS
    server = None
    url = args.llm_url
    if url is None:
        server, url = llm_server.start()
    try:
        labeler = annotator.Labeler([url], args.model, annotator.PROMPTS, annotator.TIMEOUT_S)
        model = labeler.resolve_model()
        if args.calibrate:
            for bias in (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0):
                annotator.NO_BIAS = bias
                acc, yes, _ = agreement(labeler, DEV_GOOD, DEV_BAD)
                print(f"dev: NO_BIAS {bias:4.2f} agreement {acc:.0%} yes {yes:.0%}", flush=True)
            annotator.NO_BIAS = NO_BIAS
        start = time.time()
        accuracy, yes_rate, wrong = agreement(labeler, GOOD, BAD)
        elapsed = time.time() - start
        pairs = [(g, b) for g, b in zip(GOOD, BAD)] + [(b, g) for g, b in zip(GOOD[::-1], BAD)]
        answers = [labeler.ask(pair) for pair in pairs]
        right = sum(a == (1 if pair[0] in GOOD else 2) for pair, a in zip(pairs, answers))
        ties = sum(a is None for a in answers)
    finally:
        if server is not None:
            llm_server.stop(server)
    n = len(GOOD) + len(BAD)
    print(f"model {model} ({labeler.style} prompts) at {url}, NO_BIAS {annotator.NO_BIAS}")
    print(f"agreement {accuracy:.1%} on {n} messages ({len(GOOD)} good, {len(BAD)} bad); "
          f"said yes to {yes_rate:.0%}; {elapsed / n * 1000:.0f} ms a label")
    print(f"pairs (one helpful, one not; both orders): {right / len(pairs):.0%} prefer the helpful one, "
          f"{ties / len(pairs):.0%} ties, {1 - (right + ties) / len(pairs):.0%} prefer the other")
    for message, truth, answer in wrong:
        shown = "unparseable" if answer is annotator.UNPARSEABLE else answer
        print(f"  wrong: {message!r} expected {truth}, got {shown}")


if __name__ == "__main__":
    main()
