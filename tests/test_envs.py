"""The paper's tasks on real NLE: actions, prompts, success conditions, message counts, stats."""
import multiprocessing as mp

import gymnasium as gym
import numpy as np
import pytest
from nle import nethack

import envs

DOWN = envs.ACTIONS.index(nethack.MiscDirection.DOWN)
SEARCH = envs.ACTIONS.index(nethack.Command.SEARCH)
EAT = envs.ACTIONS.index(nethack.Command.EAT)
PRAY = envs.ACTIONS.index(nethack.Command.PRAY)
COMPASS = {(0, -1): "N", (1, -1): "NE", (1, 0): "E", (1, 1): "SE", (0, 1): "S", (-1, 1): "SW",
           (-1, 0): "W", (-1, -1): "NW"}


def move(dx, dy):
    return envs.ACTIONS.index(nethack.CompassDirection[COMPASS[dx, dy]])


def text(obs):
    return envs.message_bytes(obs["message"])


def raw_keys(env, keys):
    """Type keys straight into NetHack (wizard-mode set-ups), bypassing the task's action set."""
    for key in keys:
        obs, done = env.nethack.step(key)
        assert not done
    env.last_observation = obs


def descend_stairs(env):
    """Wizard-map the level, travel to '>' (travel stops at doors, so repeat), then step DOWN."""
    raw_keys(env, [nethack.C("f")])
    rng = np.random.default_rng(0)
    for _ in range(100):
        raw_keys(env, [ord("_"), ord(">"), ord(".")])
        env.last_observation, _ = env._answer_prompts(env.last_observation, False)
        result = env.step(DOWN)
        if b"can't go down" not in text(result[0]):
            return result
        env.step(int(rng.integers(1, 9)))  # a monster may block the path: move or fight it
    raise AssertionError("could not reach the down staircase")


@pytest.mark.parametrize("task", list(envs.TASKS))
def test_each_task_steps_with_28_actions(task):
    env = envs.make_env(task, seed=0, max_episode_steps=100)
    assert env.action_space.n == 28 and len(envs.ACTIONS) == 28
    obs, info = env.reset()
    assert set(obs) == set(envs.OBS_KEYS) and info["message_count"] == 1
    rng, ended, rewards = np.random.default_rng(0), 0, []
    for _ in range(300):
        obs, reward, term, trunc, info = env.step(int(rng.integers(28)))
        assert obs["chars"].shape == (21, 79) and obs["message"].shape == (256,)
        assert info["message_count"] >= 1
        rewards.append(reward)
        if term or trunc:  # the episode's statistics are its own: its steps and the sum of its rewards
            episode = info["episode"]
            assert {"return", "steps", "score", "depth", "xlvl", "gold", "kills", "explored"} <= set(episode)
            assert episode["steps"] == len(rewards) and episode["return"] == pytest.approx(sum(rewards))
            assert episode["depth"] >= 1 and episode["xlvl"] >= 1 and episode["explored"] > 0
            ended, rewards = ended + 1, []
            env.reset()
    assert ended >= 2  # episodes of at most 100 steps: the checks above ran
    env.close()


def test_unknown_task_is_a_clear_error():
    with pytest.raises(ValueError, match="known tasks: NetHackScoreExtendedActions-v1"):
        envs.make_env("NoSuchTask-v0")


def test_gym_registration():
    env = gym.make("NetHackStaircaseExtendedActions-v1")
    assert env.unwrapped.goal == ("depth", 2)
    env.close()


@pytest.mark.parametrize("task,depth", [("NetHackStaircaseExtendedActions-v1", 2),
                                        ("NetHackStaircaseLvl4ExtendedActions-v1", 4)])
def test_staircase_success_on_a_real_descent(task, depth):
    env = envs.make_env(task, seed=7, wizard=True)  # a seed whose stairs travel reaches, in the main dungeon
    env.reset()
    for level in range(2, depth + 1):
        obs, reward, term, trunc, info = descend_stairs(env)
        # the stairs message survives the automatic --More-- skip
        assert b"You descend the stairs." in text(obs)
        # not the Mines
        assert obs["blstats"][nethack.NLE_BL_DLEVEL] == level and obs["blstats"][nethack.NLE_BL_DNUM] == 0
        if level < depth:
            assert (reward, term) == (0.0, False)
    assert (reward, term, trunc) == (envs.SUCCESS_REWARD, True, False)
    assert info["episode"]["success"] == 1.0 and info["episode"]["depth"] == depth
    env.close()


