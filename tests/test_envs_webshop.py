"""WebShop: the generated catalogue, BM25 search, page navigation, the reward formula, the expert
and the task sets."""
from __future__ import annotations

import json
import random

import pytest

from envs import _catalogue as shop
from envs import webshop
from envs.webshop import BACK, BUY, NEXT, PREV, Goal, WebShopEnv, satisfies, score
from omrl_search.env import TaskFileError, make_env

TEST = WebShopEnv.tasks("test")


def _env(task=None) -> WebShopEnv:
    env = make_env("webshop")
    env.reset(task or TEST[0])
    return env


def _run_expert(env: WebShopEnv, limit: int = 40):
    result = None
    for _ in range(limit):
        action = env.expert_action()
        if action is None:
            return result
        result = env.step(action)
        assert result.valid, (action, result.observation)
    raise AssertionError("expert did not finish")


def test_catalogue_is_generated_deterministically():
    products = shop.catalogue()
    assert len(products) == shop.SIZE == 3000
    assert len({p.pid for p in products}) == 3000
    assert shop.catalogue.__wrapped__() == products  # regenerated from the seed: the same
    assert shop.catalogue.__wrapped__(seed=1)[:5] != products[:5]
    reserved = {BACK, PREV, NEXT, BUY}
    for p in products:
        lo, hi = shop.TYPES[p.ptype][3]
        assert lo * 100 <= p.price < hi * 100 and 2 <= len(p.attrs) <= 4 and p.ptype in p.title.lower()
        values = [v for _, vs in p.options for v in vs]
        assert len(values) == len(set(values)) and not reserved & set(values)  # one meaning per click
        assert all(len(vs) >= 2 for _, vs in p.options)
    assert len({p.ptype for p in products}) == len(shop.TYPES) == 24


def test_bm25_index_is_built_once_and_results_are_cached():
    index = shop._index()
    for task in TEST[:3]:  # several env instances share the index and the result cache
        env = _env(task)
        env.step(env.expert_action())
    assert shop._index() is index and shop._index.cache_info().misses == 1
    assert shop.search("waterproof camping tent") is shop.search("waterproof camping tent")
    hits = [shop.by_id()[pid] for pid in shop.search("waterproof camping tent")]
    assert len(hits) == shop.MAX_RESULTS
    assert all(p.ptype == "camping tent" and "waterproof" in p.attrs for p in hits[:10])
    assert shop.search("the and of") == () and shop.search("zzzz qqqq") == ()
    assert shop.tokens("Running Shoes, $30.00 lower than") == ["running", "shoe", "30.00"]


def test_reward_formula():
    p = shop.by_id()["B06HRG19BW"]  # a t-shirt: machine washable, short sleeve, slim fit, tagless
    assert p.ptype == "t-shirt" and p.price == 1100
    options = (("size", "small"), ("color", "olive"))
    goal = Goal("x", "t-shirt", "clothing", ("cotton", "slim fit"), options, 1500, "")
    assert score(goal, p, (("size", "small"), ("color", "olive"))) == (4 / 5, False)  # cotton missing
    assert score(goal, p, (("size", "medium"),)) == (2 / 5, False)  # slim fit + price
    assert score(goal._replace(max_price=1100), p, ()) == (1 / 5, False)  # price must be lower
    assert score(goal._replace(ptype="hoodie"), p, ()) == (2 / 5 * 0.5, False)  # same category
    assert score(goal._replace(ptype="lipstick", category="beauty"), p, ()) == (2 / 5 * 0.1, False)
    full = goal._replace(attrs=("slim fit", "tagless"))
    assert score(full, p, (("size", "small"), ("color", "olive"))) == (1.0, True)
    assert satisfies(full, p) and not satisfies(goal, p)
    assert not satisfies(full._replace(options=(("size", "large"),)), p)  # not offered


def test_pages_and_navigation():
    env = _env()
    assert env.valid_actions() == ["search[waterproof cruelty free lipstick]", "search[lipstick]"]
    r = env.step("search[  Lipstick ]")
    assert r.valid and r.info == {}
    assert 'Results for "lipstick": page 1 of 5 (50 products) [next >]' in r.observation
    first = env.valid_actions()
    assert first[:2] == [f"click[{BACK}]", f"click[{NEXT}]"] and len(first) == 12
    env.step("click[Next >]")
    assert env.state.page_no == 2 and f"click[{PREV}]" in env.valid_actions()
    second_page = env.clickables()[3]
    assert second_page not in first
    env.step(f"click[{PREV}]")
    assert env.valid_actions() == first
    pid = first[2][6:-1]
    r = env.step(f"click[{pid.lower()}]")  # ids are matched without case
    assert env.state.page == "item" and f"({pid})" in r.observation and "[buy now]" in r.observation
    kind, values = shop.by_id()[pid].options[0]
    env.step(f"click[{values[0]}]")
    r = env.step(f"click[{values[1]}]")  # choosing again replaces the choice
    assert env.state.chosen == ((kind, values[1]),) and f"[{values[1]}]*" in r.observation
    assert env.step("search[tent]").valid is False  # no search box on a product page
    env.step(f"click[{PREV}]")
    assert env.state.page == "results" and env.state.chosen == () and env.state.page_no == 1
    env.step(f"click[{BACK}]")
    assert env.state.page == "search" and env.valid_actions()[1] == "search[lipstick]"


