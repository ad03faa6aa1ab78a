"""Keeping the LM batch full: continuous submission across trees, prompt-prefix ordering, and
results that do not depend on how requests were batched."""
from __future__ import annotations

import pytest

import omrl_search as om
from helpers import Recording
from omrl_search.backends.hf import prefill_levels, prefix_groups
from omrl_search.batching import LMWait, WaitingRequests, prompt_key
from omrl_search.engine import Engine
from omrl_search.types import GenRequest, SamplingParams

TASKS = om.load_tasks("game24", "test", limit=20)


def _recorded(strategy: str, tasks, max_batch: int, schedule: str = "continuous",
              prefix_order: bool = True, concurrency: int | None = None, p: float = 0.5):
    policy = Recording(p)
    policy.max_batch = max_batch
    engine = Engine(policy, seed=3, schedule=schedule, prefix_order=prefix_order)
    results = engine.run(om.make_strategy(strategy), tasks, concurrency=concurrency)
    return policy.batches, results


def _trees(results):
    return [r.to_dict()["tree"] for r in results]


def _spent(result):
    return {k: v for k, v in result.spent.items() if k != "seconds"}


def _short_calls_with_work_left(batches, max_batch: int) -> list[int]:
    """Calls with fewer than ``max_batch`` requests although at least that many trees still had
    requests to make (each tree keeps one request waiting: such a call could have been full)."""
    last = {}
    for c, batch in enumerate(batches):
        for r in batch:
            last[r.meta["task"].task_id] = c
    return [c for c, batch in enumerate(batches)
            if len(batch) < max_batch and sum(1 for t in last.values() if t >= c) >= max_batch]


def test_calls_are_topped_up_from_other_trees():
    """ReAct on 20 tasks with max_batch 8: lockstep ends every round with a short call (20 = 8 +
    8 + 4); continuous submission fills it with the next requests of trees already answered."""
    lock, _ = _recorded("react", TASKS, 8, schedule="lockstep")
    cont, _ = _recorded("react", TASKS, 8)
    assert _short_calls_with_work_left(lock, 8)  # the lockstep tail really is there
    assert not _short_calls_with_work_left(cont, 8)
    assert len(cont) < len(lock)
    assert sum(map(len, cont)) == sum(map(len, lock))  # the same requests, fewer calls
    assert any(len({r.meta["task"].task_id for r in b}) >= 4 for b in cont)  # from many trees


@pytest.mark.parametrize("schedule", ["continuous", "lockstep"])
def test_calls_hold_at_most_max_batch_sequences(schedule):
    batches, _ = _recorded("mcts:simulations=12,leaves=3,k=3", TASKS[:8], 7, schedule=schedule)
    sizes = [sum(r.params.n for r in batch) for batch in batches]
    assert max(sizes) == 7 and all(r.params.n in (1, 3) for b in batches for r in b)


def test_an_oversized_request_goes_alone():
    waiting = WaitingRequests()
    reqs = [GenRequest([], SamplingParams(n=n)) for n in (5, 2, 1, 3)]
    waiting.add(LMWait(0, None, [None] * 4, reqs))
    first = waiting.take(4)
    assert [s for _, s in first] == [0]  # 5 > 4: alone
    second = waiting.take(4)
    assert [s for _, s in second] == [1, 2]  # oldest first; the 3 no longer fits ...
    assert [s for _, s in waiting.take(4)] == [3]  # ... and leads the next call
    assert waiting.seqs == 0 and not waiting


def test_a_call_holds_the_oldest_request_and_its_prompt_neighbours():
    """With a key: the oldest request always, then its nearest neighbours in key order, the
    side sharing the longer prefix first (the same task's prompts before another task's)."""
    waiting = WaitingRequests()
    prompts = [[5, 1, 1], [1, 2, 3], [5, 1, 2], [5, 9, 9], [1, 2, 4], [5, 1, 3], [9, 9, 9]]
    reqs = [GenRequest([], SamplingParams(n=1), p) for p in prompts]
    waiting.add(LMWait(0, None, [None] * len(reqs), reqs))
    first = [s for _, s in waiting.take(3, prompt_key)]
    assert first == [0, 2, 5]  # [5,1,1] (oldest) with [5,1,2] and [5,1,3], not [1,2,4]
    assert [s for _, s in waiting.take(2, prompt_key)] == [1, 4]  # [1,2,3] oldest now, + [1,2,4]
    assert [s for _, s in waiting.take(5, prompt_key)] == [3, 6] and not waiting


