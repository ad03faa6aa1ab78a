"""benchmarks/prompt_cut.py: the long-prompt env differs from the shipped one in its prompt only."""
import pytest

import omrl_search as om
from helpers import load_script
from omrl_search.agent import make_format
from omrl_search.env import make_env

prompt_cut = load_script("benchmarks/prompt_cut.py")


@pytest.mark.parametrize("env_name", ["game24", "countdown"])
def test_long_prompt_changes_the_text_and_nothing_else(env_name):
    tasks = om.load_tasks(env_name, "test", 5)
    long_name = prompt_cut.long_env(env_name)
    longs = prompt_cut.long_tasks(tasks, env_name, long_name)
    fmt = make_format("act")
    for short, long in zip(tasks, longs):
        assert (long.task_id, long.data) == (short.task_id, short.data)
        a, b = make_env(env_name), make_env(long_name)
        obs_a, obs_b = a.reset(short), b.reset(long)
        assert obs_a == obs_b
        text_a = fmt.first_messages(a, short, obs_a)[1]["content"]
        text_b = fmt.first_messages(b, long, obs_b)[1]["content"]
        assert "Example turn:" in text_b and "Example turn:" not in text_a
        assert len(text_b) > 2 * len(text_a) * 0.9
        # same moves, grammar and verdicts along the expert's solution
        steps = 0
        while True:
            assert a.valid_actions() == b.valid_actions()
            assert a.action_grammar() == b.action_grammar()
            action = a.expert_action()
            if action is None:
                break
            ra, rb = a.step(action), b.step(action)
            assert (ra.observation, ra.reward, ra.done, ra.success) == (rb.observation, rb.reward, rb.done, rb.success)
            steps += 1
            if ra.done:
                assert ra.success
                break
        assert steps >= 2
