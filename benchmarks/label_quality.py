"""Agreement of an LLM labeler with obvious labels on real NetHack messages.

    python benchmarks/label_quality.py --calibrate      # the embedded default (starts it)
    python benchmarks/label_quality.py --unrestricted   # as when the server cannot tokenize Yes/No
    python benchmarks/label_quality.py --llm-url URL    # any OpenAI-compatible server

The test messages are real NetHack messages whose label is obvious under the paper's goal (score:
kill monsters, collect gold, descend, level up, find things; walls, traps, hunger and death do not
help), and none is a near-copy of the completion prompt's few-shot examples (those would only
measure copying). The dev set, only for choosing annotator.BIAS_TOWARDS_NO (--calibrate), shares no
message with either. Prints agreement, the Yes-rate, which answer mode ran, and the messages it got
wrong. With completion prompts a pair's preference is derived from its two messages' labels, so the
pair figure restates the label agreement; with chat prompts it measures real pair prompts.
"""
import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import annotator  # noqa: E402
import llm_server  # noqa: E402

GOOD = [
    "You destroy the kobold zombie!", "You destroy the gnome mummy!", "You destroy the human zombie!",
    "You feel more experienced.", "You feel more confident in your weapon skills.",
    "You feel more confident in your combat skills.", "You find a hidden passage.", "You find a hidden door.",
    "A trap door opens up under you!", "There's a gaping hole under you!", "You dig a hole through the floor.",
    "There is a staircase down here.", "There is a ladder down here.", "$ - 31 gold pieces.", "$ - a gold piece.",
    "You see here a scroll labeled ELBIB YLOH.", "You see here a jade ring.", "You see here a bag.",
    "You see here an oak wand.", "You see here a long sword.", "You see here a circular amulet.",
    "You see here a blue gem.", "f - a scroll labeled FOOBIE BLETCH.", "g - a runed dagger.", "h - a lamp.",
]
BAD = [
    "It's a wall.", "It's solid stone.", "You are beginning to feel hungry.", "You are beginning to feel weak.",
    "You die...", "Never mind.", "You can't go down here.", "This door is locked.",
    "You don't have anything to eat.", "Ouch!  You bump into a door.", "You hear some noises in the distance.",
    "You faint from lack of food.", "A trapdoor in the ceiling opens and a rock falls on your head!",
    "An arrow shoots out at you!", "You see no objects here.", "There is nothing here to pick up.",
    "You stumble into a spider web.", "A bear trap closes on your foot!", "You are frozen by the floating eye's gaze!",
    "You have a sad feeling for a moment, then it passes.", "A gush of water hits you!",
    "Click! You trigger a rolling boulder trap!", "You try to move the boulder, but in vain.",
    "Wait!  That's a small mimic!", "You feel feverish.",
]
DEV_GOOD = ["You destroy the ghoul!", "You destroy the wraith!", "$ - 57 gold pieces.", "$ - 2 gold pieces.",
            "You see here a pick-axe.", "You see here a glass wand.", "You see here a violet gem.", "h - a pick-axe.",
            "i - a scroll labeled READ ME.", "You see here a crystal plate mail."]
DEV_BAD = ["There is a doorway here.", "This door is broken.", "You can't move diagonally out of an intact doorway.",
           "Your purse feels lighter.", "You hear bubbling water.", "You swap places with your kitten.",
           "Something is written here in the dust.", "You feel a wrenching sensation.",
           "You hear the splashing of a naiad.", "You are caught in a bear trap."]
SHOTS = set(re.findall(r"^Message: (.*)$", annotator.PROMPTS["label_completion"], re.M)) - {"{caption}"}
assert not SHOTS & set(GOOD + BAD + DEV_GOOD + DEV_BAD) and not set(GOOD + BAD) & set(DEV_GOOD + DEV_BAD)


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
    parser.add_argument("--calibrate", action="store_true", help="sweep BIAS_TOWARDS_NO on the dev set first")
    parser.add_argument("--unrestricted", action="store_true", help="do not restrict a base model's answer to "
                        "Yes/No (what the annotator falls back to when the server cannot tokenize)")
    args = parser.parse_args()
    chosen = annotator.BIAS_TOWARDS_NO
    server = None
    url = args.llm_url
    if url is None:
        server, url = llm_server.start()
    try:
        labeler = annotator.Labeler([url], args.model, annotator.PROMPTS, annotator.TIMEOUT_S)
        model = labeler.resolve_model()
        if args.unrestricted:
            labeler.token_ids, labeler.restricted = {}, False
        restricted = labeler.style == "completion" and labeler.restricted
        if args.calibrate and restricted:
            for bias in (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0):
                annotator.BIAS_TOWARDS_NO = bias
                acc, yes, _ = agreement(labeler, DEV_GOOD, DEV_BAD)
                print(f"dev: BIAS_TOWARDS_NO {bias:4.2f} agreement {acc:.0%} yes {yes:.0%}", flush=True)
            annotator.BIAS_TOWARDS_NO = chosen
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
    mode = ("chat prompts, answer parsed from the <label> tag" if labeler.style == "chat" else
            f"completion prompts, answer restricted to Yes/No, BIAS_TOWARDS_NO {chosen}" if restricted else
            "completion prompts, answer NOT restricted to Yes/No")
    print(f"model {model} at {url}: {mode}")
    print(f"agreement {accuracy:.1%} on {n} messages ({len(GOOD)} good, {len(BAD)} bad); "
          f"said yes to {yes_rate:.0%}; {elapsed / n * 1000:.0f} ms a label")
    source = "derived from the two labels" if labeler.style == "completion" else "asked as pairs"
    print(f"pairs (one helpful, one not; both orders; {source}): {right / len(pairs):.0%} prefer the helpful "
          f"one, {ties / len(pairs):.0%} ties, {1 - (right + ties) / len(pairs):.0%} prefer the other")
    for message, truth, answer in wrong:
        shown = "unparseable" if answer is annotator.UNPARSEABLE else answer
        print(f"  wrong: {message!r} expected {truth}, got {shown}")


if __name__ == "__main__":
    main()