def test_shared_prefixes_are_adjacent_in_each_call():
    batches, _ = _recorded("mcts:simulations=24,leaves=3,k=2", TASKS[:10], 16)
    assert len(batches) > 3
    mixed = 0
    for batch in batches:
        ids = [r.prompt_ids for r in batch]
        assert ids == sorted(ids)
        tasks = [r.meta["task"].task_id for r in batch]
        runs = [t for i, t in enumerate(tasks) if i == 0 or t != tasks[i - 1]]
        assert len(runs) == len(set(runs))  # each task's requests form one run
        mixed += len(set(tasks)) > 1
    assert mixed  # calls really mix trees


def test_arrival_order_without_prefix_ordering():
    batches, _ = _recorded("mcts:simulations=24,leaves=3,k=2", TASKS[:10], 16, prefix_order=False)
    assert any([r.prompt_ids for r in b] != sorted(r.prompt_ids for r in b) for b in batches)


@pytest.mark.parametrize("strategy", ["mcts:simulations=16,leaves=3,k=2,value=rollout",
                                      "tot:b=2,k=3", "beam:width=3,k=2", "best_of_n:n=5"])
def test_results_identical_whatever_the_batching(strategy):
    """Scripted policies draw from each request's own seed: the schedule, the ordering, the
    batch size and the concurrency window never change a tree."""
    tasks = TASKS[:9]
    _, ref = _recorded(strategy, tasks, 1 << 30, schedule="lockstep", prefix_order=False)
    for schedule, order, max_batch, concurrency in [("continuous", True, 5, None),
                                                    ("continuous", False, 3, 4),
                                                    ("lockstep", True, 4, None),
                                                    ("continuous", True, 1, 1)]:
        _, res = _recorded(strategy, tasks, max_batch, schedule, order, concurrency)
        assert _trees(res) == _trees(ref), (schedule, order, max_batch, concurrency)
        assert [_spent(r) for r in res] == [_spent(r) for r in ref]


def test_search_many_passes_the_schedule_to_the_engine():
    """``search_many(schedule=, prefix_order=)`` reaches the engine: lockstep leaves the short
    tail calls continuous submission fills; the trees are the same either way."""
    runs = {}
    for schedule in ("lockstep", "continuous"):
        policy = Recording(0.5)
        policy.max_batch = 8
        res = om.search_many(TASKS, strategy="react", policy=policy, seed=3, schedule=schedule,
                             prefix_order=False)
        runs[schedule] = (policy.batches, _trees(res))
    assert _short_calls_with_work_left(runs["lockstep"][0], 8)
    assert not _short_calls_with_work_left(runs["continuous"][0], 8)
    assert runs["lockstep"][1] == runs["continuous"][1]
    with pytest.raises(ValueError, match="unknown schedule"):
        om.search_many(TASKS[:1], policy=Recording(), schedule="eager")


class Streaming(Recording):
    """The oracle as a streaming backend: ``submit`` queues requests; each ``collect`` finishes
    a seeded-random non-empty part of what is running (as a continuous batcher would: short
    completions first, in no fixed order). Records what was running when each request came."""

    streams = True

    def __init__(self, p=0.5, seed=0, fail=None):
        super().__init__(p)
        self.running, self.joined, self.fail = {}, [], fail
        self.rng = __import__("random").Random(seed)

    def submit(self, tickets):
        for t, req in tickets:
            self.joined.append(len(self.running))
            self.running[t] = req

    def collect(self):
        tickets = sorted(self.running)
        done = self.rng.sample(tickets, self.rng.randint(1, len(tickets)))
        out = []
        for t in sorted(done):
            req = self.running.pop(t)
            if self.fail and req.meta["task"].task_id == self.fail:
                out.append((t, RuntimeError("server hiccup")))
            else:
                out.append((t, super().generate([req])[0]))
        return out


@pytest.mark.parametrize("strategy", ["mcts:simulations=16,leaves=3,k=2,value=rollout",
                                      "tot:b=2,k=3", "best_of_n:n=5", "dfsdt"])
def test_streaming_backends_get_requests_while_others_run_and_trees_are_unchanged(strategy):
    """With a streaming policy each request is submitted as soon as its tree makes it (joining
    requests still running) and answered in any order: the trees equal the lockstep ones."""
    tasks = TASKS[:9]
    _, ref = _recorded(strategy, tasks, 1 << 30, schedule="lockstep", prefix_order=False)
    for seed in (0, 1):
        policy = Streaming(seed=seed)
        res = Engine(policy, seed=3).run(om.make_strategy(strategy), tasks)
        assert _trees(res) == _trees(ref)
        assert [_spent(r) for r in res] == [_spent(r) for r in ref]
        assert max(policy.joined) > 0 and not policy.running  # joined a running batch; all answered
    lock = Streaming()
    Engine(lock, seed=3, schedule="lockstep").run(om.make_strategy(strategy), tasks)
    assert not lock.joined and lock.batches  # lockstep keeps to generate()


