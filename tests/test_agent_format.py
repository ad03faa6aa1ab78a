"""ReAct parsing and the token-exact turn encoder."""
from __future__ import annotations

from omrl_search.agent import ReActFormat, TurnEncoder
from omrl_search.policy import ByteChatTokenizer
from omrl_search.prompts import Prompts

F = ReActFormat()


def test_parse_think_act():
    p = F.parse("Think: 4*6 is 24\nAct: 4 * 6")
    assert (p.thought, p.action, p.error) == ("4*6 is 24", "4 * 6", "")


def test_parse_tolerates_markup_and_trailing_text():
    p = F.parse("**Think:** go\n**Act:** `up`\nObservation: hallucinated")
    assert p.action == "up" and not p.error
    assert F.parse("thought: x\naction: left\nmore words").action == "left"


def test_parse_keeps_code_blocks():
    p = F.parse("Think: count\nAct: bash\n```bash\nls | wc -l\n```")
    assert p.action.startswith("bash") and "ls | wc -l" in p.action


def test_malformed_completions_give_errors_not_exceptions():
    for text in ("", "I think we should add", "Think: hmm\nAct:   "):
        p = F.parse(text, action_help="a op b")
        assert p.error.startswith("Invalid format") and "a op b" in p.error


class ChatML(ByteChatTokenizer):
    """A ChatML-style template whose end-of-turn marker the model may emit itself."""

    def render(self, messages, add_generation_prompt):
        out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def test_turn_encoder_matches_full_render():
    tok = ChatML()
    enc = TurnEncoder(tok)
    msgs = [{"role": "user", "content": "solve"}]
    first = enc.first_prompt(msgs)
    completion = tok.encode("Think: a\nAct: b")
    obs = enc.observation_turn("Observation: ok", completion)
    full = msgs + [{"role": "assistant", "content": "Think: a\nAct: b"},
                   {"role": "user", "content": "Observation: ok"}]
    assert first + completion + obs == tok.encode(tok.render(full, add_generation_prompt=True))
    # when the model emitted the end-of-turn marker itself it is not added twice
    ended = completion + tok.encode("<|im_end|>")
    obs2 = enc.observation_turn("Observation: ok", ended)
    assert first + ended + obs2 == tok.encode(tok.render(full, add_generation_prompt=True))


def test_prompt_and_error_show_each_env_action_help_once():
    from omrl_search.env import list_envs, make_env

    for name in list_envs():
        env = make_env(name)
        help_ = env.action_help
        assert help_.startswith("Actions:"), name
        first = F.first_messages(env, env.tasks("test", limit=1)[0], "obs")
        assert first[1]["content"].count("Actions:") == 1, name
        assert F.parse("no action here", help_).error.count("Actions:") == 1, name


class Terse(ReActFormat):
    """A format with its own prompts: one short first turn, no system message."""

    def prompts(self, env, task, tree, encoder):
        return TersePrompts(self, encoder, env, task, tree)


class TersePrompts(Prompts):
    def messages(self, node):
        if node.parent is None:
            return [{"role": "user", "content": f"Solve: {node.observation}"}]
        return super().messages(node)


def test_a_format_changes_the_prompts_without_touching_the_engine():
    import omrl_search as om
    from helpers import Recording
    from omrl_search.engine import Engine

    policy = Recording(p=0.0)
    tasks = om.load_tasks("game24", "test", limit=3)
    results = Engine(policy, agent_format=Terse()).run(om.make_strategy("react"), tasks)
    sent = [req for batch in policy.batches for req in batch]
    assert sent and all(r.messages[0]["role"] == "user" and r.messages[0]["content"].startswith("Solve: ")
                        for r in sent)
    assert {len(r.messages) for r in sent} == {1, 3, 5}  # the chat grows by two turns a step
    firsts = {r.meta["task"].task_id: r.prompt_ids for r in sent if len(r.messages) == 1}
    for req in sent:  # the token ids come from the format's messages too
        first = firsts[req.meta["task"].task_id]
        assert req.prompt_ids[:len(first)] == first
    for r in results:
        chat = [{"role": "user", "content": f"Solve: {r.tree.root.observation}"}]
        assert firsts[r.task.task_id] == policy.tokenizer.encode(
            policy.tokenizer.render(chat, add_generation_prompt=True))
    assert all(r.success and not r.faults for r in results)