def test_oracle_success_when_the_oracle_is_adjacent():
    env = envs.make_env("NetHackOracleExtendedActions-v1", seed=0, wizard=True)
    env.reset()
    obs, reward, term, _, _ = env.step(SEARCH)
    assert (reward, term) == (0.0, False)
    # wizard mode: create an Oracle, which appears next to the agent and never moves
    raw_keys(env, [nethack.C("g")] + [ord(c) for c in "Oracle\ry"])  # "force Oracle? y"
    env.last_observation, _ = env._answer_prompts(env.last_observation, False)
    glyphs = env.last_observation[env._glyph_index]
    assert (glyphs == env.oracle_glyph).sum() == 1
    obs, reward, term, trunc, info = env.step(SEARCH)
    assert (reward, term, trunc) == (envs.SUCCESS_REWARD, True, False)
    assert info["episode"]["success"] == 1.0
    env.close()


def test_score_reward_and_frozen_time_penalty():
    env = envs.make_env("NetHackScoreExtendedActions-v1", seed=0)
    env.reset()
    _, reward, _, _, _ = env.step(DOWN)  # "You can't go down here." takes no game time
    assert reward == pytest.approx(envs.FROZEN_TIME_PENALTY)
    _, reward, _, _, _ = env.step(SEARCH)  # searching takes a turn and scores nothing
    assert reward == 0.0
    env.close()


def test_message_counts_count_and_reset():
    env = envs.make_env("NetHackScoreExtendedActions-v1", seed=0)
    env.reset()
    counts = []
    for _ in range(3):
        obs, _, _, _, info = env.step(DOWN)
        assert text(obs) == b"You can't go down here."
        counts.append(info["message_count"])
    assert counts == [1, 2, 3]
    env.reset()
    _, _, _, _, info = env.step(DOWN)
    assert info["message_count"] == 1
    env.close()


def test_eat_prompt_confirm_eats_the_first_offered_item():
    env = envs.make_env("NetHackScoreExtendedActions-v1", seed=0)
    env.reset()
    obs, *_ = env.step(EAT)
    assert text(obs).startswith(b"What do you want to eat? [")
    turn = obs["blstats"][nethack.NLE_BL_TIME]
    obs, *_ = env.step(envs.CONFIRM_ACTION)
    assert text(obs) not in (b"Never mind.", b"You don't have that object.")
    assert obs["blstats"][nethack.NLE_BL_TIME] > turn  # eating took game time
    env.close()


def test_eat_prompt_other_action_cancels():
    env = envs.make_env("NetHackScoreExtendedActions-v1", seed=0)
    env.reset()
    obs, *_ = env.step(EAT)
    turn = obs["blstats"][nethack.NLE_BL_TIME]
    obs, *_ = env.step(SEARCH)
    assert text(obs) == b"Never mind."
    assert obs["blstats"][nethack.NLE_BL_TIME] == turn


def test_time_limit_truncates_with_the_real_last_observation():
    env = envs.make_env("NetHackScoreExtendedActions-v1", seed=0, max_episode_steps=10)
    env.reset()
    for step in range(10):
        obs, _, term, trunc, info = env.step(SEARCH)
    assert (term, trunc) == (False, True)
    assert obs["blstats"].any()  # not the zeroed stats of a finished game
    assert info["episode"]["steps"] == 10
    env.close()


def test_seeded_envs_repeat_their_games():
    def first_map(seed):
        env = envs.make_env("NetHackScoreExtendedActions-v1", seed=seed)
        maps = [env.reset()[0]["chars"].copy(), env.reset()[0]["chars"].copy()]
        env.close()
        return maps
    a, b = first_map(7), first_map(7)
    assert all((x == y).all() for x, y in zip(a, b))
    assert not (a[0] == a[1]).all()  # each episode gets its own game


def test_the_same_seed_plays_the_same_game():
    """Two envs of one seed, stepped with the same actions, see identical observations (the step's messages
    too). (Not what the date changes: test_the_moon_follows_the_seed_not_the_date guards that.)"""
    actions = np.random.default_rng(3).integers(28, size=400)
    games = [envs.make_env("NetHackScoreExtendedActions-v1", seed=3) for _ in range(2)]
    copy = lambda obs: {k: v.copy() for k, v in obs.items()}  # NLE refills its arrays in place
    observations = [[copy(env.reset()[0])] for env in games]
    for action in actions:
        for env, seen in zip(games, observations):
            obs, _, term, trunc, _ = env.step(int(action))
            seen.append(copy(obs))
            if term or trunc:
                seen.append(copy(env.reset()[0]))
    assert len(observations[0]) == len(observations[1]) > 400
    for a, b in zip(*observations):
        assert all((a[k] == b[k]).all() for k in envs.OBS_KEYS)
    for env in games:
        env.close()


@pytest.mark.parametrize("seed,first_message", [(30, b"You are lucky!  Full moon tonight."),
                                                (2, b"Be careful!  New moon tonight.")])
