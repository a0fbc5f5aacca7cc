"""How right an LLM labeler is on the messages an agent sees: per message, and per step.

    python benchmarks/label_quality.py                   # the embedded labeler (starts it) on the test sets
    python benchmarks/label_quality.py --calibrate --baseline  # THRESHOLD chosen on dev first; the old labeler after
    python benchmarks/label_quality.py --calibrate --demos 3  # another number of demonstrations of each label
    python benchmarks/label_quality.py --greedy          # the embedded server without log-probabilities
    python benchmarks/label_quality.py --cost 60         # score vs greedy token, side by side, on 60 test messages
    python benchmarks/label_quality.py --llm-url URL     # any OpenAI-compatible server (chat prompts too)

Sets. `label_sets.tsv`: messages of this repo's recorded runs (results/**/messages.tsv), labelled by hand where
the paper's goal (score: kill monsters, collect gold, descend, level up, find things) makes the label obvious,
ambiguous ones left out (a pet dropping gold, a corpse, a door that opens, helpful and harmful in one message);
`steps` sums the steps that showed a message over the runs, so the figures weigh messages as young agents see
them. Split by near-copy group (`group`: the message with names, numbers, letters and item lists replaced, per
sentence; a message whose sentences' groups fall on both sides is left out): no test message nor a near-copy of
one is in the dev split, which is the annotator's demonstration pool and the only set choices are made on. Dev
is asked two ways: its own near-copy group left out of the pool (as a new message is asked), and only the message
itself left out (as training asks its frequent messages, near-copies in the pool): the latter is printed as the
production check, a check of the training distribution, not a test (it is the pool). `old50`: the README's earlier 50 messages (GOOD, BAD), one
step each, none in the dev split verbatim (some have near-copies there).

Figures: agreement (per distinct message), the share of unhelpful steps labelled helpful (paid), the share of
helpful steps paid, ms a label; for completion prompts also pairs (one helpful, one not, both orders) whose
preference comes from the two scores. `--baseline` adds the labeler as it was before demonstrations and scores
(fixed prompt, one greedy token, No favoured by 0.25), on a server without --logits_all, timed in the same run.
"""
import argparse
import os
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
BASELINE_PROMPT = (  # the completion prompt before demonstrations (commit e6b0946)
    "NetHack messages, and whether each one reports progress (killing monsters, gold, descending, levelling up, "
    "finding things):\n" "Message: You kill the gecko!\nProgress: Yes\n" "Message: You hear a door open.\nProgress: No\n"
    "Message: You see here 8 gold pieces.\nProgress: Yes\n" "Message: The gecko bites!\nProgress: No\n"
    "Message: Welcome to experience level 3.\nProgress: Yes\n" "Message: You miss the gecko.\nProgress: No\n"
    "Message: You have a little trouble lifting the boulder.\nProgress: No\n" "Message: {caption}\nProgress:")


def load_sets(path=annotator.DEMOS_FILE):
    """{"dev": rows, "test": rows, "old50": rows}, a row (message, steps, label, group)."""
    sets = {"dev": [], "test": [], "old50": [(m, 1, 1, m) for m in GOOD] + [(m, 1, 0, m) for m in BAD]}
    with open(path) as f:
        for line in list(f)[1:]:
            message, steps, label, split, group = line.rstrip("\n").split("\t")
            sets[split].append((message, int(steps), int(label), group))
    dev = {m for m, *_ in sets["dev"]}
    assert not dev & {m for name in ("test", "old50") for m, *_ in sets[name]}, "a test message in the dev split"
    assert not {g for *_, g in sets["dev"]} & {g for *_, g in sets["test"]}, "a test near-copy in the dev split"
    return sets


def scores(labeler, rows, leave_out=None):
    """Each message's score (completion prompts) or label (chat prompts), and the seconds it all took. The
    demonstration pool lacks, per message, its near-copy group (leave_out="group": dev as a new message sees it)
    or only the message itself (leave_out="message": dev as training sees a frequent message, its near-copies in
    the pool); the test sets are asked with the whole pool (leave_out=None), which holds none of them."""
    pool, out, start = labeler.demos if labeler.style == "completion" else [], [], time.time()
    group_of = {m: g for m, _, _, g in rows}
    for message, *_ in rows:
        if labeler.style == "chat":
            out.append(labeler.ask(message))
            continue
        labeler.demos = [d for d in pool if leave_out is None or d[0] != message and (
            leave_out == "message" or group_of.get(d[0]) != group_of[message])]
        out.append(labeler.score(message, 0))
    labeler.demos = pool
    return out, time.time() - start