def test_prompts_parse_a_completion_into_a_step():
    import omrl_search as om

    env = om.make_env("game24")
    task = env.tasks("test", limit=1)[0]
    tree = om.SearchTree(task, env.reset(task), env.snapshot())
    prompts = F.prompts(env, task, tree, TurnEncoder(ByteChatTokenizer()))
    step, error = prompts.parse(om.Generation("Think: t\nAct: 4 * 6", [1, 2], [-0.1, -0.2], 5, 2), [7])
    assert (step.thought, step.action, step.context_ids, step.completion_ids, error) == (
        "t", "4 * 6", [7], [1, 2], "")
    step, error = prompts.parse(om.Generation("no action", [3], None, 5, 1), None)
    assert error.startswith("Invalid format") and env.action_help in error
    messages, ids = prompts.ask("Say sure.")
    assert messages == [{"role": "user", "content": "Say sure."}] and ids == prompts.encoder.first_prompt(messages)
    messages, context_ids, prompt_ids = prompts.step(tree.root, "a note")
    assert messages[-1]["content"].endswith("a note") and context_ids == prompt_ids
    assert prompts.messages(tree.root)[-1]["content"].endswith(tree.root.observation)  # cache unchanged


def test_act_format_has_no_thought_line_and_is_selectable_by_name():
    import pytest

    import omrl_search as om
    from omrl_search.agent import ActFormat, make_format
    from omrl_search.constrain import check
    from omrl_search.specs import SpecError

    fmt = make_format("act")
    assert isinstance(fmt, ActFormat) and fmt.think is None
    assert fmt.render("ignored", "4 * 6") == "Act: 4 * 6"
    assert fmt.parse("Act: 4 * 6") .action == "4 * 6"
    assert "one line 'Act: <action>'" in fmt.parse("4 * 6").error
    g = fmt.grammar("actions", ["4 * 6", "4 + 6"])
    assert check(g, "Act: 4 + 6") == "ok" and check(g, "Think: x\nAct: 4 + 6") == "violated"
    with pytest.raises(SpecError, match="unknown agent format 'cot'"):
        make_format("cot")
    # through the API: a search runs under it (a bad name is refused before anything runs)
    tasks = om.load_tasks("countdown", "test:level=1", limit=2)
    assert all(r.success for r in om.search_many(tasks, strategy="react", policy="scripted:oracle", agent="act"))
    with pytest.raises(SpecError, match="unknown agent format"):
        om.search_many(tasks, strategy="react", policy="scripted:oracle", agent="cot")


def test_an_act_search_is_exported_and_rendered_in_the_act_format(tmp_path):
    """A search under ``agent=act`` records its format; scripted demonstrations write the Act
    line alone, the format survives results.jsonl, and every export renders the act system
    prompt (a react search's exports keep the react one)."""
    import omrl_search as om
    from omrl_search.agent import ActFormat
    from omrl_search.exports import dpo_rows, prm_rows, sft_rows
    from omrl_search.result import SearchResult

    tasks = om.load_tasks("countdown", "train", limit=3)
    act = om.search_many(tasks, strategy="best_of_n:n=3", policy="scripted:oracle:p=0.3", agent="act", seed=0)
    react = om.search_many(tasks, strategy="best_of_n:n=3", policy="scripted:oracle:p=0.3", seed=0)
    assert any(r.success for r in act)
    for r in act:
        assert r.tree.agent == "act"
        assert all(s.completion.startswith("Act: ") and "Think" not in s.completion
                   for t in r.trajectories for s in t.steps)
    back = [SearchResult.from_json(r.to_json()) for r in act]
    assert [r.tree.agent for r in back] == ["act"] * 3
    assert SearchResult.from_json(react[0].to_json()).tree.agent == "react"
    act_system = ActFormat().system
    for rows in (sft_rows(back), dpo_rows(back, pairs="value"), prm_rows(back)):
        assert rows
        for row in rows:
            msgs = row.get("messages") or row.get("prompt") or row.get("chosen")
            assert msgs[0]["content"] == act_system
    assert sft_rows(react)[0]["messages"][0]["content"] != act_system


