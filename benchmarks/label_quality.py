"""How right an LLM labeler is on the messages an agent sees: per message, and per step.

    python benchmarks/label_quality.py                   # the embedded labeler (starts it) on the test sets
    python benchmarks/label_quality.py --calibrate --baseline  # THRESHOLD chosen on dev, then the old labeler
    python benchmarks/label_quality.py --calibrate --per-label 3  # 3 demonstrations of each label
    python benchmarks/label_quality.py --greedy          # the embedded server without log-probabilities
    python benchmarks/label_quality.py --cost 60         # score vs greedy token side by side, 60 messages
    python benchmarks/label_quality.py --llm-url URL     # any OpenAI-compatible server (chat prompts too)
    python benchmarks/label_quality.py --demos RUN/labels.jsonl  # another demonstration pool (as --demos)
    python benchmarks/label_quality.py --run RUN_DIR     # a run's own labels.jsonl against the hand labels

Sets. `label_sets.tsv` (beside the method files: its dev split is the embedded labeler's demonstration pool):
messages of this repo's recorded runs (results/**/messages.tsv), labelled by hand where the paper's goal
(score: kill monsters, collect gold, descend, level up, find things) makes the label obvious, ambiguous ones
left out (a corpse, a door that opens, helpful and harmful in one message); the pet's doings are not the
player's progress. `steps` sums the steps that showed a message over the runs, `firsts` its pay weight (what R
= 1 would have paid it under the count normalization, ~ the episodes it was seen in; tests/runs.py), so the
figures weigh messages as young agents see them and as the policy is paid for them. `goal`: the goal's own
events and their near-misses (`kind`), written by the goal and kept out of the pool, each counted once. Split
by near-copy group (`group`: the message with names, numbers, letters and item lists replaced, per sentence; a
message whose sentences' groups fall on both sides is left out): no test message nor a near-copy of one is in
the dev split, which is the annotator's demonstration pool and the only set choices are made on. Dev is asked
two ways: its own near-copy group left out of the pool (as a new message is asked), and only the message
itself left out (as training asks its frequent messages, near-copies in the pool): the latter is printed as
the production check, a check of the training distribution, not a test (it is the pool). `old50`: the README's
earlier 50 messages (GOOD, BAD), one step each, none in the dev split verbatim (some have near-copies there).

Figures: agreement (per distinct message), the share of unhelpful steps labelled helpful (paid), the share of
helpful steps paid, the same two by pay weight, ms a label; beside the labeler, what carries its knowledge:
the same pool as a k-nearest-neighbour lookup by trigrams (k = 1, 3; no LLM) and the model with no
demonstrations; for completion prompts also pairs (one helpful, one not, both orders) whose preference comes
from the two scores. `--baseline` adds the labeler as it was before demonstrations and scores (fixed prompt,
one greedy token, No favoured by 0.25), on a server without --logits_all, timed in the same run.
"""
import argparse
import collections
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # the method; tests/runs.py
import annotator  # noqa: E402
import llm_server  # noqa: E402
import runs  # noqa: E402

GOOD = [
    "You destroy the kobold zombie!", "You destroy the gnome mummy!", "You destroy the human zombie!",
    "You feel more experienced.", "You feel more confident in your weapon skills.",
    "You feel more confident in your combat skills.", "You find a hidden passage.", "You find a hidden door.",
    "A trap door opens up under you!", "There's a gaping hole under you!",
    "You dig a hole through the floor.", "There is a staircase down here.", "There is a ladder down here.",
    "$ - 31 gold pieces.", "$ - a gold piece.", "You see here a scroll labeled ELBIB YLOH.",
    "You see here a jade ring.", "You see here a bag.", "You see here an oak wand.",
    "You see here a long sword.", "You see here a circular amulet.", "You see here a blue gem.",
    "f - a scroll labeled FOOBIE BLETCH.", "g - a runed dagger.", "h - a lamp.",
]
BAD = [
    "It's a wall.", "It's solid stone.", "You are beginning to feel hungry.",
    "You are beginning to feel weak.", "You die...", "Never mind.", "You can't go down here.",
    "This door is locked.", "You don't have anything to eat.", "Ouch!  You bump into a door.",
    "You hear some noises in the distance.", "You faint from lack of food.",
    "A trapdoor in the ceiling opens and a rock falls on your head!", "An arrow shoots out at you!",
    "You see no objects here.", "There is nothing here to pick up.", "You stumble into a spider web.",
    "A bear trap closes on your foot!", "You are frozen by the floating eye's gaze!",
    "You have a sad feeling for a moment, then it passes.", "A gush of water hits you!",
    "Click! You trigger a rolling boulder trap!", "You try to move the boulder, but in vain.",
    "Wait!  That's a small mimic!", "You feel feverish.",
]
BASELINE_PROMPT = (  # the completion prompt before demonstrations (commit e6b0946)
    "NetHack messages, and whether each one reports progress (killing monsters, gold, descending, levelling "
    "up, finding things):\n" "Message: You kill the gecko!\nProgress: Yes\n"
    "Message: You hear a door open.\nProgress: No\n"
    "Message: You see here 8 gold pieces.\nProgress: Yes\n" "Message: The gecko bites!\nProgress: No\n"
    "Message: Welcome to experience level 3.\nProgress: Yes\n" "Message: You miss the gecko.\nProgress: No\n"
    "Message: You have a little trouble lifting the boulder.\nProgress: No\n" "Message: {caption}\nProgress:")