def test_a_failed_streamed_request_is_a_fault_of_its_own_tree_only():
    bad = TASKS[2].task_id
    res = Engine(Streaming(fail=bad), seed=3).run(om.make_strategy("best_of_n:n=3"), TASKS[:5])
    for r in res:
        if r.task.task_id == bad:
            assert r.faults and all("RuntimeError: server hiccup" in f for f in r.faults)
        else:
            assert not r.faults and len(r.tree.nodes) > 1


def test_a_prompt_that_cannot_be_built_ends_only_its_own_search():
    from omrl_search.agent import ReActFormat

    bad = TASKS[1].task_id

    class Broken(ReActFormat):
        def first_messages(self, env, task, observation, note=""):
            if task.task_id == bad:
                raise ValueError("cannot render this task")
            return super().first_messages(env, task, observation, note)

    policy = Recording()
    policy.max_batch = 2
    results = Engine(policy, agent_format=Broken()).run(om.make_strategy("best_of_n:n=2"), TASKS[:4])
    for r in results:
        if r.task.task_id == bad:
            assert r.stop_reason == "error" and r.faults == ["engine: ValueError: cannot render this task"]
        else:
            assert r.stop_reason == "done" and not r.faults and len(r.tree.nodes) > 1


def test_unknown_schedule_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown schedule 'eager' \\(known: continuous, lockstep\\)"):
        Engine(Recording(), schedule="eager")


# --- backends: shared prefixes computed once, samples independent of the batch ------------------

def _rebuild(prompts, levels):
    """Each prompt's tokens as the levels prefill them (following the parent rows)."""
    spans = []
    for rows, parents in levels:
        spans = [(spans[parents[j]] if parents is not None else []) + prompts[u][s:e]
                 for j, (u, s, e) in enumerate(rows)]
    return spans


def test_prefill_levels_cover_each_prompt_once():
    system = list(range(100, 140))
    task_a, task_b = system + [1, 2, 3] + list(range(200, 240)), system + [4, 5] + list(range(300, 330))
    prompts = [task_a + [7, 8, 9], task_b + [1], task_a + [7, 5], task_b + [2, 2, 2], system + [9]]
    levels = prefill_levels(prompts, 16)
    assert _rebuild(prompts, levels) == prompts
    assert [len(rows) for rows, _ in levels] == [1, 3, 5]  # system, 2 tasks + 1 alone, each prompt
    assert all(e - s >= 1 for u, s, e in levels[-1][0])  # every prompt keeps its last token
    base, groups = prefix_groups(prompts, 16)
    assert base == len(system)
    assert sorted((sorted(m), q) for m, q in groups) == [([0, 2], len(task_a) + 1), ([1, 3], len(task_b)),
                                                         ([4], base)]
    # prompts sharing nothing beyond the system prompt: two levels, as before
    flat = [system + [i] * 5 for i in range(4)]
    assert [len(rows) for rows, _ in prefill_levels(flat, 16)] == [1, 4]
    assert _rebuild(flat, prefill_levels(flat, 16)) == flat