def test_terse_format_writes_the_action_alone_after_a_short_first_prompt():
    """``terse``: the completion is the action (an ``Act:`` line is still read), the first
    prompt is the task and the observation without the env's action help (which a malformed
    step's error still gives), and its grammar is the action language with no frame."""
    from omrl_search.agent import ActFormat, TerseFormat, make_format
    from omrl_search.constrain import check
    from omrl_search.env import make_env

    fmt = make_format("terse")
    assert isinstance(fmt, TerseFormat) and fmt.think is None and fmt.act == ""
    assert fmt.render("ignored", "4 * 6") == "4 * 6"
    for text in ("4 * 6", " `4 * 6` \nmore", "Act: 4 * 6", "Think: x\nAct: 4 * 6"):
        assert (fmt.parse(text).action, fmt.parse(text).error) == ("4 * 6", ""), text
    bad = fmt.parse("  \n", action_help="Actions: a op b")
    assert bad.action == "" and "the action alone" in bad.error and "Actions: a op b" in bad.error
    g = fmt.grammar("actions", ["4 * 6", "4 + 6"])
    assert g.text.startswith("root ::= action\n")
    assert check(g, "4 + 6") == "ok" and check(g, "Act: 4 + 6") == "violated"
    assert check(fmt.grammar("format"), "anything on one line") == "ok"

    env = make_env("game24")
    task = env.tasks("test")[0]
    obs = env.reset(task)
    terse, act = fmt.first_messages(env, task, obs), ActFormat().first_messages(env, task, obs)
    assert terse[1]["content"] == f"Task: {task.instruction}\nObservation: {obs}"
    assert env.action_help in act[1]["content"] and env.action_help not in terse[1]["content"]
    assert sum(len(m["content"]) for m in terse) < sum(len(m["content"]) for m in act) / 2
    assert fmt.first_messages(env, task, obs, "a note")[1]["content"].endswith("\n\na note")


def test_a_terse_search_is_exported_in_the_terse_format(tmp_path):
    """Scripted demonstrations under ``agent=terse`` write the action alone, the format survives
    results.jsonl, and SFT rows carry the terse system text and bare actions."""
    import omrl_search as om
    from omrl_search.agent import TerseFormat
    from omrl_search.exports import sft_rows
    from omrl_search.result import SearchResult

    tasks = om.load_tasks("game24", "train", limit=3)
    results = om.search_many(tasks, strategy="react", policy="scripted:oracle", agent="terse")
    assert all(r.success for r in results)
    for r in results:
        for s in r.trajectories[0].steps:
            assert s.completion == s.action and "Act" not in s.completion
    back = [SearchResult.from_json(r.to_json()) for r in results]
    assert [r.tree.agent for r in back] == ["terse"] * 3
    rows = sft_rows(back)
    assert rows and all(row["messages"][0]["content"] == TerseFormat().system for row in rows)
    steps = [m["content"] for row in rows for m in row["messages"] if m["role"] == "assistant"]
    assert steps == [s.action for r in results for s in r.trajectories[0].steps]


def test_a_terse_search_under_the_actions_grammar_with_a_real_hf_model(tiny_hf_model):
    """A tiny random hf model searched under ``terse`` with ``constrain=actions``: every
    completion is the action alone, in the env's action language at its node (its recorded
    grammar, which has no frame), and a move the env takes."""
    import omrl_search as om
    from omrl_search.backends.hf import HFPolicy
    from omrl_search.constrain import Grammar, check
    from omrl_search.types import SamplingParams

    policy = HFPolicy(tiny_hf_model, device="cpu", dtype="float32", max_batch=8)
    results = om.search_many(om.load_tasks("countdown", "train", 2), strategy="best_of_n:n=2",
                             policy=policy, agent="terse", constrain="actions", max_depth=2,
                             sampling=SamplingParams(temperature=1.0, max_tokens=16), seed=0)
    checked = 0
    for r in results:
        assert r.constraint["actions"] == r.constraint["generations"] > 0 and not r.faults
        for node in r.tree.nodes[1:]:
            grammar = Grammar.from_record(node.step.grammar)
            assert (grammar.kind, grammar.act, grammar.think) == ("actions", "", None)
            assert node.step.completion.strip() == node.step.action
            assert check(grammar, node.step.completion) == "ok"
            assert "Numbers left" in node.observation and "nvalid" not in node.observation
            checked += 1
    assert checked >= 4
