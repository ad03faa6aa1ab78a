"""The PRM's prefix cache (reward_models/prefix_scoring.py): same scores as an uncached forward,
only the new tokens forwarded for a child, dropped when the weights change, bounded in memory."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import omrl_search as om  # noqa: E402
from reward_models.inputs import Episode  # noqa: E402
from reward_models.prefix_scoring import prefix_digests  # noqa: E402
from reward_models.prm import ProcessRewardModel  # noqa: E402

PROMPT = "Task: take the key and open the door"
STEPS = [("Think: look first.\nAct: look", "You are in a kitchen. A key lies here."),
         ("Act: take key", "You take the key."),
         ("Act: go north", "A locked door."),
         ("Act: open door with key", "The door opens.")]


def _chain(n: int, prompt: str = PROMPT) -> Episode:
    return Episode(prompt, [c for c, _ in STEPS[:n]], [o for _, o in STEPS[:n]])


@pytest.fixture()
def pair(tiny_hf_model):
    """The same random PRM with the cache on and off."""
    on = ProcessRewardModel.from_base(tiny_hf_model, device="cpu", dtype="float32", seed=3)
    off = ProcessRewardModel.from_base(tiny_hf_model, device="cpu", dtype="float32", seed=3,
                                       prefix_cache=False)
    assert on.prefix is not None and off.prefix is None
    return on, off


def _close(a, b):
    assert [len(s) for s in a] == [len(s) for s in b]
    for x, y in zip(a, b):
        assert x == pytest.approx(y, abs=1e-4)


def test_cached_scores_equal_uncached_for_parents_children_and_siblings(pair):
    on, off = pair
    eps = [_chain(1), _chain(2), _chain(3), _chain(4), _chain(2, "Task: another prompt"),
           Episode(PROMPT, ["Act: look", "Act: dance"], ["dark", "You dance."]), Episode(PROMPT, [], [])]
    # scored one by one, parents before children, then all again in one batch
    one_by_one = [on.score_episodes([ep])[0] for ep in eps]
    _close(one_by_one, off.score_episodes(eps))
    _close(on.score_episodes(eps), off.score_episodes(eps))
    s = on.stats()["prefix_cache"]
    assert s["memo_hits"] > 0 and 0 < s["forwarded_tokens"] < s["tokens"]


def test_a_child_forwards_only_its_new_tokens(pair):
    on, _ = pair
    parent, child = _chain(2), _chain(3)
    on.score_episodes([parent])
    before = dict(on.prefix.counts)
    on.score_episodes([child])
    ids_p, pos_p = on.encode(parent)
    ids_c, pos_c = on.encode(child)
    assert ids_c[:pos_p[-1] + 1] == ids_p[:pos_p[-1] + 1]
    forwarded = on.prefix.counts["forwarded_tokens"] - before["forwarded_tokens"]
    assert forwarded == pos_c[-1] - pos_p[-1]  # the completion and the observation turn
    assert on.prefix.counts["memo_hits"] - before["memo_hits"] == 2  # the parent's two steps


def test_the_cache_is_dropped_when_the_weights_change(pair):
    on, off = pair
    eps = [_chain(2), _chain(3)]
    first = on.score_episodes(eps)
    with torch.no_grad():
        for m in (on.model, off.model):
            m.backbone.layers[0].mlp.up_proj.weight.mul_(1.5)  # an update in place, as an optimizer's
    again = on.score_episodes(eps)
    _close(again, off.score_episodes(eps))
    assert again[1][-1] != pytest.approx(first[1][-1], abs=1e-6)


def test_eviction_keeps_the_kv_cache_under_its_limit_and_scores_right(tiny_hf_model):
    small = ProcessRewardModel.from_base(tiny_hf_model, device="cpu", dtype="float32", seed=3,
                                         prefix_cache_mb=0.02)
    off = ProcessRewardModel.from_base(tiny_hf_model, device="cpu", dtype="float32", seed=3,
                                       prefix_cache="off")
    eps = [_chain(n, f"Task number {t}: take the key") for t in range(6) for n in (1, 2, 3, 4)]
    got = [small.score_episodes([ep])[0] for ep in eps]
    kv = small.prefix.kv.stats()
    assert kv["evicted_tokens"] > 0 and kv["bytes"] <= kv["limit_bytes"]
    _close(got, off.score_episodes(eps))


def test_a_cut_episode_is_scored_like_the_uncached_path(tiny_hf_model):
    on = ProcessRewardModel.from_base(tiny_hf_model, device="cpu", dtype="float32", seed=3, max_length=40)
    off = ProcessRewardModel.from_base(tiny_hf_model, device="cpu", dtype="float32", seed=3,
                                       max_length=40, prefix_cache=False)
    eps = [_chain(n) for n in (1, 2, 3, 4)]
    _close([on.score_episodes([e])[0] for e in eps], off.score_episodes(eps))


def test_prefix_digests_name_each_prefix():
    ids = [5, 6, 7, 8, 9]
    d = prefix_digests(ids, [1, 3, 4])
    assert d == [prefix_digests(ids[:2], [1])[0], prefix_digests(ids[:4], [3])[0], prefix_digests(ids, [4])[0]]
    assert len(set(d)) == 3 and prefix_digests(ids, [2, 0])[1] == prefix_digests([5], [0])[0]


def test_siblings_scored_together_forward_their_shared_prefix_once(pair):
    on, off = pair
    kids = [Episode(PROMPT, [STEPS[0][0], c], [STEPS[0][1], o])
            for c, o in (STEPS[1], STEPS[2], ("Act: dance", "You dance."))]
    got = on.score_episodes(kids)
    _close(got, off.score_episodes(kids))
    encoded = [on.encode(k) for k in kids]
    shared = min(min(len(a[0]), len(b[0])) for a, b in zip(encoded, encoded[1:]))
    while any(e[0][:shared] != encoded[0][0][:shared] for e in encoded):
        shared -= 1
    new = sum(pos[-1] + 1 - shared for _, pos in encoded)
    assert on.prefix.counts["forwarded_tokens"] == shared + new  # not 3 * shared + new


@pytest.mark.parametrize("schedule", ["continuous", "lockstep"])
@pytest.mark.parametrize("strategy", ["mcts:simulations=12,k=2,value=rm", "beam:width=2,k=2,value=rm"])
def test_a_prm_guided_search_picks_the_same_with_and_without_the_cache(pair, schedule, strategy):
    on, off = pair
    tasks = om.load_tasks("game24", "test", limit=2)
    kw = dict(strategy=strategy, policy="scripted:oracle:p=0.5", seed=0, schedule=schedule)
    a = om.search_many(tasks, reward_model=on, **kw)
    b = om.search_many(tasks, reward_model=off, **kw)
    for x, y in zip(a, b):
        assert not x.faults and not y.faults
        assert [n.state_key for n in x.tree.nodes] == [n.state_key for n in y.tree.nodes]
        assert [n.score for n in x.tree.nodes] == pytest.approx([n.score for n in y.tree.nodes], abs=1e-4)
    stats = on.stats()["prefix_cache"]
    assert stats["memo_hits"] > 0  # the cache lives across the search's calls
    # what the scores cost is charged as rm_tokens: exactly the tokens the PRM forwarded (with
    # the cache on) or read (off), fewer through the cache
    spent_on = sum(r.spent["rm_tokens"] for r in a)
    spent_off = sum(r.spent["rm_tokens"] for r in b)
    assert spent_on == stats["forwarded_tokens"] and spent_off == stats["tokens"]
    assert 0 < spent_on < spent_off


def test_an_rm_tokens_budget_stops_a_prm_guided_search(pair):
    on, _ = pair
    task = om.load_tasks("game24", "test", limit=1)
    res = om.search_many(task, strategy="mcts:simulations=200,k=2,value=rm", policy="scripted:oracle:p=0.5",
                         reward_model=on, budget="rm_tokens=400", seed=0)[0]
    assert res.stop_reason == "budget:rm_tokens" and res.spent["rm_tokens"] >= 400


@pytest.mark.parametrize("opts, msg", [({"prefix_cache": "maybe"}, "prefix_cache must be on or off"),
                                       ({"prefix_cache_mb": 0}, "prefix_cache_mb must be")])
def test_bad_cache_options(tiny_hf_model, opts, msg):
    with pytest.raises(ValueError, match=msg):
        ProcessRewardModel.from_base(tiny_hf_model, device="cpu", dtype="float32", **opts)