def figures(rows, labels):
    """(agreement, share of unhelpful steps paid, share of helpful steps paid); unparseable counts as not paid."""
    steps = {truth: sum(s for _, s, t, _ in rows if t == truth) or 1 for truth in (0, 1)}
    paid = {truth: sum(s for (_, s, t, _), y in zip(rows, labels) if t == truth and y == 1) for truth in (0, 1)}
    agreement = sum(y == t for (_, _, t, _), y in zip(rows, labels)) / len(rows)
    return agreement, paid[0] / steps[0], paid[1] / steps[1]


def to_labels(labeler, values, threshold):
    if labeler.style == "chat":
        return values
    return [v if v is annotator.UNPARSEABLE else int(v > threshold) for v in values]


def pair_figures(rows, values, tie_margin):
    """Pairs of one helpful and one unhelpful message, both orders, preferred by score: (right, ties, wrong)."""
    good = [v for (_, _, t, _), v in zip(rows, values) if t == 1 and v is not annotator.UNPARSEABLE]
    bad = [v for (_, _, t, _), v in zip(rows, values) if t == 0 and v is not annotator.UNPARSEABLE]
    diffs = [g - b for g in good for b in bad] or [0.0]
    right = sum(d >= tie_margin for d in diffs) / len(diffs)
    ties = sum(abs(d) < tie_margin for d in diffs) / len(diffs)
    return right, ties, max(0.0, 1 - right - ties)


def calibrate(labeler, dev, measured):
    """THRESHOLD, from dev asked two ways: as a new message is (its near-copy group out of the pool) and as
    training asks a frequent one (only itself out; the production check). Of the thresholds that pay at most 5% of
    the unhelpful steps in both (the goal; all if none does), the one with the most agreement + helpful steps paid
    summed over both: leave-group-out alone chose 0.84, above "You kill the newt!"'s 0.81 in production. The
    pairs' sweep over TIE_MARGIN (leave-group-out) is printed, to choose it by. `measured` keeps the scores."""
    for leave_out in ("group", "message"):
        measured["dev", leave_out] = scores(labeler, dev, leave_out)
    ways = [measured["dev", leave_out][0] for leave_out in ("group", "message")]
    known = sorted({v for values in ways for v in values if v is not annotator.UNPARSEABLE})
    candidates = [(a + b) / 2 for a, b in zip(known, known[1:])]
    results = {t: [figures(dev, to_labels(labeler, values, t)) for values in ways] for t in candidates}
    allowed = [t for t in candidates if all(r[1] <= 0.05 for r in results[t])] or candidates
    threshold = max(allowed, key=lambda t: sum(r[0] + r[2] for r in results[t]))
    for t in sorted({round(t, 1) for t in candidates} | {round(threshold, 2)}):
        print(f"dev: THRESHOLD {t:6.2f}: " + "; ".join(
            f"{way}: agreement {a:.0%}, unhelpful steps paid {u:.1%}, helpful steps paid {h:.0%}" for way, (a, u, h)
            in zip(("group out", "message out"), (figures(dev, to_labels(labeler, v, t)) for v in ways))))
    for margin in (0.0, 0.1, 0.25, 0.5, 1.0, 2.0):
        print(f"dev: TIE_MARGIN {margin:4.2f}: pairs prefer the helpful one {{:.0%}}, ties {{:.0%}}, the other "
              f"{{:.0%}}".format(*pair_figures(dev, ways[0], margin)))
    print(f"dev: chosen THRESHOLD {threshold:.2f}")
    return threshold


CHECKS = (  # (what is measured, its rows, what the pool lacks per message)
    ("test", "test", None), ("old50", "old50", None),
    # Not a test set (the pool labels itself): training asks its frequent messages with their near-copies in the
    # pool, which leave-group-out dev never does; "You kill the newt!" at 0.81 passed dev and failed here.
    ("the production check (dev, whole pool but the message: training's distribution, not a test)", "dev", "message"))


SPOT = ("You kill the newt!", "You kill the jackal!", "You kill the kobold!")  # paid nothing at 2 demonstrations