Row = collections.namedtuple("Row", "message steps label group firsts kind")
# every loaded message's near-copy group: a sample of dev must leave out groups of the whole pool
GROUP_OF = {}


def load_sets(path=None):
    """{"dev", "test", "goal", "old50"}: lists of Row. Asserts that no test or goal message is in the dev
    split and that no test near-copy group is (goal messages may share a group with the pool: that is what it
    generalizes)."""
    sets = {"dev": [], "test": [], "goal": [], "old50": [Row(m, 1, 1, m, 1.0, "") for m in GOOD] +
            [Row(m, 1, 0, m, 1.0, "") for m in BAD]}
    with open(path or annotator.DEMOS_FILE) as f:
        header, *lines = [line.rstrip("\n").split("\t") for line in f]
    for line in lines:
        row = dict(zip(header, line))
        once = row["split"] == "goal"  # a goal message counts once, whatever the runs showed of it
        sets[row["split"]].append(Row(row["message"], 1 if once else int(row["steps"]), int(row["label"]),
                                      row["group"], 1.0 if once else float(row["firsts"]),
                                      row.get("kind", "")))
    GROUP_OF.update({r.message: r.group for rows in sets.values() for r in rows})
    dev = {r.message for r in sets["dev"]}
    assert not dev & {r.message for name in ("test", "goal", "old50") for r in sets[name]}, (
        "a test message in dev")
    assert not {r.group for r in sets["dev"]} & {r.group for r in sets["test"]}, (
        "a test near-copy in the dev split")
    return sets


def pool_without(pool, rows, message, leave_out):
    """The pool a message is asked with: without its near-copy group (leave_out="group": dev as a new message
    sees it), without only itself (leave_out="message": dev as training asks a frequent message, its
    near-copies in the pool), whole (None: the test and goal sets, which it does not hold), or empty ("all":
    no demonstrations)."""
    if leave_out == "all":
        return []
    group_of = {**{r.message: r.group for r in rows}, **GROUP_OF}
    return [d for d in pool if leave_out is None or d[0] != message and (
        leave_out == "message" or group_of.get(d[0]) != group_of[message])]


def scores(labeler, rows, leave_out=None):
    """Each message's score (completion prompts) or label (chat prompts), and the seconds it all took."""
    pool, out, start = labeler.demos if labeler.style == "completion" else [], [], time.time()
    for row in rows:
        if labeler.style == "chat":
            out.append(labeler.ask(row.message))
            continue
        labeler.demos = pool_without(pool, rows, row.message, leave_out)
        out.append(labeler.score(annotator.as_asked(row.message), 0))  # as Labeler.ask asks it
    labeler.demos = pool
    return out, time.time() - start


def nearest_labels(pool, rows, k, leave_out=None):
    """The pool as a k-nearest-neighbour lookup, no LLM: the majority label of the k messages nearest by
    trigrams (the annotator's similarity), each message asked with the pool scores() would give it; (labels,
    seconds)."""
    out, start = [], time.time()
    for row in rows:
        grams = annotator.trigrams(row.message)
        near = sorted(pool_without(pool, rows, row.message, leave_out),
                      key=lambda d: annotator.similarity(grams, d))[-k:]
        out.append(int(sum(d[1] for d in near) * 2 > len(near)))
    return out, time.time() - start


def figures(rows, labels):
    """(agreement, unhelpful steps paid, helpful steps paid, unhelpful pay paid, helpful pay paid): the shares
    of the steps and of the pay weight of each true class that the labels call helpful; unparseable is not
    paid."""
    shares = []
    for weight in (lambda r: r.steps, lambda r: r.firsts):
        total = {truth: sum(weight(r) for r in rows if r.label == truth) or 1 for truth in (0, 1)}
        paid = {truth: sum(weight(r) for r, y in zip(rows, labels) if r.label == truth and y == 1)
                for truth in (0, 1)}
        shares += [paid[0] / total[0], paid[1] / total[1]]
    return (sum(y == r.label for r, y in zip(rows, labels)) / len(rows), *shares)