def test_the_moon_follows_the_seed_not_the_date(seed, first_message):
    """NetHack reads the wall clock for the moon's phase (a full moon gives +1 Luck): with the clock fixed
    from the game's seeds, these seeds show their moon on any date. (Without it at most one of the two
    cases could pass on a given day.)"""
    env = envs.make_env("NetHackScoreExtendedActions-v1", seed=seed)
    obs, _ = env.reset()
    assert text(obs) == first_message
    env.close()


def _step_in_child(task):
    env = envs.make_env(task, seed=1)
    env.reset()
    return float(env.step(SEARCH)[1])


def test_make_env_works_under_spawn():
    with mp.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_step_in_child, ("NetHackStaircaseExtendedActions-v1",)) == 0.0


def test_kills_and_the_skill_message_count_on_every_page():
    """A fight arena: the monk kills hostile newts two at a time; the bites that follow push her
    messages onto --More-- pages and mid-line, "You feel more confident in ..." once among them."""
    env = envs.make_env("NetHackScoreExtendedActions-v1", seed=0, wizard=True,
                        options=nethack.NETHACKOPTIONS + ("pettype:none",))  # all kills are hers
    env.reset()
    shown, step = [], env.nethack.step  # (key, message then shown) for every key sent to NetHack

    def traced(key):
        observation, done = step(key)
        shown.append((key, envs.message_bytes(observation[env._message_index])))
        return observation, done
    env.nethack.step = traced
    newt, skill_steps = envs.monster_glyph("newt"), 0
    for _ in range(14):
        raw_keys(env, [nethack.C("g"), *b"hostile newt\r"] * 2)
        env.last_observation, _ = env._answer_prompts(env.last_observation, False)
        for _ in range(60):
            x, y = env.last_observation[env._blstats_index][:2]
            newts = np.argwhere(env.last_observation[env._glyph_index] == newt)
            if not len(newts):
                break
            adjacent = [(nx - x, ny - y) for ny, nx in newts if max(abs(nx - x), abs(ny - y)) == 1]
            shown.clear()
            obs, *_ = env.step(move(*adjacent[0]) if adjacent else SEARCH)
            if any(envs.SKILL_MESSAGE in message for _, message in shown):
                assert envs.SKILL_MESSAGE not in text(obs)  # it was on a --More-- page
                # the enhance is sent (wizard mode then asks "Advance skills without practice?")
                assert envs.ENHANCE in [key for key, _ in shown]
                skill_steps += 1
    assert skill_steps == 1
    assert env._kills == 28  # every newt
    pets_kill = b"The little dog kills the newt.  You kill the jackal!"
    assert len(envs.KILL_MESSAGE.findall(pets_kill)) == 1
    env.close()


def test_explored_counts_a_level_left_through_a_trap_door():
    env = envs.make_env("NetHackScoreExtendedActions-v1", seed=0, wizard=True, max_episode_steps=3)
    env.reset()
    raw_keys(env, [nethack.C("f")])  # map the level: many more cells seen than at the start
    env.step(move(1, 0))  # off the up stairs, where no trap can be made
    raw_keys(env, [nethack.C("w"), *b"trap door\r"])
    obs, *_ = env.step(move(1, 0))
    level_1 = np.count_nonzero(obs["glyphs"] != envs.STONE_GLYPH)
    obs, _, _, truncated, info = env.step(move(-1, 0))  # back onto the trap door, and down
    assert obs["blstats"][nethack.NLE_BL_DLEVEL] == 2
    level_2 = np.count_nonzero(obs["glyphs"] != envs.STONE_GLYPH)
    assert truncated and info["episode"]["explored"] == level_1 + level_2
    env.close()


@pytest.mark.parametrize("character,seed,actions,last_words", [
    # random play: a goblin kills her on step 69 (mid-prayer)
    ("hea-gno-neu-fem", 11, np.random.default_rng(11).integers(28, size=100), b"You die..."),
    # prayers too soon anger the god, who strikes on the third
    ("mon-hum-neu-mal", 0, [PRAY, envs.CONFIRM_ACTION] * 3,
     b"Suddenly, a bolt of lightning strikes you!  You fry to a crisp!")], ids=["monster", "god"])
def test_a_death_shows_its_last_words(character, seed, actions, last_words):
    """NLE's last observation of a game shows the empty end-of-game windows; the learner scores the
    terminal step by its message, so it must be the death's."""
    env = envs.make_env("NetHackScoreExtendedActions-v1", seed=seed, character=character)
    env.reset()
    for action in actions:
        obs, _, terminated, _, info = env.step(int(action))
        if terminated:
            break
    assert terminated and text(obs) == last_words and info["message_count"] == 1
    env.close()