@pytest.mark.parametrize("action,why", [
    ("click[buy now]", "is not clickable on this page; use search[QUERY]"),
    ("search[]", "the search query has no words"),
    ("buy it", "cannot parse 'buy it'"),
    ("", "empty action"),
])
def test_invalid_actions_say_why(action, why):
    env = _env()
    key = env.state
    r = env.step(action)
    assert r.observation.startswith("Invalid action:") and why in r.observation
    assert "Actions: `search[QUERY]`" in r.observation and r.valid is False and r.info == {}
    assert env.state._replace(steps=0, note="") == key  # nothing but the step count changed


def test_wrong_click_lists_what_is_clickable():
    env = _env()
    env.step("search[lipstick]")
    r = env.step("click[B0NOTHERE1]")
    why = "'B0NOTHERE1' is not clickable on this page (clickable: back to search, next >, B0"
    assert why in r.observation


def test_buying_a_wrong_product_scores_partially():
    env = _env()  # waterproof, cruelty free lipstick in mauve, under $50
    env.step("search[tent]")
    tent = env.clickables()[2]
    env.step(f"click[{tent}]")
    r = env.step("click[buy now]")
    reward, _ = score(env.state.goal, shop.by_id()[tent], ())
    assert r.done and r.reward == pytest.approx(reward) and 0 < r.reward < 0.1
    assert (r.terminated, r.valid, r.success) == (True, True, False) and r.info == {"answer": tent}
    assert "Your score (min 0.0, max 1.0): 0.0" in r.observation and env.expert_action() is None


def test_expert_solves_every_test_task_with_its_answer():
    lengths = []
    for task in TEST:
        env = _env(task)
        r = _run_expert(env)
        assert r.done and r.reward == 1.0 and r.success
        pid = r.info["answer"].split()[0]
        assert satisfies(env.state.goal, shop.by_id()[pid])
        assert all(f"{k}: {v}" in r.info["answer"] for k, v in env.state.goal.options)
        lengths.append(env.state.steps)
    assert len(TEST) == 50 and max(lengths) <= 6


def test_expert_recovers_from_wrong_pages():
    rng = random.Random(0)
    for task in TEST[:15]:
        env = _env(task)
        env.state = env.state._replace(limit=100)
        for _ in range(rng.randint(1, 8)):  # wander: random clicks, never buying
            actions = [a for a in env.valid_actions() if a != f"click[{BUY}]"]
            env.step(rng.choice(actions))
        r = _run_expert(env)
        assert r.success, task.task_id
    env = _env()
    env.step("search[camping tent]")  # no lipstick among the results
    assert env.expert_action() == f"click[{BACK}]"
    env.step(f"click[{env.clickables()[2]}]")
    assert env.expert_action() == f"click[{PREV}]"


def test_splits_never_share_a_product():
    train = WebShopEnv.tasks("train")
    assert (len(train), len(TEST)) == (2000, 50)
    products = {s: {t.data["product"] for t in ts} for s, ts in (("train", train), ("test", TEST))}
    assert not products["train"] & products["test"]
    assert all(webshop.product_split(p) == s for s, ps in products.items() for p in ps)
    assert WebShopEnv.tasks("test", limit=7) == TEST[:7]


def test_instruction_names_the_goal():
    for task in TEST[:10]:
        env = _env(task)
        g = env.state.goal
        text = task.instruction
        assert g.ptype in text and all(a in text for a in g.attrs)
        assert all(v in text for _, v in g.options)
        assert f"lower than {g.max_price / 100:.2f} dollars" in text
        assert text in env.observe() and hash(env.state)  # plain immutable data


def test_jsonl_rows(tmp_path):
    path = tmp_path / "shop.jsonl"
    rows = [{"product": "B06HRG19BW", "attributes": ["slim fit"], "options": {"color": "olive"},
             "max_price": 20, "task_id": "olive-tee"},
            {"product": "B06HRG19BW"}]
    path.write_text("\n".join(map(json.dumps, rows)) + "\n")
    first, second = WebShopEnv.load_tasks(path)
    assert first.task_id == "olive-tee" and "in olive color" in first.instruction
    assert "price lower than 20.00 dollars" in first.instruction
    assert second.data["attributes"] == ["machine washable", "short sleeve", "slim fit", "tagless"]
    assert second.data["max_price"] == 20 and second.data["options"] == {}
    env = _env(first)
    assert _run_expert(env).success


@pytest.mark.parametrize("row,reason", [
    ({"product": "B0NOPE"}, "product must be a product id of the catalogue"),
    ({"product": "B06HRG19BW", "attributes": ["waterproof"]}, "attributes must be a list of distinct"),
    ({"product": "B06HRG19BW", "options": {"color": "red"}}, "options must map option kinds"),
    ({"product": "B06HRG19BW", "max_price": 10}, r"max_price must be a number .* price \$11\.00"),
    ({"product": "B06HRG19BW", "max_price": "20"}, "max_price must be a number"),
    ({"product": "B06HRG19BW", "task_id": 3}, "task_id must be a string"),
])
def test_jsonl_bad_rows(tmp_path, row, reason):
    path = tmp_path / "shop.jsonl"
    path.write_text(json.dumps({"product": "B06HRG19BW"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(TaskFileError, match=rf"shop\.jsonl:2: {reason}"):
        WebShopEnv.load_tasks(path)
