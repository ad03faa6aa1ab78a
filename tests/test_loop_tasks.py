"""The loop's task sets: the dev slice (the train split's end, or a stream of its own), round 1's
demonstrations (also from the levels' own streams), the held-out splits, and the shipped configs
that draw them."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")  # the configs' checks load the trainers' settings models


def test_expert_levels_add_demonstrations_from_each_levels_own_stream(tmp_path):
    """``expert_levels``: round 1's demonstrations also come from the curriculum levels' own
    task streams, so a run can have more than the train split holds, without a train-split
    puzzle (no dev puzzle, no pool demonstration twice); asking too many is one error."""
    import omrl_search as om
    from train.config import TrainError
    from train.loop import LoopConfig
    from train.loop_select import puzzle_key
    from train.loop_stages import TaskSets

    cur = {"knob": "level", "levels": [1, 2, 3]}
    cfg = LoopConfig(env="countdown", policy="scripted:oracle:p=0", agent="act", expert_demos=3,
                     expert_levels={1: 4, 3: 5}, curriculum=cur, dev_limit=5, prm=False,
                     progress=False, out=str(tmp_path))
    cfg.check()
    sets = TaskSets(cfg)
    assert sets.demos[:3] == sets.pool[:3] and len(sets.demos) == 12
    levels = [t.data["level"] for t in sets.demos[3:]]
    assert levels == [1] * 4 + [3] * 5
    train = {puzzle_key(t) for t in om.load_tasks("countdown", "train")}
    assert not any(puzzle_key(t) in train for t in sets.demos[3:])
    with pytest.raises(TrainError, match="level 1 has"):
        TaskSets(cfg.model_copy(update={"expert_levels": {1: 100000}}))
    for bad, needle in (({"expert_levels": {4: 1}}, "not a curriculum level"),
                        ({"curriculum": None}, "set curriculum")):
        with pytest.raises(ValueError, match=needle):
            cfg.model_copy(update=bad).check()


def test_dev_split_draws_the_dev_slice_from_a_stream_of_its_own(tmp_path):
    """``dev_split``: the dev slice is a train stream's first tasks with no train- or test-split
    puzzle, so the whole train split stays for demonstrations and search; the level streams'
    demonstrations leave its puzzles out too; asking more than it holds, a test stream or a bad
    knob is one error."""
    import omrl_search as om
    from train.config import TrainError
    from train.loop import LoopConfig
    from train.loop_select import puzzle_key
    from train.loop_stages import TaskSets

    cur = {"knob": "level", "levels": [1, 2, 3]}
    cfg = LoopConfig(env="countdown", policy="scripted:oracle:p=0", agent="act", expert_demos=1000,
                     expert_levels={1: 50}, curriculum=cur, dev_limit=60, dev_split="train:level=1",
                     prm=False, progress=False, out=str(tmp_path))
    cfg.check()
    sets = TaskSets(cfg)
    train, test = om.load_tasks("countdown", "train"), om.load_tasks("countdown", "test")
    stream = om.load_tasks("countdown", "train:level=1")
    dev = {puzzle_key(t) for t in sets.dev}
    assert len(dev) == 60 and all(t.data["level"] == 1 for t in sets.dev)
    assert not dev & {puzzle_key(t) for t in train + test}
    # the first 60 of the stream that are in neither split: some of its puzzles are train's
    outside = [t for t in stream if puzzle_key(t) not in {puzzle_key(u) for u in train + test}]
    assert sets.dev == outside[:60] and len(outside) < len(stream)
    assert sets.pool == train and sets.demos[:1000] == train
    assert not dev & {puzzle_key(t) for t in sets.demos[1000:]} and len(sets.demos) == 1050
    with pytest.raises(TrainError, match="dev_split train:level=1 has"):
        TaskSets(cfg.model_copy(update={"dev_limit": 100000}))
    for bad, needle in (("test:level=1", "a train stream"), ("train:level=9", "level")):
        with pytest.raises(ValueError, match=needle):
            cfg.model_copy(update={"dev_split": bad}).check()


def test_test_splits_add_held_out_streams_a_puzzle_once(tmp_path):
    """``test_splits``: the held-out tasks are ``test_limit`` of each split in order, a puzzle
    once (a stream that repeats a test-split puzzle gives it once), and a dev slice from a
    stream of its own leaves them all out; a train split there is one error."""
    import omrl_search as om
    from train.loop import LoopConfig
    from train.loop_select import puzzle_key
    from train.loop_stages import TaskSets

    cfg = LoopConfig(env="countdown", policy="scripted:oracle:p=0", agent="act",
                     test_splits=["test", "test:level=1"], dev_limit=20, dev_split="train:level=1",
                     prm=False, progress=False, out=str(tmp_path))
    cfg.check()
    sets = TaskSets(cfg)
    test, first = sets.test(), om.load_tasks("countdown", "test", 200)
    level1 = om.load_tasks("countdown", "test:level=1", 200)
    keys = [puzzle_key(t) for t in test]
    # the level-1 stream repeats a few three-number puzzles of the test split: each comes once
    repeats = {puzzle_key(t) for t in first} & {puzzle_key(t) for t in level1}
    assert repeats and test[:200] == first and len(test) == 400 - len(repeats) == len(set(keys))
    assert not {puzzle_key(t) for t in sets.dev} & set(keys)
    assert TaskSets(cfg.model_copy(update={"test_splits": ["test", "test"]})).test() == first
    with pytest.raises(ValueError, match="test_splits: test streams"):
        cfg.model_copy(update={"test_splits": ["test", "train:level=1"]}).check()


@pytest.mark.parametrize("name", ["loop-game24", "loop-countdown"])
def test_the_shipped_loop_configs_search_mcts_at_scale(name):
    """The configs users start from load, pass every check before round 0, and are expert
    iteration as designed: MCTS with policy priors and the solver over >= 200 train tasks a
    round, DPO pairs by Q gap, the PRM on Q labels."""
    import yaml

    from omrl_search.specs import parse_spec
    from train.loop import LoopConfig
    from train.loop_stages import TaskSets

    cfg = LoopConfig(**yaml.safe_load((Path(__file__).parent.parent / "configs" / f"{name}.yaml").read_text()))
    cfg.check()
    strategy, opts = parse_spec(cfg.search_strategy)
    assert strategy == "mcts" and opts["priors"] == "policy" and opts["solver"] in (True, "true")
    assert cfg.train_limit >= 200 and cfg.dpo_pairs == "qgap" and cfg.prm and cfg.prm_soft == "q"
    assert cfg.test_limit == 200
    sets = TaskSets(cfg)  # the dev slice and demonstrations the run will draw, as many as asked
    assert len(sets.dev) == cfg.dev_limit and len(sets.demos) >= cfg.expert_demos
    # and they end with the search on the kept checkpoint: MCTS at 5,000 tokens a puzzle
    assert parse_spec(cfg.best_search)[0] == "mcts" and cfg.best_budget == "tokens=5000"
