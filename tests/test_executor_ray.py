"""``search_many(executor="ray")`` and ``omrl search --executor ray``: the same results as in
process for seeded scripted searches, in input order; clear errors for policies that cannot
travel and for bad specs; a dying worker loses only its own tasks. One local Ray (2 CPUs) for the
whole module."""
from __future__ import annotations

import io
import json
import os
import sys
import threading
from contextlib import redirect_stderr, redirect_stdout

import pytest

ray = pytest.importorskip("ray")

from omrl_search import api  # noqa: E402
from omrl_search.backends.scripted import OraclePolicy  # noqa: E402
from omrl_search.cli import main  # noqa: E402
from omrl_search.executors import parse_executor, release  # noqa: E402
from omrl_search.policy import PolicyError  # noqa: E402
from omrl_search.specs import SpecError  # noqa: E402

POLICY = "scripted:oracle:p=0.4"


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ours = not ray.is_initialized()
    if ours:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # classes defined here travel by value (the workers cannot import this test module)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    release()
    if ours:
        ray.shutdown()


def same(a, b) -> None:
    """The same search: task, success, best path, spent (not seconds), tree shape, faults."""
    assert a.task.task_id == b.task.task_id
    assert (a.success, a.best, a.stop_reason, a.faults) == (b.success, b.best, b.stop_reason, b.faults)
    drop = lambda s: {k: v for k, v in s.items() if k != "seconds"}  # noqa: E731
    assert drop(a.spent) == drop(b.spent)
    steps = lambda r: [(s.completion, s.observation, s.completion_ids, s.logprobs)  # noqa: E731
                       for s in (r.best_trajectory.steps if r.best_trajectory else [])]
    assert steps(a) == steps(b)
    assert [(n.parent, n.state_key, n.status) for n in a.tree.nodes] == \
        [(n.parent, n.state_key, n.status) for n in b.tree.nodes]


@pytest.mark.parametrize("strategy", ["react", "best_of_n:n=3", "mcts:leaves=6,k=2"])
def test_ray_gives_the_in_process_results_in_input_order(strategy: str) -> None:
    tasks = api.load_tasks("game24", "test", 7)
    local = api.search_many(tasks, strategy=strategy, policy=POLICY, seed=3)
    seen = []
    on_ray = api.search_many(tasks, strategy=strategy, policy=POLICY, seed=3,
                             executor="ray:workers=2,chunk=2", on_result=seen.append)
    assert len(on_ray) == len(tasks) and sorted(r.task.task_id for r in seen) == sorted(t.task_id for t in tasks)
    for a, b in zip(local, on_ray):
        same(a, b)
    assert 0 < sum(r.success for r in on_ray) < len(tasks)  # a real mix, not all equal by luck


def test_a_picklable_policy_object_travels_an_unpicklable_one_is_one_clear_line() -> None:
    tasks = api.load_tasks("game24", "test", 2)
    got = api.search_many(tasks, policy=OraclePolicy(0.4), seed=1, executor="ray")
    for a, b in zip(api.search_many(tasks, policy=OraclePolicy(0.4), seed=1), got):
        same(a, b)

    class Locked(OraclePolicy):
        def __init__(self):
            super().__init__(0.4)
            self.lock = threading.Lock()

    with pytest.raises(PolicyError, match=r"builds the policy on every worker: give its spec string .*"
                                          r"not a Locked object \(it cannot be pickled: TypeError\)"):
        api.search_many(tasks, policy=Locked(), executor="ray")


def test_a_bad_policy_spec_is_reported_once_from_the_workers() -> None:
    tasks = api.load_tasks("game24", "test", 2)
    with pytest.raises(PolicyError, match=r"^unknown scripted policy 'nope' \(known: "):
        api.search_many(tasks, policy="scripted:nope", executor="ray")


class DiesOnTask(OraclePolicy):
    """Kills its worker process when asked about one task."""

    def __init__(self, victim: str):
        super().__init__(0.4)
        self.victim = victim

    def generate(self, requests):
        if any(r.meta["task"].task_id == self.victim for r in requests):
            os._exit(1)
        return super().generate(requests)


def test_a_dying_worker_loses_only_its_own_tasks() -> None:
    tasks = api.load_tasks("game24", "test", 4)
    got = api.search_many(tasks, policy=DiesOnTask(tasks[1].task_id), seed=2,
                          executor="ray:workers=2,chunk=1")
    local = api.search_many(tasks, policy=OraclePolicy(0.4), seed=2)
    assert [r.task.task_id for r in got] == [t.task_id for t in tasks]
    lost = got[1]
    assert not lost.success and lost.stop_reason == "error" and len(lost.faults) == 1
    assert lost.faults[0].startswith("ray worker: ")
    for i in (0, 2, 3):
        same(local[i], got[i])


def test_executor_specs_are_checked() -> None:
    assert parse_executor("ray:workers=4,num_gpus=0.5") == ("ray", {"workers": 4, "num_gpus": 0.5})
    assert parse_executor("local") == ("local", {})
    for bad, why in (("dask", "unknown executor"), ("ray:workers=0", "positive number"),
                     ("ray:cpus=1", "unknown option 'cpus'"), ("local:workers=2", "unknown option")):
        with pytest.raises(SpecError, match=why):
            parse_executor(bad)


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_cli_executor_ray_writes_the_local_summary(tmp_path) -> None:
    common = ["search", "--env", "game24", "--limit", "5", "--policy", POLICY, "--strategy",
              "best_of_n:n=2", "--seed", "4", "--no-progress"]
    assert run_cli(*common, "--out", str(tmp_path / "local"))[0] == 0
    assert run_cli(*common, "--executor", "ray:workers=2", "--out", str(tmp_path / "ray"))[0] == 0
    summaries = [json.loads((tmp_path / d / "summary.json").read_text())["best_of_n"] for d in ("local", "ray")]
    for s in summaries:
        s.pop("seconds")
    assert summaries[0] == summaries[1] and summaries[0]["tasks"] == 5
    rc, _, err = run_cli(*common, "--ray-address", "auto")
    assert rc == 2 and err.strip() == "omrl: error: --ray-address needs --executor ray"
    rc, _, err = run_cli(*common, "--executor", "ray:workers=-1")
    assert rc == 2 and "workers must be a positive number" in err and len(err.strip().splitlines()) == 1