def to_labels(labeler, values, threshold):
    if labeler.style == "chat":
        return values
    return [v if v is annotator.UNPARSEABLE else int(v > threshold) for v in values]


def pair_figures(rows, values, tie_margin):
    """Pairs of one helpful and one unhelpful message, both orders, preferred by score: (right, ties,
    wrong)."""
    good = [v for r, v in zip(rows, values) if r.label == 1 and v is not annotator.UNPARSEABLE]
    bad = [v for r, v in zip(rows, values) if r.label == 0 and v is not annotator.UNPARSEABLE]
    diffs = [g - b for g in good for b in bad] or [0.0]
    right = sum(d >= tie_margin for d in diffs) / len(diffs)
    ties = sum(abs(d) < tie_margin for d in diffs) / len(diffs)
    return right, ties, max(0.0, 1 - right - ties)


def calibration_sample(dev, per_label):
    """A cheaper dev to calibrate on: of each label, the 2/3 of per_label with the most steps (they decide the
    shares of steps), the rest drawn at random (seed 0)."""
    rng, sample = random.Random(0), []
    for label in (0, 1):
        rows = sorted((r for r in dev if r.label == label), key=lambda r: -r.steps)
        top = 2 * per_label // 3
        sample += rows[:top] + rng.sample(rows[top:], max(0, min(per_label, len(rows)) - top))
    return sample


def calibrate(labeler, dev, measured, leave_outs=("group", "message")):
    """THRESHOLD, from dev asked each of leave_outs' ways: as a new message is ("group": its near-copy group
    out of the pool), as training asks a frequent one with near-copies in the pool ("message": only itself
    out), or as a run asks the pool's own messages (None: the whole pool). Of the thresholds that pay at most
    5% of the unhelpful steps in every way (the goal; all if none does), the one with the most agreement +
    helpful steps paid summed over them: leave-group-out alone chose 0.84, above "You kill the newt!"'s 0.81
    in production. The pairs' sweep over TIE_MARGIN (the first way) is printed, to choose it by. `measured`
    keeps the scores."""
    for leave_out in leave_outs:
        measured["dev", leave_out] = scores(labeler, dev, leave_out)
    ways = [measured["dev", leave_out][0] for leave_out in leave_outs]
    known = sorted({v for values in ways for v in values if v is not annotator.UNPARSEABLE})
    candidates = [(a + b) / 2 for a, b in zip(known, known[1:])]
    results = {t: [figures(dev, to_labels(labeler, values, t)) for values in ways] for t in candidates}
    allowed = [t for t in candidates if all(r[1] <= 0.05 for r in results[t])] or candidates
    threshold = max(allowed, key=lambda t: sum(r[0] + r[2] for r in results[t]))
    for t in sorted({round(t, 1) for t in candidates} | {round(threshold, 2)}):
        print(f"dev: THRESHOLD {t:6.2f}: " + "; ".join(
            f"{way}: agreement {a:.0%}, unhelpful steps paid {u:.1%}, helpful steps paid {h:.0%}"
            for way, (a, u, h, *_) in zip(leave_outs,
                                          (figures(dev, to_labels(labeler, v, t)) for v in ways))))
    for margin in (0.0, 0.1, 0.25, 0.5, 1.0, 2.0):
        print(f"dev: TIE_MARGIN {margin:4.2f}: pairs prefer the helpful one {{:.0%}}, ties {{:.0%}}, the "
              f"other {{:.0%}}".format(*pair_figures(dev, ways[0], margin)))
    print(f"dev: chosen THRESHOLD {threshold:.2f}")
    return threshold


CHECKS = (  # (what is measured, its rows, what the pool lacks per message)
    ("test", "test", None), ("goal", "goal", None), ("old50", "old50", None),
    # Not a test set (the pool labels itself): training asks its frequent messages with their near-copies in
    # the pool, which leave-group-out dev never does; "You kill the newt!" at 0.81 passed dev and failed here.
    ("the production check (dev, whole pool but the message: training's distribution, not a test)", "dev",
     "message"))


