"""DAPO dynamic sampling: GRPO groups whose rewards are all equal are dropped and counted before
the update; online rounds sample more groups in their place (up to a cap of passes), so an update
never runs on nothing. Samples come from a scripted policy (deterministic: some groups mixed,
some flat), re-encoded with the tiny model's tokenizer."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

import omrl_search as om  # noqa: E402
from omrl_search.exports import export, grpo_rows  # noqa: E402
from train import grpo  # noqa: E402
from train.runtime import TrainError  # noqa: E402


class ScriptedSource(grpo.RolloutSource):
    """Online rounds whose searches use a scripted policy instead of the live model."""

    policy_spec = "scripted:oracle:p=0.4"

    def search(self, runner, tasks, seed):
        return om.search_many(tasks, strategy=self.on.strategy, policy=self.policy_spec, seed=seed,
                              max_depth=self.on.max_depth)


def _runner(model_dir, out, spec="scripted:oracle:p=0.4", **kw):
    online = {"env": "game24", "tasks_per_round": 2, "strategy": "best_of_n:n=3", "constrain": "none"}
    online.update(kw.pop("online", {}))
    cfg = grpo.GRPOConfig(model=model_dir, out=str(out), lr=1e-3, max_steps=kw.pop("max_steps", 3),
                          progress=False, online=online, **kw)
    runner = grpo.build(cfg)
    runner.source.__class__ = ScriptedSource
    runner.source.policy_spec = spec
    runner.source.reencode = runner.source.builder.encoder
    return runner


def _metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _spread(rows):
    groups = {}
    for r in rows:
        groups.setdefault(r.group, set()).add(r.reward)
    return groups


def test_flat_groups_are_dropped_counted_and_replaced(tiny_agent_model, tmp_path):
    runner = _runner(tiny_agent_model, tmp_path / "o")
    runner.train()
    logged = _metrics(tmp_path / "o")
    assert len(logged) == 3
    for m in logged:
        assert m["groups_sampled"] == m["groups_flat"] + m["groups_kept"]
        assert m["groups_sampled"] == 2 * m["sampling_passes"]  # best-of-3: one group per task
        assert m["groups_kept"] >= 2 or m["sampling_passes"] == 4  # full, or the cap
        assert m["rollout_rows"] == 3 * m["groups_kept"]  # only the informative groups' rows
    assert any(m["groups_flat"] > 0 and m["sampling_passes"] > 1 for m in logged)  # replaced
    assert logged[-1]["groups_flat_total"] == sum(m["groups_flat"] for m in logged)
    runner.source.pending = []
    runner.source.rollout(runner)
    rows = [r for mb in runner.source.pending for r in mb]
    assert rows and all(len(v) > 1 for v in _spread(rows).values())
    assert any(r.advantage != 0 for r in rows)


def test_without_dynamic_sampling_flat_groups_stay(tiny_agent_model, tmp_path):
    runner = _runner(tiny_agent_model, tmp_path / "o", dynamic_sampling=False, max_steps=2)
    runner.train()
    logged = _metrics(tmp_path / "o")
    assert all(m["groups_flat"] == 0 and m["sampling_passes"] == 1 for m in logged)
    runner.source.pending = []
    runner.source.rollout(runner)
    rows = [r for mb in runner.source.pending for r in mb]
    assert rows and all(r.advantage == 0 for r in rows)  # this pass's groups are all flat
    assert len(_spread(rows)) == 2


def test_rounds_with_only_flat_groups_stop_the_run_at_the_cap(tiny_agent_model, tmp_path):
    # one step of game24 never solves it: every group is flat, round after round
    runner = _runner(tiny_agent_model, tmp_path / "o",
                     online={"max_depth": 1, "max_sampling_tries": 3, "max_empty_rounds": 2})
    with pytest.raises(TrainError, match=r"2 rounds in a row gave no trainable group \(the last: "
                                         r"3 sampling passes, 6 groups, 6 with equal"):
        runner.train()
    assert runner.source.passes == 6 and runner.source.empty_total == 2


def test_an_empty_round_is_sampled_again_and_the_run_goes_on(tiny_agent_model, tmp_path):
    # the first round's passes are all flat (one step never solves game24); from the second
    # round the searches may run to the end, so groups are mixed again and training continues
    runner = _runner(tiny_agent_model, tmp_path / "o", max_steps=2,
                     online={"max_sampling_tries": 2, "min_groups": 1})
    source = runner.source
    real_search = source.search

    def search(runner_, tasks, seed):
        if source.round == 0:
            return om.search_many(tasks, strategy=source.on.strategy, policy=source.policy_spec,
                                  seed=seed, max_depth=1)
        return real_search(runner_, tasks, seed)

    source.search = search
    runner.train()
    logged = _metrics(tmp_path / "o")
    assert [m["step"] for m in logged] == [1, 2]  # both updates made
    assert source.empty_total == 1 and logged[0]["rounds_empty_total"] == 1
    assert logged[0]["round"] == 2  # the empty round was counted, then sampled again
    assert source.passes >= 3  # 2 flat passes, then the trainable round's
    assert logged[0]["groups_kept"] >= 1


def test_offline_grpo_drops_and_counts_flat_groups(tiny_agent_model, tmp_path):
    results = om.search_many(om.load_tasks("game24", "train", limit=8), strategy="best_of_n:n=3",
                             policy="scripted:oracle:p=0.4", seed=0)
    om.write_results(tmp_path / "r.jsonl", results)
    export("grpo", [tmp_path / "r.jsonl"], tmp_path / "g.parquet", tokenizer=tiny_agent_model)
    groups = {}
    for r in grpo_rows(results):
        groups.setdefault(r["group_id"], set()).add(r["value"])
    flat = sum(len(v) == 1 for v in groups.values())
    assert 0 < flat < len(groups)
    cfg = grpo.GRPOConfig(model=tiny_agent_model, data=[str(tmp_path / "g.parquet")], out=str(tmp_path / "o"),
                          lr=1e-3, batch_size=2, max_steps=2, progress=False)
    runner = grpo.build(cfg)
    assert runner.source.stats == {"groups_sampled": len(groups), "groups_flat": flat,
                                   "groups_kept": len(groups) - flat}
    assert len(runner.source.examples) == 3 * (len(groups) - flat)
    runner.train()
    assert all(m["groups_flat"] == flat for m in _metrics(tmp_path / "o"))
    keep = grpo.build(cfg.model_copy(update={"dynamic_sampling": False, "out": str(tmp_path / "p")}))
    assert len(keep.source.examples) == 3 * len(groups) and not keep.source.stats


@pytest.mark.parametrize("agent", ["react", "act"])
def test_online_samples_are_written_in_the_agent_format_asked(tiny_agent_model, tmp_path, agent):
    """``online.agent`` reaches the live model's searches: an ``act``-trained model is sampled
    with the act prompt and its rows' prompts carry it (the default stays ``react``)."""
    online = {"env": "countdown", "tasks_per_round": 2, "strategy": "best_of_n:n=2", "constrain": "actions",
              "max_tokens": 12, "max_depth": 1}
    if agent == "act":
        online["agent"] = "act"
    cfg = grpo.GRPOConfig(model=tiny_agent_model, out=str(tmp_path / "o"), lr=1e-3, max_steps=1,
                          progress=False, dynamic_sampling=False, online=online)
    assert cfg.online.agent == agent
    runner = grpo.build(cfg)
    rows, results = runner.source.sample_pass(runner, offset=0)
    assert rows and len(results) == 2
    system = om.agent.make_format(agent).system
    other = om.agent.make_format("act" if agent == "react" else "react").system
    prompts = [row["prompt"][0]["content"] for row in grpo_rows(results)]
    assert prompts and all(p == system for p in prompts) and system != other
    text = runner.source.tok.decode(rows[0].input_ids)
    assert system in text and other not in text  # the trained ids carry the same prompt
