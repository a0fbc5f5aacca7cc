"""The NetHack tasks of the ONI paper on NLE 1.3, with the paper's 28 "extended" actions.

`make_env(task, seed)` or `gym.make` (the paper's names) builds one. A step's `info["message_count"]`
is the N of ONI's 1/N^beta (its message's count in the episode); the last step's `info["episode"]` sums up,
with how the episode ended (`end`) and that step's words (`end_text`)."""
import re
import gymnasium as gym
import numpy as np
from nle import nethack
from nle.env import base
from nle.env.tasks import TASK_ACTIONS

# NLE's 23 task actions (MORE, 8+8 compass, UP, DOWN, WAIT, KICK, EAT, SEARCH) and five more.
ACTIONS = tuple(TASK_ACTIONS) + (nethack.Command.CAST, nethack.Command.QUAFF, nethack.Command.PRAY,
                                 nethack.Command.PICKUP, nethack.Command.PAY)
OBS_KEYS = ("glyphs", "chars", "colors", "blstats", "message")  # Only what is read: more keys cost speed.
MESSAGE_LEN, DEFAULT_CHARACTER, MAX_EPISODE_STEPS = 256, "mon-hum-neu-mal", 5000
SUCCESS_REWARD, FROZEN_TIME_PENALTY = 50.0, -0.01  # The goal reached; a score step that took no game time.

# NW (key 'y': yes to "eat it?") picks the first item at "What do you want to eat/drink?", like the reference.
CONFIRM_ACTION = ACTIONS.index(nethack.CompassDirection.NW)
ITEM_PROMPT = re.compile(rb"What do you want to (?:eat|drink)\? \[([a-zA-Z])")
AGENT_QUESTIONS = (b"eat", b"drink", b"attack", b"direction?", b"pray")  # The agent's own y/n questions.
DESCEND_MESSAGE, SKILL_MESSAGE = b"You descend the stairs.", b"You feel more confident in"
KILL_MESSAGE = re.compile(rb"You (?:kill|destroy) ")  # Not "is killed" or "kills": those are the pet's kills.
ESC, SPACE, CAST, ENHANCE = 27, ord(" "), int(nethack.Command.CAST), int(nethack.Command.ENHANCE)
STONE_GLYPH = nethack.GLYPH_CMAP_OFF  # Unexplored cells show the "dark part of a room" (stone) glyph.

# The goal: "score" (the score's change, with a frozen-time penalty), ("depth", n) or "oracle" (+50 and end).
TASKS = {"NetHackScoreExtendedActions-v1": "score", "NetHackStaircaseExtendedActions-v1": ("depth", 2),
         "NetHackStaircaseLvl3ExtendedActions-v1": ("depth", 3),
         "NetHackStaircaseLvl4ExtendedActions-v1": ("depth", 4), "NetHackOracleExtendedActions-v1": "oracle"}
# How a game ended, as NetHack records it (nethack.how_done(): DIED covers monsters, traps and gods alike).
END_NAMES = {int(getattr(nethack, name)): name.lower() for name in (
    "DIED", "CHOKING", "POISONING", "STARVING", "DROWNING", "BURNING", "DISSOLVED", "CRUSHING", "STONING",
    "TURNED_SLIME", "GENOCIDED", "PANICKED", "TRICKED", "QUIT", "ESCAPED", "ASCENDED")}
X, Y, SCORE, DEPTH, GOLD, XLVL, TIME, DNUM, DLEVEL = (
    nethack.NLE_BL_X, nethack.NLE_BL_Y, nethack.NLE_BL_SCORE, nethack.NLE_BL_DEPTH, nethack.NLE_BL_GOLD,
    nethack.NLE_BL_XP, nethack.NLE_BL_TIME, nethack.NLE_BL_DNUM, nethack.NLE_BL_DLEVEL)


def message_bytes(message: np.ndarray) -> bytes:  # The message line as bytes without its zero padding.
    return message.tobytes().partition(b"\0")[0]


