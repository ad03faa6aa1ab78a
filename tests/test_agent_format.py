"""ReAct parsing and the token-exact turn encoder."""
from __future__ import annotations

from omrl_search.agent import ReActFormat, TurnEncoder
from omrl_search.policy import ByteChatTokenizer

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