def test_hf_groups_prefilled_once_and_results_equal_alone(tiny_hf_model, monkeypatch):
    from omrl_search.backends.hf import HFPolicy

    policy = HFPolicy(tiny_hf_model, device="cpu", dtype="float32", max_batch=8)
    tok = policy.tokenizer
    system = {"role": "system", "content": "You are a helpful agent. Solve the task step by step."}
    msgs = [[system, {"role": "user", "content": f"{task} Observation: {obs}"}]
            for task in ("Take the key from the table and open the door.",
                         "Look at the fridge, then the quick brown fox.")
            for obs in ("look", "open door")]
    reqs = [GenRequest(m, SamplingParams(temperature=0.0, max_tokens=6),
                       tok.encode(tok.render(m, add_generation_prompt=True))) for m in msgs]
    monkeypatch.setattr(policy, "min_shared_prefix", 4)
    shapes = []
    forward = policy.model.forward
    monkeypatch.setattr(policy.model, "forward",
                        lambda *a, **k: shapes.append(tuple(k["input_ids"].shape)) or forward(*a, **k))
    together = policy.generate(reqs)
    assert [s[0] for s in shapes[:3]] == [1, 2, 4]  # system prompt, each task, each prompt's rest
    for r, gens in zip(reqs, together):
        alone = policy.generate([r])[0][0]
        assert gens[0].token_ids == alone.token_ids
        assert gens[0].logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_hf_sampled_rows_do_not_depend_on_the_batch(tiny_hf_model):
    from omrl_search.backends.hf import HFPolicy

    policy = HFPolicy(tiny_hf_model, device="cpu", dtype="float32", max_batch=8)
    tok = policy.tokenizer
    reqs = [GenRequest(m, SamplingParams(temperature=1.0, max_tokens=10, n=2, seed=s),
                       tok.encode(tok.render(m, add_generation_prompt=True)))
            for s, m in enumerate([[{"role": "user", "content": "take the key"}],
                                   [{"role": "user", "content": "open the door now"}],
                                   [{"role": "user", "content": "look"}]])]
    together = [[g.token_ids for g in gs] for gs in policy.generate(reqs)]
    alone = [[g.token_ids for g in policy.generate([r])[0]] for r in reqs]
    reversed_ = [[g.token_ids for g in gs] for gs in policy.generate(reqs[::-1])][::-1]
    assert together == alone == reversed_
    assert all(a != b for a, b in together)  # the two samples of a request differ


def _tokens(results):
    return [[(n.parent, n.step.completion_ids if n.step else None) for n in r.tree.nodes]
            for r in results]


def test_seeded_sampled_search_independent_of_concurrency(tiny_agent_model):
    """A sampled LM with a seed (float32 hf: logits equal up to rounding in any batch): the same
    trees, token for token, searched all together or one request at a time."""
    from omrl_search.backends.hf import HFPolicy

    policy = HFPolicy(tiny_agent_model, device="cpu", dtype="float32", max_batch=8)
    tasks = TASKS[:4]

    def run(concurrency, max_batch, schedule):
        policy.max_batch = max_batch
        engine = Engine(policy, sampling=SamplingParams(1.0, 1.0, 12), seed=7, schedule=schedule)
        return engine.run(om.make_strategy("mcts:simulations=6,leaves=2,k=2,value=logprob"), tasks,
                          concurrency=concurrency)

    together = run(None, 8, "continuous")
    assert sum(len(r.tree.nodes) for r in together) > 4 * 3 and not any(r.faults for r in together)
    for other in (run(1, 1, "continuous"), run(None, 3, "lockstep")):
        assert _tokens(other) == _tokens(together)
        for a, b in zip(other, together):
            for x, y in zip(a.tree.nodes[1:], b.tree.nodes[1:]):
                assert x.step.logprobs == pytest.approx(y.step.logprobs, abs=1e-4)


def test_llamacpp_groups_evaluated_once_and_results_equal_alone(monkeypatch):
    """Two tasks' prompts in one call: the system prompt, then each task's shared prompt, is
    evaluated once (then copied to the group's streams); results equal each prompt alone."""
    from omrl_search.backends.llamacpp import LlamaCppPolicy

    policy = om.make_policy("smollm2:llamacpp:n_ctx=512,max_batch=4,n_threads=1")
    assert isinstance(policy, LlamaCppPolicy)
    tok = policy.tokenizer
    prompts = [tok.encode(tok.render([{"role": "user", "content": f"{task} Observation: {obs}"}], True))
               for task in ("Use the numbers 1 4 12 12 to make 24 with + - * and /.",
                            "Put a clean mug on the desk in the kitchen, then sit down.")
               for obs in ("look", "open the door")]
    reqs = [GenRequest([], SamplingParams(temperature=0.0, max_tokens=4), p) for p in prompts]
    evaluated = []
    evaluate = policy.evaluate_tokens
    monkeypatch.setattr(policy, "evaluate_tokens", lambda toks: evaluated.extend(toks) or evaluate(toks))
    policy.clear_cache()
    together = policy.generate(reqs)
    base, groups = prefix_groups(prompts, policy.min_shared_prefix)
    assert base and len(groups) == 2 and all(len(m) == 2 for m, _ in groups)
    unique = base + sum(q - base for _, q in groups) + sum(
        len(prompts[u]) - q for members, q in groups for u in members)
    assert len(evaluated) == unique < sum(map(len, prompts))
    for r, gens in zip(reqs, together):
        policy.clear_cache()
        alone = policy.generate([r])[0][0]
        assert gens[0].token_ids == alone.token_ids
        assert gens[0].logprobs == pytest.approx(alone.logprobs, abs=1e-3)
    policy.close()