def report(name, labeler, sets, threshold, measured=None):
    """The figures of each of CHECKS; `measured` holds scores already asked, by (split, leave_out)."""
    for set_name, split, leave_out in CHECKS:
        rows = sets[split]
        values, elapsed = (measured or {}).get((split, leave_out)) or scores(labeler, rows, leave_out)
        labels = to_labels(labeler, values, threshold)
        agreement, unhelpful, helpful = figures(rows, labels)
        if labeler.style == "completion":  # known once the server has answered
            name = name.split(", ")[0].rstrip(")") + (", score)" if labeler.scored else ", greedy Yes/No)")
        print(f"{name} on {set_name} ({len(rows)} messages, {sum(s for _, s, _, _ in rows):,} steps): agreement "
              f"{agreement:.1%}, unhelpful steps paid {unhelpful:.1%}, helpful steps paid {helpful:.1%}, "
              f"{elapsed / len(rows) * 1000:.0f} ms a label", flush=True)
        if labeler.style == "completion":
            print("  pairs by score (one helpful, one not): {:.0%} prefer the helpful one, {:.0%} ties, {:.0%} "
                  "the other".format(*pair_figures(rows, values, annotator.TIE_MARGIN)))
        if leave_out == "message" and labeler.style == "completion":  # verbatim in the pool, as training asks them
            print("  as training asks these dev messages (the whole pool, themselves in it): " + ", ".join(
                f"{m!r} {v if v is annotator.UNPARSEABLE else round(v, 2)}" for m, v in
                zip(SPOT, [labeler.score(m, 0) for m in SPOT])))
        wrong = sorted(((s, m, t, y) for (m, s, t, _), y in zip(rows, labels) if y != t), reverse=True)
        for steps, message, truth, label in wrong[:12]:
            shown = "unparseable" if label is annotator.UNPARSEABLE else label
            print(f"    wrong: {message!r} ({steps:,} steps) expected {truth}, got {shown}")


def labeler_at(url, model, prompts=annotator.PROMPTS, scored=True):
    labeler = annotator.Labeler([url], model, prompts, annotator.TIMEOUT_S, scored)
    labeler.resolve_model()
    return labeler


def cost(rows):
    """What log-probabilities cost (only Ranking asks for them): two embedded servers, one with --logits_all, one
    thread each, asked each message in turn (the scored one first); the labels should be the same."""
    servers = [llm_server.start(scored=scored, threads=1) for scored in (True, False)]
    try:
        labelers = [labeler_at(url, None, scored=scored) for (_, url), scored in zip(servers, (True, False))]
        seconds, same = [0.0, 0.0], 0
        for message, *_ in rows:
            labels = []
            for i, labeler in enumerate(labelers):
                started = time.perf_counter()
                labels.append(labeler.ask(message))
                seconds[i] += time.perf_counter() - started
            same += labels[0] == labels[1]
    finally:
        for process, _ in servers:
            llm_server.stop(process)
    print(f"{len(rows)} test messages: score {seconds[0] / len(rows) * 1000:.0f} ms a label, greedy token "
          f"{seconds[1] / len(rows) * 1000:.0f} ms ({seconds[0] / seconds[1]:.1f}x); the same label on {same}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llm-url", default=None, help="an OpenAI-compatible base URL (default: embedded)")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--calibrate", action="store_true", help="choose THRESHOLD on the dev split first")
    parser.add_argument("--baseline", action="store_true", help="also the labeler before demonstrations and scores")
    parser.add_argument("--demos", type=int, default=annotator.DEMOS_PER_LABEL,
                        help="demonstrations of each label in a completion prompt (default: DEMOS_PER_LABEL)")
    parser.add_argument("--greedy", action="store_true", help="the embedded server without log-probabilities "
                        "(faster): a greedy Yes/No, the same decision at THRESHOLD, no score for pairs")
    parser.add_argument("--cost", type=int, metavar="N", help="only time score vs greedy token on N test messages")
    args = parser.parse_args()
    sets = load_sets()
    annotator.DEMOS_PER_LABEL = args.demos
    if args.cost:
        return cost(sets["test"][:args.cost])
    server, url = (None, args.llm_url) if args.llm_url else llm_server.start(scored=not args.greedy)
    try:
        labeler = labeler_at(url, args.model, scored=not args.greedy)
        mode = ("chat prompts, label parsed from the <label> tag" if labeler.style == "chat" else
                f"completion prompts, {annotator.DEMOS_PER_LABEL} demonstrations of each label")
        print(f"model {labeler.model} at {url}: {mode}", flush=True)
        measured = {}
        threshold = calibrate(labeler, sets["dev"], measured) if args.calibrate and labeler.style == "completion" \
            else annotator.THRESHOLD
        annotator.THRESHOLD = threshold
        report(f"labeler (THRESHOLD {threshold:.2f})", labeler, sets, threshold, measured)
    finally:
        if server is not None:
            llm_server.stop(server)
    if args.baseline:  # after, on a server of its own, timed beside the labeler above
        server, url = llm_server.start(scored=False)
        try:
            baseline = labeler_at(url, args.model, {**annotator.PROMPTS, "label_completion": BASELINE_PROMPT})
            baseline.scored, annotator.THRESHOLD = False, 0.25  # the greedy token's bias then: No +0.25
            report("baseline (fixed prompt, greedy token)", baseline, sets, 0.25)
        finally:
            llm_server.stop(server)

if __name__ == "__main__":
    main()