def monster_glyph(name: str) -> int:
    for glyph in range(nethack.GLYPH_MON_OFF, nethack.GLYPH_PET_OFF):
        if nethack.permonst(nethack.glyph_to_mon(glyph)).mname == name:
            return glyph
    raise RuntimeError(f"NLE has no {name} monster glyph")


class NetHackTask(base.NLE):
    """One of the paper's tasks: steps NetHack itself, not NLE's `step`, to copy less and answer prompts."""
    def __init__(self, task: str, seed: int | None = None, character: str = DEFAULT_CHARACTER,
                 max_episode_steps: int = MAX_EPISODE_STEPS, extra_keys: tuple[str, ...] = (), **nle_kwargs):
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")
        # NetHack reads the wall clock (moon phase, Friday the 13th and night change Luck, prayer, combat):
        # fix_moon_phase makes a seed one game on any date. extra_keys: evaluate.py's tty_* observations.
        super().__init__(character=character, max_episode_steps=max_episode_steps, actions=ACTIONS,
                         observation_keys=OBS_KEYS + tuple(extra_keys),
                         **{"fix_moon_phase": True, **nle_kwargs})
        self.task, self.goal, self._keys = task, TASKS[task], tuple(int(a) for a in ACTIONS)
        self.oracle_glyph = monster_glyph("Oracle") if self.goal == "oracle" else None
        self._seeds = np.random.default_rng(seed) if seed is not None else None

    def reset(self, seed=None, options=None):
        self._seeds = np.random.default_rng(seed) if seed is not None else self._seeds
        if self._seeds is not None:  # Each episode gets its own game seeds from the env's stream.
            super().seed(*(int(s) for s in self._seeds.integers(1, 2**62, size=2)), reseed=False)
        else:  # Random seeds, set explicitly: unseeded, NLE would take the moon phase from the clock.
            super().seed(reseed=False)
        obs, _ = super().reset(options=options)
        self._item_key, self._texts, self._message_counts, self._explored = None, [], {}, {}
        self._kills, self._return, self._max_depth = 0, 0.0, 1
        return obs, {"message_count": self._count_message(
            message_bytes(self.last_observation[self._message_index]))}

    def step(self, action: int):
        previous = self.last_observation[self._blstats_index].tolist()
        # NLE refills its arrays in place: the map is kept, as that is cheaper than counting it every step.
        self._map = self.last_observation[self._glyph_index].tobytes()
        observation, done = self._send_action(action, self._keys[action])
        self._steps, self.last_observation = self._steps + 1, observation
        blstats = observation[self._blstats_index].tolist()
        stats = blstats if blstats[TIME] else previous  # NLE zeroes the stats once the game is over.
        self._max_depth = max(self._max_depth, stats[DEPTH])
        success = not done and self._succeeded(observation, blstats)
        if self.goal == "score":
            reward = (float(stats[SCORE] - previous[SCORE])
                      + FROZEN_TIME_PENALTY * (blstats[TIME] == previous[TIME]))
        else:
            reward = SUCCESS_REWARD if success else 0.0
        self._return += reward
        truncated = not done and not success and self._steps >= self._max_episode_steps
        info = {"message_count": self._count_message(message_bytes(observation[self._message_index]))}
        self._kills += len(KILL_MESSAGE.findall(b"\n".join(self._texts)))
        obs = self._get_observation(observation)
        # A new level (stairs, trap door, level teleport; or the game's end, which zeroes the stats).
        if blstats[DLEVEL] != previous[DLEVEL] or blstats[DNUM] != previous[DNUM]:
            self._count_explored(np.frombuffer(self._map, np.int16), previous)  # The level left.
        if done or success or truncated:
            self._count_explored(observation[self._glyph_index], blstats)
            info["episode"] = {"return": self._return, "steps": self._steps, "success": float(success),
                               "score": stats[SCORE], "depth": self._max_depth, "dlvl": stats[DEPTH],
                               "xlvl": stats[XLVL], "gold": stats[GOLD], "kills": self._kills,
                               "explored": sum(self._explored.values()),
                               # How it ended, and the last step's words (a god's lightning is a DIED).
                               "end": ("success" if success else "time limit" if truncated
                                       else END_NAMES.get(int(self.nethack.how_done()), "died")),
                               "end_text": " ".join(b" ".join(self._texts).decode("latin-1").split())[-120:]
                               if done else ""}
        if (success or truncated) and not done:
            # Quitting refills NLE's arrays: the last real observation is kept, a truncation's bootstrap.
            obs = {k: v.copy() for k, v in obs.items()}
            self._quit_game(observation, done)
        return obs, reward, done or success, truncated, info

    def _send_action(self, action: int, key: int):
        self._texts = []
        if self._item_key is not None:  # The game stopped at "What do you want to eat/drink?".
            key, self._item_key = (self._item_key if action == CONFIRM_ACTION else SPACE), None
        observation, done = self.nethack.step(key)
        if key == CAST and not done and not observation[self._message_index].any():
            observation, done = self.nethack.step(ord("a"))  # The spell menu is up: the first spell.
        observation, done = self._answer_prompts(observation, done)
        # NetHack says it once, maybe on a --More-- page: if missed, the skill never advances.
        if not done and SKILL_MESSAGE in b"\n".join(self._texts):
            observation, done = self.nethack.step(ENHANCE)
            if not done:
                observation, done = self.nethack.step(ord("a"))  # It advances the first skill offered.
            observation, done = self._answer_prompts(observation, done)
        return observation, done

    def _answer_prompts(self, observation, done):
        """Skips --More--, ESCs others' prompts, notes an eat/drink item; each page's text joins `_texts`."""
        kept = None
        while not done:
            internal, text = (observation[self._internal_index],
                              message_bytes(observation[self._message_index]))
            self._texts.append(text)
            if internal[3]:  # xwaitforspace: --More--.
                kept = text if DESCEND_MESSAGE in text else kept  # Kept as the step's message.
                observation, done = self.nethack.step(SPACE)
            elif internal[2] or internal[1] and not any(q in text for q in AGENT_QUESTIONS):
                observation, done = self.nethack.step(ESC)  # A line of text (getlin) or another's question.
            elif internal[1]:  # yn_function: a single-character question, one of the agent's own.
                prompt = ITEM_PROMPT.search(text)
                self._item_key = ord(prompt.group(1)) if prompt else None
                break
            else:
                break
        message = observation[self._message_index]
        if done and not message.any():  # A game ends on the empty pages of its last windows.
            kept = next((text for text in reversed(self._texts) if text), None)  # "You die..."
        if kept is not None:
            message[:] = np.frombuffer(kept.ljust(MESSAGE_LEN, b"\0"), np.uint8)
        return observation, done

    def _succeeded(self, observation, blstats) -> bool:
        if self.goal == "oracle":
            x, y = blstats[X], blstats[Y]
            near = observation[self._glyph_index][max(y - 1, 0):y + 2, max(x - 1, 0):x + 2]
            return bool((near == self.oracle_glyph).any())
        return (self.goal != "score" and blstats[DLEVEL] == self.goal[1]
                and DESCEND_MESSAGE in message_bytes(observation[self._message_index]))

    def _count_message(self, text: bytes) -> int:
        count = self._message_counts[text] = self._message_counts.get(text, 0) + 1
        return count

    def _count_explored(self, glyphs, blstats):  # Seen cells at a level change and the end; maps only grow.
        if blstats[TIME]:
            level = (blstats[DNUM], blstats[DLEVEL])
            self._explored[level] = max(int(np.count_nonzero(glyphs != STONE_GLYPH)),
                                        self._explored.get(level, 0))


def make_env(task: str, seed: int | None = None, **kwargs) -> NetHackTask:  # Picklable, for spawned workers.
    return NetHackTask(task, seed=seed, **kwargs)


for _name in TASKS:
    if _name not in gym.registry:
        gym.register(id=_name, entry_point="envs:NetHackTask", kwargs={"task": _name},
                     max_episode_steps=None, disable_env_checker=True, order_enforce=False)
