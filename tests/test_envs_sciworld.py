"""ScienceWorld: splits, canonical listings, step semantics, the gold expert, replay restores and
what a divergent replay does to a search. One JVM serves the module (the ``env`` fixture)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import omrl_search as om
from envs import _sciworld_tasks as catalog
from envs import sciworld
from envs._optional import MissingPackage
from envs.sciworld import SciWorldEnv, SciWorldSim, normalise, tidy
from omrl_search.backends.scripted import OraclePolicy
from omrl_search.env import EnvError, ReplayDivergence, TaskFileError, make_env
from omrl_search.types import Generation

LIFESPAN = "lifespan-longest-lived-93"  # gold path of 4 steps
PLANT = "find-plant-225"  # 12 steps


@pytest.fixture(scope="module")
def tasks():
    return {t.task_id: t for t in SciWorldEnv.tasks("test")}


@pytest.fixture(scope="module")
def env():
    e = make_env("sciworld")
    yield e
    e.close()


def test_module_import_is_cheap():
    code = "import envs, sys; print(any(m in sys.modules for m in ('scienceworld', 'py4j')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_missing_package_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "scienceworld", None)
    with pytest.raises(MissingPackage, match=r"pip install 'omrl-search\[envs\]'"):
        catalog.start_jvm()


def test_tidy_sorts_listings_keeping_each_item_whole():
    text = ("This room is called the art studio. In it, you see: \n\tthe agent\n\ta substance called air\n"
            "\ta table. On the table is: a cup (containing red, blue), a red bulb, which is on, a bowl.\n"
            "\ta wood cup (containing yellow paint)\n\ta wood cup (containing blue paint)\n"
            "You also see:\n\tA door to the hallway (that is closed)\n")
    assert tidy(text).split("\n") == [
        "This room is called the art studio. In it, you see: ",
        "\ta substance called air",
        "\ta table. On the table is: a bowl, a cup (containing red, blue), a red bulb, which is on.",
        "\ta wood cup (containing blue paint)",
        "\ta wood cup (containing yellow paint)",
        "\tthe agent",
        "You also see:",
        "\tA door to the hallway (that is closed)",
        ""]
    assert tidy(tidy(text)) == tidy(text)
    thermometer = "In your inventory, you see:\n\ta thermometer, currently reading 14 degrees celsius"
    assert tidy(thermometer) == thermometer


def test_normalise():
    assert normalise("  Open   door to kitchen. ") == "Open door to kitchen"
    assert normalise("`look around`") == "look around"


def test_splits_are_scienceworlds_own(tasks):
    test, train = SciWorldEnv.tasks("test"), SciWorldEnv.tasks("train")
    assert len(test) == 20 and len(train) == 44  # identify-life-stages-2 has 4 train variations
    assert [t.data["task"] for t in test[:5]] == list(catalog.FAMILIES)  # interleaved families
    for t in test + train:
        splits = catalog.cached("splits")[t.data["task"]]
        assert t.data["variation"] in splits[t.split]
        assert t.task_id == f"{t.data['task']}-{t.data['variation']}"
    assert not {t.task_id for t in test} & {t.task_id for t in train}
    assert "focus on the animal" in tasks[LIFESPAN].instruction.lower()
    with pytest.raises(ValueError, match="splits train, dev, test"):
        SciWorldEnv.tasks("validation")


def test_action_help_lists_every_scienceworld_template(env, tasks):
    env.reset(tasks[LIFESPAN])
    templates = env.inner.sw.get_possible_actions()
    assert len(templates) >= 20 and SciWorldEnv.action_help.startswith("Actions:")
    for template in templates:
        assert template.replace("go OBJ", "go to OBJ") in SciWorldEnv.action_help


def test_gold_path_rewards_and_answer(env, tasks):
    env.reset(tasks[LIFESPAN])
    gold = env.inner.gold()
    assert gold and env.expert_action() == gold[0]
    results = []
    while not results or not results[-1].done:
        results.append(env.step(env.expert_action()))
    assert len(results) <= len(gold)  # gold paths may end with a spare wait1
    final = results[-1]
    assert (final.terminated, final.truncated, final.valid, final.success) == (True, False, True, True)
    assert final.info == {"score": 100, "answer": gold[len(results) - 1]}
    assert final.reward == 1.0 and "(Task completed: score 100.)" in final.observation
    scores = [0] + [r.info["score"] for r in results]
    for r, before, after in zip(results[:-1], scores, scores[1:]):
        assert r.reward == pytest.approx((after - before) / 100)  # normalised score change
    assert any(r.reward > 0 for r in results[:-1])
    assert env.expert_action() is None
    after = env.step("look around")
    assert after.done and not after.valid and after.success is True


def test_invalid_input_changes_nothing_and_says_why(env, tasks):
    env.reset(tasks[LIFESPAN])
    world, moves = env.inner.world(), env.inner.sw.get_num_moves()
    for action in ["", "   ", "open the pod bay doors", "99 * 99"]:
        r = env.step(action)
        assert r.observation.startswith("Invalid action:") and not r.valid
    r = env.step("xyzzy")
    assert r.valid is False and r.info == {"score": 0} and r.reward == 0.0 and not r.done
    assert "did not understand 'xyzzy'" in r.observation and sciworld.SYNTAX in r.observation
    assert env.inner.sw.get_num_moves() == moves
    assert env.inner.world() == world


def test_expert_skips_no_ops_and_gives_up_off_the_path(env, tasks):
    env.reset(tasks[LIFESPAN])
    gold = env.inner.gold()
    env.step("xyzzy")
    env.step("look around")  # free in ScienceWorld: the world is unchanged
    env.step("inventory")
    assert env.expert_action() == gold[0]
    env.step(gold[0])
    assert env.expert_action() == gold[1]
    env.step("wait1")  # time passes: off the gold path
    assert env.expert_action() is None


def test_restore_is_lazy_and_plays_only_missing_actions(env, tasks):
    env.reset(tasks[PLANT])
    gold = env.inner.gold()
    root = env.snapshot()
    snaps = []
    for action in gold[:3]:
        env.step(action)
        snaps.append(env.snapshot())
    env.restore(root)
    env.sync()
    reloads, replayed = env.reloads, env.replayed_steps
    env.restore(snaps[2])  # nothing replayed until needed; the snapshot answers meanwhile
    assert (env.observe(), env.state_key(), env.snapshot()) == (snaps[2].observation, snaps[2].state_key, snaps[2])
    assert env.expert_action() == gold[3] and (env.reloads, env.replayed_steps) == (reloads, replayed)
    env.restore(snaps[0])
    env.sync()  # an extension of the current state: one step, no reload
    env.restore(snaps[2])
    env.sync()
    assert (env.reloads, env.replayed_steps) == (reloads, replayed + 3)
    assert env.inner.state_key() == snaps[2].state_key and env.inner.obs == snaps[2].observation
    env.restore(snaps[1])  # back up: reload and replay two actions
    env.sync()
    assert (env.reloads, env.replayed_steps) == (reloads + 1, replayed + 5)
    assert env.inner.state_key() == snaps[1].state_key


def _drifting(monkeypatch, only_load=None):
    """Make reloads reach a different world, as a non-deterministic JVM may: every reload, or
    only the ``only_load``-th load of the env."""
    world = SciWorldSim.world
    drift = (lambda self: self.loads) if only_load is None else (lambda self: self.loads == only_load)
    monkeypatch.setattr(SciWorldSim, "world", lambda self: world(self) + (drift(self),))


def test_divergent_replay_is_retried_then_raises_at_the_next_step(env, tasks, monkeypatch):
    env.reset(tasks[LIFESPAN])
    gold = env.inner.gold()
    _drifting(monkeypatch)
    env.reset(tasks[LIFESPAN])
    root = env.snapshot()
    env.step(gold[0])
    first = env.snapshot()
    divergences, failed, reloads = env.divergences, env.failed_restores, env.reloads
    env.restore(root)
    tries = 1 + env.retries
    with pytest.raises(ReplayDivergence, match=rf"\({tries} tries\)"):
        env.step(gold[0])
    assert (env.divergences, env.failed_restores) == (divergences + tries, failed + 1)
    assert env.reloads == reloads + tries
    env.restore(first)
    with pytest.raises(ReplayDivergence):  # not played on from the diverged state
        env.sync()
    assert env.reloads == reloads + 2 * tries


def test_a_retry_can_reach_the_recorded_state(env, tasks, monkeypatch):
    env.reset(tasks[LIFESPAN])
    gold = env.inner.gold()
    _drifting(monkeypatch, only_load=env.inner.loads + 1)  # the next load goes astray
    env.step(gold[0])
    snap = env.snapshot()
    env.step(gold[1])
    divergences, failed, reloads = env.divergences, env.failed_restores, env.reloads
    env.restore(snap)
    env.sync()
    assert (env.divergences, env.failed_restores, env.reloads) == (divergences + 1, failed, reloads + 2)
    assert env.inner.state_key() == snap.state_key


def test_oracle_answers_from_the_search_without_replaying(env, tasks):
    env.reset(tasks[PLANT])
    env.inner.gold()  # generated (and cached) once
    oracle = OraclePolicy(p=0)
    (res,) = om.search_many([tasks[PLANT]], strategy="best_of_n:n=2", policy=oracle)
    assert res.success and not res.faults
    mirror = oracle._envs["sciworld"]  # the oracle's own env: it never needed its JVM
    assert (mirror.restores, mirror.inner.sw) == (0, None)
    oracle.close()


class GoldScript(om.Policy):
    """Plays a fixed action list by depth (no env of its own, unlike the scripted oracle)."""

    name, answers_prompts = "gold-script", False

    def __init__(self, actions):
        self.actions = actions

    def generate(self, requests):
        out = []
        for req in requests:
            depth = len(req.meta["snapshot"].payload[1])
            text = f"Think: next.\nAct: {self.actions[depth]}"
            out.append([Generation(text, [1, 2], None, 1, 2)] * req.params.n)
        return out


def test_divergent_restore_is_a_failed_node_never_a_success(env, tasks, monkeypatch):
    task = tasks[LIFESPAN]
    env.reset(task)
    policy = GoldScript(env.inner.gold())
    (ok,) = om.search_many([task], strategy="best_of_n:n=2", policy=policy)
    assert ok.success and not ok.faults
    _drifting(monkeypatch)
    (res,) = om.search_many([task], strategy="best_of_n:n=2", policy=policy)
    failed = [n for n in res.tree.nodes if n.error and "ReplayDivergence" in n.error]
    assert failed and all(not n.success and not n.children for n in failed)
    assert not res.success and not any(n.success for n in res.tree.nodes)
    assert any("ReplayDivergence" in f for f in res.faults)


def test_close_ends_the_jvm(tasks):
    e = make_env("sciworld")
    e.reset(tasks[LIFESPAN])
    java = e.inner.sw._gateway.java_process
    e.close()
    assert java.wait(timeout=30) is not None and e.inner.sw is None
    e.close()  # twice is fine
    with pytest.raises(EnvError):
        SciWorldSim().snapshot()


def test_jsonl_rows(tmp_path):
    path = tmp_path / "sw.jsonl"
    path.write_text(json.dumps({"task": "boil", "variation": 21}) + "\n"
                    + json.dumps({"task": "find-plant", "variation": 3, "simplifications": "easy"}) + "\n")
    boil, plant = SciWorldEnv.load_tasks(path)
    assert (boil.task_id, boil.split) == ("boil-21", "test") and "boil" in boil.instruction
    assert (plant.split, plant.data["simplifications"], plant.task_id) == ("train", "easy", "find-plant-3-easy")
    for row, reason in [({"task": "bake", "variation": 1}, "unknown ScienceWorld task 'bake'"),
                        ({"task": "boil", "variation": 99}, "boil has variations 0..29, not 99"),
                        ({"task": "boil", "variation": "1"}, "variation must be an integer"),
                        ({"task": "boil", "variation": 1, "simplifications": "fly"}, "unknown simplification"),
                        ({"variation": 1}, "missing field 'task'")]:
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(TaskFileError, match=rf"sw\.jsonl:1: {reason}"):
            SciWorldEnv.load_tasks(path)


def test_disk_cache_merges_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("OMRL_CACHE", str(tmp_path))
    monkeypatch.setattr(catalog, "_CACHE", {})
    catalog.cached("gold")["a:1:"] = ["look around"]
    catalog.save_cache()
    monkeypatch.setattr(catalog, "_CACHE", {})
    catalog.cached("gold")["b:2:"] = ["wait1"]
    catalog.save_cache()  # keeps what another process wrote
    with open(catalog.cache_file()) as f:
        assert json.load(f)["gold"] == {"a:1:": ["look around"], "b:2:": ["wait1"]}