def line(name, rows, labels, elapsed):
    agreement, unhelpful, helpful, unhelpful_pay, helpful_pay = figures(rows, labels)
    return (f"  {name:<34} agreement {agreement:6.1%}; paid: unhelpful steps {unhelpful:5.1%}, helpful steps "
            f"{helpful:6.1%}, unhelpful pay {unhelpful_pay:5.1%}, helpful pay {helpful_pay:6.1%}; "
            f"{elapsed / len(rows) * 1000:6.1f} ms a label")


def misses(rows, labels, limit=None):
    wrong = sorted(((r.steps, r.message, r.label, y, r.kind) for r, y in zip(rows, labels) if y != r.label),
                   reverse=True)
    for steps, message, truth, label, kind in wrong[:limit]:
        shown = "unparseable" if label is annotator.UNPARSEABLE else label
        print(f"    wrong: {message!r} ({kind or f'{steps:,} steps'}) expected {truth}, got {shown}")


def report(name, labeler, sets, threshold, measured=None, baselines=False, only=None, bare=True):
    """The figures of each of CHECKS (those of `only` if given); `measured` holds scores already asked, by
    (split, leave_out). With baselines, beside the labeler: its pool as a 1- and 3-nearest-neighbour lookup
    and the model with no demonstrations."""
    for set_name, split, leave_out in CHECKS:
        if only and split not in only:
            continue
        rows = sets[split]
        values, elapsed = (measured or {}).get((split, leave_out)) or scores(labeler, rows, leave_out)
        labels = to_labels(labeler, values, threshold)
        if labeler.style == "completion":  # known once the server has answered
            name = name.split(", ")[0].rstrip(")") + (", score)" if labeler.wants_scores
                                                      else ", greedy Yes/No)")
        print(f"on {set_name} ({len(rows)} messages, {sum(r.steps for r in rows):,} steps, pay weight "
              f"{sum(r.firsts for r in rows):,.0f}):\n" + line(name, rows, labels, elapsed), flush=True)
        if baselines and labeler.style == "completion":
            for k in (1, 3):
                print(line(f"{k}-nearest lookup of the pool, no LLM", rows,
                           *nearest_labels(labeler.demos, rows, k, leave_out)))
            if bare:
                values_bare, elapsed = scores(labeler, rows, "all")
                print(line("the model, no demonstrations", rows, to_labels(labeler, values_bare, threshold),
                           elapsed),
                      flush=True)
        if labeler.style == "completion":
            print("  pairs by score (one helpful, one not): {:.0%} prefer the helpful one, {:.0%} ties, "
                  "{:.0%} the other".format(*pair_figures(rows, values, annotator.TIE_MARGIN)))
        if set_name == "goal":  # per kind of event, and every miss
            for kind in dict.fromkeys(r.kind for r in rows):
                right = [y == r.label for r, y in zip(rows, labels) if r.kind == kind]
                print(f"    {kind:<34} {sum(right)}/{len(right)}")
        misses(rows, labels, None if set_name == "goal" else 12)


def labeler_at(url, model, prompts=annotator.PROMPTS, scored=True, demos=None):
    labeler = annotator.Labeler([url], model, prompts, annotator.TIMEOUT_S, scored, demos)
    labeler.resolve_model()
    return labeler


def cost(rows):
    """What a score costs beside a label (Ranking's pairs compare scores): one embedded server, one thread,
    each message asked for its label (one restricted greedy token), then its score (bisected on the same
    prompt, which the server's cache holds); the two should fall on the same side of THRESHOLD."""
    process, url = llm_server.start(threads=1)
    try:
        labelers = [labeler_at(url, None, scored=scored) for scored in (True, False)]
        seconds, same = [0.0, 0.0], 0
        for message, *_ in rows:  # (a Row)
            started = time.perf_counter()
            label = labelers[1].ask(message)
            seconds[1] += (middle := time.perf_counter()) - started
            score = labelers[0].score(annotator.as_asked(message), 0)
            seconds[0] += time.perf_counter() - middle  # the bisections alone: the first probe is cached
            same += score is not annotator.UNPARSEABLE and (score > annotator.THRESHOLD) == label
    finally:
        llm_server.stop(process)
    print(f"{len(rows)} test messages: a label {seconds[1] / len(rows) * 1000:.0f} ms, its score's "
          f"bisections {seconds[0] / len(rows) * 1000:.0f} ms more; the same side of THRESHOLD on {same}")


def check_run(run_dir, sets):
    """A run's own labels (labels.jsonl, as the annotator gave them in the run) against the hand labels of
    every set, per kind, and where the run's pay went (messages.tsv): no LLM is asked."""
    labels, messages = runs.llm_labels(run_dir), runs.read_messages(run_dir)
    # the kinds win over old50
    hand = {r.message: r for name in ("old50", "dev", "test", "goal") for r in sets[name]}
    known = [(hand[m], label) for m, label in labels.items() if m in hand]
    print(f"{run_dir}: {len(labels)} captions labelled, {len(known)} of them hand-labelled: agreement "
          f"{sum(r.label == y for r, y in known) / max(1, len(known)):.1%}")
    kinds = collections.defaultdict(list)
    for r, y in known:
        kinds[r.kind or "(unkinded)"].append(r.label == y)
    for kind, right in sorted(kinds.items()):
        print(f"    {kind:<34} {sum(right)}/{len(right)}")
    for r, y in known:
        if r.label != y:
            print(f"    wrong: {r.message!r} expected {r.label}, got {y}")
    shares = runs.pay_shares(messages, {
        "hand-unhelpful messages": lambda m, _: m in hand and hand[m].label == 0,
        "hand-helpful messages": lambda m, _: m in hand and hand[m].label == 1,
        "messages in no set": lambda m, _: m not in hand})
    for name, share in shares.items():
        print(f"  share of the run's pay to {name}: {share:.1%}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llm-url", default=None, help="an OpenAI-compatible base URL (default: embedded)")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--calibrate", action="store_true", help="choose THRESHOLD on the dev split first")
    parser.add_argument("--baseline", action="store_true",
                        help="also the labeler before demonstrations and scores")
    parser.add_argument("--demos", default=None, help="the demonstration pool, as oni_appo.py's --demos")
    parser.add_argument("--per-label", type=int, default=annotator.DEMOS_PER_LABEL,
                        help="demonstrations of each label in a completion prompt (default: DEMOS_PER_LABEL)")
    parser.add_argument("--greedy", action="store_true", help="the embedded server without log-probabilities "
                        "(faster): a greedy Yes/No, the same decision at THRESHOLD, no score for pairs")
    parser.add_argument("--cost", type=int, metavar="N",
                        help="only time score vs greedy token on N test messages")
    parser.add_argument("--run", metavar="RUN_DIR", help="only a run's own labels against the hand labels")
    parser.add_argument("--calibrate-on", choices=("both", "pool"), default="both",
                        help="dev asked with its group and with itself out of the pool (both), or with the "
                             "whole pool, as a run asks the pool's messages")
    parser.add_argument("--sample", type=int, default=0,
                        help="calibrate on this many dev messages of each label")
    parser.add_argument("--no-bare", action="store_true",
                        help="without the model with no demonstrations beside")
    parser.add_argument("--sets", nargs="+", choices=("test", "goal", "old50", "dev"), help="only these sets")
    args = parser.parse_args()
    sets = load_sets()
    if args.run:
        return check_run(args.run, sets)
    annotator.DEMOS_PER_LABEL = args.per_label
    if args.cost:
        return cost(sets["test"][:args.cost])
    server, url = (None, args.llm_url) if args.llm_url else llm_server.start()
    try:
        try:
            demos = annotator.load_demos(args.demos)
        except annotator.Fatal as error:
            raise SystemExit(f"error: --demos: {error}")
        labeler = labeler_at(url, args.model, scored=not args.greedy, demos=demos)
        mode = ("chat prompts, label parsed from the <label> tag" if labeler.style == "chat" else
                f"completion prompts, {annotator.DEMOS_PER_LABEL} demonstrations of each label")
        print(f"model {labeler.model} at {url}: {mode}", flush=True)
        measured = {}
        dev = calibration_sample(sets["dev"], args.sample) if args.sample else sets["dev"]
        ways = {"both": ("group", "message"), "pool": (None,)}[args.calibrate_on]
        threshold = (calibrate(labeler, dev, {} if args.sample else measured, ways)
                     if args.calibrate and labeler.style == "completion" else annotator.THRESHOLD)
        annotator.THRESHOLD = threshold
        report(f"labeler (THRESHOLD {threshold:.2f})", labeler, sets, threshold, measured, True, args.sets,
               not args.no_bare)
    finally:
        if server is not None:
            llm_server.stop(server)
    if args.baseline:  # after, on a server of its own, timed beside the labeler above
        server, url = llm_server.start()
        try:
            baseline = labeler_at(url, args.model, {**annotator.PROMPTS, "label_completion": BASELINE_PROMPT})
            baseline.wants_scores, annotator.THRESHOLD = False, 0.25  # the greedy token's bias then: No +0.25
            report("baseline (fixed prompt, greedy token)", baseline, sets, 0.25, only=args.sets)
        finally:
            llm_server.stop(server)

if __name__ == "__main__":
    main()
