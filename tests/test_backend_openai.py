"""The ``openai`` backend: against a small scripted HTTP server in this process (n, seeds, token
ids, retries, timeouts, garbage, one failing request in a batch), and for real against
llama-cpp-python's OpenAI-compatible server on the bundled SmolLM2."""
from __future__ import annotations

import io
import json
import socket
import threading
import time
from contextlib import redirect_stdout
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("httpx")

from omrl_search import api  # noqa: E402
from omrl_search.backends.openai import OpenAIPolicy  # noqa: E402
from omrl_search.engine import Engine  # noqa: E402
from omrl_search.policy import ByteChatTokenizer, PolicyError, make_policy  # noqa: E402
from omrl_search.types import GenRequest, SamplingParams  # noqa: E402

MSGS = [{"role": "user", "content": "hello"}]


class Fake(ThreadingHTTPServer):
    """An OpenAI-like server whose answers the test scripts: ``mode`` is ``ok``, ``garbage``
    (not JSON), ``nochoices`` or ``status`` (``status`` code for the first ``fail_first`` calls,
    then ok); each answer comes after ``delay`` seconds. ``ignore_n``: one choice per call, like
    llama-cpp-python. A prompt containing ``BAD`` gets a 400. Every POST body is recorded."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.mode, self.status, self.fail_first, self.delay = "ok", 500, 0, 0.0
        self.ignore_n = False
        self.obey_grammar = False  # answer a request that carries a grammar with a valid sentence
        self.gather = 0  # hold each call until this many are in flight (at most 2 s)
        self.bodies: list[dict] = []
        self.lock = threading.Condition()
        self.live = self.peak = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class Handler(BaseHTTPRequestHandler):
    server: Fake

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, code: int, payload, headers: dict | None = None) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except BrokenPipeError:  # the client timed out and left
            pass

    def do_GET(self) -> None:
        self._send(200, {"object": "list", "data": [{"id": "fake-model"}]})

    def do_POST(self) -> None:
        s = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with s.lock:
            s.bodies.append(body)
            k = len(s.bodies)
            s.live += 1
            s.peak = max(s.peak, s.live)
            s.lock.notify_all()
            s.lock.wait_for(lambda: s.live >= s.gather, timeout=2.0 if s.gather else 0)
        try:
            if s.delay:
                time.sleep(s.delay)
            self._answer(s, body, k)
        finally:
            with s.lock:
                s.live -= 1

    def _answer(self, s: Fake, body: dict, k: int) -> None:
        if s.mode == "garbage":
            return self._send(200, b"<html>not json</html>")
        if s.mode == "nochoices":
            return self._send(200, {"id": "x", "object": "weird"})
        if s.mode == "status" and k <= s.fail_first:
            return self._send(s.status, {"error": {"message": f"busy (call {k})"}}, {"Retry-After": "0"})
        prompt = body.get("prompt", body.get("messages"))
        if "BAD" in json.dumps(prompt):
            return self._send(400, {"error": {"message": "bad prompt\nsecond line"}})
        n = 1 if s.ignore_n else body.get("n", 1)
        choices = []
        for i in range(n):
            text = f"Act: s{body.get('seed')}-{i}"
            if s.obey_grammar and "grammar" in body:
                text = f"Think: seed {body.get('seed')}\nAct: look"
            if "prompt" in body:  # like llama-cpp-python: the stop string left in the text
                text += "\nObservation: x"
            pieces = list(text)
            if body.get("return_tokens_as_token_ids"):
                pieces = [f"token_id:{b}" for b in text.encode()]
            lps = [-0.5] * len(pieces)
            if "messages" in body:
                lp = {"content": [{"token": p, "logprob": v} for p, v in zip(pieces, lps)]}
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": lp if body.get("logprobs") else None, "finish_reason": "stop"})
            else:
                lp = {"tokens": pieces, "token_logprobs": lps}
                choices.append({"index": i, "text": text,
                                "logprobs": lp if body.get("logprobs") is not None else None,
                                "finish_reason": "length"})
        self._send(200, {"choices": choices, "usage": {"prompt_tokens": 7, "completion_tokens": 10 * n}})


@pytest.fixture
def fake():
    srv = Fake()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def req(n=1, seed=5, content="hello", **kw) -> GenRequest:
    return GenRequest([{"role": "user", "content": content}],
                      SamplingParams(temperature=0.7, max_tokens=8, n=n, seed=seed, **kw))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- spec and construction -------------------------------------------------------------------
def test_spec_options_and_first_model(fake: Fake) -> None:
    p = make_policy(f"openai:{fake.url}#mine:max_in_flight=2,retries=0,timeout=5")
    assert isinstance(p, OpenAIPolicy)
    assert (p.model, p.max_in_flight, p.retries, p.endpoint, p.tokenizer) == ("mine", 2, 0, "chat", None)
    assert make_policy(f"openai:{fake.url}").model == "fake-model"  # asked GET /models
    for bad, why in (("openai:localhost:8000#m", "expected openai:http"),
                     (f"openai:{fake.url}#m:bogus=1", "bogus"),
                     (f"openai:{fake.url}#m:endpoint=completions", "needs tokenizer"),
                     (f"openai:{fake.url}#m:endpoint=rpc", "endpoint must be"),
                     ("openai:", "give a server URL")):
        with pytest.raises(PolicyError, match=why):
            make_policy(bad)
    with pytest.raises(PolicyError, match="restart it on the new checkpoint"):
        p.reload("/ckpt")


def test_unreachable_server_is_one_line_at_build_and_faults_in_a_search() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(PolicyError, match=r"openai: .*/v1/models: .*\(after 1 retries\)"):
        make_policy(f"openai:{url}:retries=1,backoff=0")
    tasks = api.load_tasks("game24", "test", 2)
    res = api.search_many(tasks, strategy="best_of_n:n=2", seed=0,
                          policy=f"openai:{url}#m:retries=1,backoff=0.01,connect_timeout=1")
    assert [r.success for r in res] == [False, False]
    assert all(r.faults and r.faults[0].startswith("lm: PolicyError: openai:") for r in res)
    assert all(len(r.tree.nodes) == 1 for r in res)


# --- generation ------------------------------------------------------------------------------
def test_chat_n_seeds_logprobs_and_usage(fake: Fake) -> None:
    p = OpenAIPolicy(f"{fake.url}#m")
    [gens] = p.generate([req(n=3, seed=5)])
    assert [g.text for g in gens] == ["Act: s5-0", "Act: s5-1", "Act: s5-2"]
    assert len(fake.bodies) == 1 and fake.bodies[0]["n"] == 3 and fake.bodies[0]["logprobs"] is True
    g = gens[0]
    assert g.token_ids == [] and g.logprobs == [-0.5] * len(g.text)  # no tokenizer: no ids
    assert (g.prompt_tokens, g.completion_tokens, g.finish_reason, g.ended_with_eos) == (
        7, len(g.text), "stop", False)


def test_server_ignoring_n_is_asked_again_with_the_next_seeds(fake: Fake) -> None:
    fake.ignore_n = True
    p = OpenAIPolicy(f"{fake.url}#m")
    [gens] = p.generate([req(n=3, seed=2**31 + 5)])  # seeds are folded to 31 bits
    assert [g.text for g in gens] == ["Act: s5-0", "Act: s6-0", "Act: s7-0"]
    assert [b["n"] for b in fake.bodies][:1] == [3] and len(fake.bodies) == 3
    fake.bodies.clear()
    p.generate([req(n=2, seed=0)])  # learnt: one sample per call from the start
    assert sorted((b["n"], b["seed"]) for b in fake.bodies) == [(1, 0), (1, 1)]


def test_completions_with_a_tokenizer_give_token_ids(fake: Fake) -> None:
    tok = ByteChatTokenizer()
    p = OpenAIPolicy(f"{fake.url}#m", tokenizer=tok)
    assert p.endpoint == "completions"
    ids = tok.encode(tok.render(MSGS, True))
    r = GenRequest(MSGS, SamplingParams(max_tokens=8, seed=1, stop=("\nObservation:",)), prompt_ids=ids)
    [[g]] = p.generate([r])
    assert fake.bodies[-1]["prompt"] == tok.render(MSGS, True) and fake.bodies[-1]["logprobs"] == 0
    assert fake.bodies[-1]["stop"] == ["\nObservation:"]
    assert g.text == "Act: s1-0"  # the stop string the server left in is cut
    assert g.token_ids == tok.encode("Act: s1-0\nObservation: x") and len(g.logprobs) == len(g.token_ids)
    assert g.finish_reason == "length"
    # send_ids: the prompt goes as ids, the completion comes back as ids (vLLM's token_id:N)
    p = OpenAIPolicy(f"{fake.url}#m", tokenizer=tok, send_ids=True)
    [[g]] = p.generate([r])
    assert fake.bodies[-1]["prompt"] == ids and fake.bodies[-1]["return_tokens_as_token_ids"] is True
    assert g.token_ids == list(b"Act: s1-0\nObservation: x")


def test_requests_run_in_parallel_up_to_max_in_flight(fake: Fake) -> None:
    fake.gather, fake.delay = 3, 0.05  # calls wait for each other: overlap is certain if parallel
    p = OpenAIPolicy(f"{fake.url}#m", max_in_flight=3)
    out = p.generate([req(seed=i) for i in range(6)])
    assert [g[0].text for g in out] == [f"Act: s{i}-0" for i in range(6)]  # input order
    assert fake.peak == 3


def test_429_then_ok_is_retried(fake: Fake) -> None:
    fake.mode, fake.status, fake.fail_first = "status", 429, 2
    p = OpenAIPolicy(f"{fake.url}#m", retries=3, backoff=0.01)
    [[g]] = p.generate([req()])
    assert g.text == "Act: s5-0" and len(fake.bodies) == 3


def test_5xx_gives_up_after_the_retries(fake: Fake) -> None:
    fake.mode, fake.status, fake.fail_first = "status", 503, 99
    p = OpenAIPolicy(f"{fake.url}#m", retries=2, backoff=0.01)
    with pytest.raises(PolicyError, match=r"HTTP 503: busy \(call 3\) \(after 2 retries\)"):
        p.generate([req()])
    assert len(fake.bodies) == 3


@pytest.mark.parametrize("mode, why", [("garbage", "answered with no JSON"),
                                       ("nochoices", "malformed answer")])
def test_garbage_is_one_line_and_not_retried(fake: Fake, mode: str, why: str) -> None:
    fake.mode = mode
    p = OpenAIPolicy(f"{fake.url}#m", retries=3, backoff=0.01)
    with pytest.raises(PolicyError, match=why) as err:
        p.generate([req()])
    assert "\n" not in str(err.value) and len(fake.bodies) == 1


def test_timeout_is_retried_then_one_line_never_a_hang(fake: Fake) -> None:
    fake.delay = 3.0
    p = OpenAIPolicy(f"{fake.url}#m", timeout=0.2, retries=1, backoff=0.01)
    t0 = time.monotonic()
    with pytest.raises(PolicyError, match=r"timed out \(ReadTimeout\) \(after 1 retries\)"):
        p.generate([req()])
    assert time.monotonic() - t0 < 2.5 and len(fake.bodies) == 2


def test_one_failing_request_does_not_lose_the_others(fake: Fake) -> None:
    p = OpenAIPolicy(f"{fake.url}#m", backoff=0.01)
    reqs = [req(seed=1), req(seed=2, content="BAD"), req(seed=3)]
    with pytest.raises(PolicyError, match=r"HTTP 400: bad prompt \(1 of 3 requests failed\)"):
        p.generate(reqs)
    assert len(fake.bodies) == 3  # a 400 is not retried
    # the engine then asks one request at a time: answered from that batch, no new HTTP call
    reqs = [req(seed=1), req(seed=2, content="BAD"), req(seed=3)]
    out = Engine(p).generate(reqs)
    assert [o[0].text if isinstance(o, list) else "error" for o in out] == ["Act: s1-0", "error", "Act: s3-0"]
    assert isinstance(out[1], PolicyError) and "bad prompt" in str(out[1])
    assert len(fake.bodies) == 3 + 3 and not p._memo  # one HTTP call per request, all used
    p.generate(reqs[:1])  # asked again later: a new call
    assert len(fake.bodies) == 7


def test_streamed_requests_are_answered_as_they_finish(fake: Fake) -> None:
    """submit/collect: calls run at once (up to max_in_flight), each answer comes back with its
    ticket as soon as it is there; a failing request fails alone."""
    fake.gather, fake.delay = 2, 0.05
    p = OpenAIPolicy(f"{fake.url}#m", max_in_flight=2, backoff=0.01)
    p.submit([(7, req(seed=1)), (8, req(seed=2, content="BAD")), (9, req(seed=3))])
    got: dict = {}
    while len(got) < 3:
        got.update(p.collect())
    assert got[7][0].text == "Act: s1-0" and got[9][0].text == "Act: s3-0"
    assert isinstance(got[8], PolicyError) and "bad prompt" in str(got[8])
    assert fake.peak == 2 and p.collect() == []


def test_engine_streams_to_the_server_and_trees_match_batched_calls(fake: Fake) -> None:
    """A seeded search: streaming (default) and batched ``generate`` calls (lockstep) send the
    same requests and build the same trees; the garbage-free fake answers by seed."""
    tasks = api.load_tasks("game24", "test", limit=3)
    runs = {}
    for schedule in ("continuous", "lockstep"):
        fake.bodies.clear()
        p = OpenAIPolicy(f"{fake.url}#m", max_in_flight=4)
        res = api.search_many(tasks, strategy="best_of_n:n=2", policy=p, seed=0, max_depth=2,
                              schedule=schedule)
        runs[schedule] = ([r.to_dict()["tree"] for r in res],
                          sorted(json.dumps(b, sort_keys=True) for b in fake.bodies))
        p.close()
    assert runs["continuous"] == runs["lockstep"]


# --- grammars: sent in the server's fields, every answer checked on the client ---------------
def test_grammar_goes_in_the_fields_and_ignoring_servers_are_caught(fake: Fake) -> None:
    pytest.importorskip("xgrammar")
    from omrl_search.constrain import Grammar

    grammar = Grammar.one_of(["look", "take key"], source="room")
    p = OpenAIPolicy(f"{fake.url}#m")
    r = GenRequest(MSGS, SamplingParams(max_tokens=8, n=2, seed=5), grammar=grammar)
    [gens] = p.generate([r])  # the fake ignores grammars, like a server without support
    body = fake.bodies[-1]
    assert body["grammar"] == grammar.text and body["structured_outputs"] == {"grammar": grammar.text}
    assert [(g.constraint, g.constraint_check, g.constrained) for g in gens] == [("none", "violated", False)] * 2
    assert p.grammar_violations == 2
    fake.obey_grammar = True
    [gens] = p.generate([r])
    assert [(g.text, g.constraint, g.constraint_check) for g in gens] == [
        ("Think: seed 5\nAct: look", "actions", "ok"), ("Think: seed 5\nAct: look", "actions", "ok")]
    assert p.grammar_violations == 2
    [[g]] = p.generate([req()])  # no grammar: nothing sent, nothing stamped
    assert "grammar" not in fake.bodies[-1] and (g.constraint, g.constraint_check) == ("none", "")
    q = OpenAIPolicy(f"{fake.url}#m", grammar_fields="guided_grammar,ebnf")
    q.generate([r])
    assert {k: fake.bodies[-1].get(k) for k in ("grammar", "guided_grammar", "ebnf")} == {
        "grammar": None, "guided_grammar": grammar.text, "ebnf": grammar.text}
    with pytest.raises(PolicyError, match="grammar_fields takes grammar, structured_outputs"):
        OpenAIPolicy(f"{fake.url}#m", grammar_fields="json")
    bad = Grammar.from_rules('action ::= "go " dir', source="maze")
    with pytest.raises(PolicyError, match="openai: grammar from maze does not compile") as e:
        p.generate([GenRequest(MSGS, SamplingParams(max_tokens=4), grammar=bad)])
    assert "\n" not in str(e.value)


# --- for real: llama-cpp-python's server on the bundled SmolLM2 -------------------------------
@pytest.fixture(scope="module")
def llama_server():
    """python -m llama_cpp.server on the bundled GGUF (with llama.cpp's AMX kernels off: they
    segfault on this CPU), started for this module and stopped by its PID."""
    pytest.importorskip("llama_cpp.server")
    from omrl_search.backends.llamacpp_server import serving
    from omrl_search.backends.smollm2 import gguf_path

    with serving(gguf_path(), alias="smollm2", threads=1) as url:
        yield url


def test_best_of_n_through_llama_cpp_server(llama_server: str) -> None:
    # llama-cpp-python ignores n: the second sample is asked for in a second call
    task = api.load_tasks("game24", "test", 1)[0]
    [r] = api.search_many([task], strategy="best_of_n:n=2", policy=f"openai:{llama_server}#smollm2",
                          seed=0, max_depth=1, sampling=SamplingParams(temperature=0.7, max_tokens=12))
    assert r.faults == [] and r.spent["lm_calls"] == 1 and r.spent["prompt_tokens"] > 100
    kids = r.tree.nodes[1:]
    assert len(kids) == 2 and all(k.step.completion.strip() for k in kids)
    assert kids[0].step.completion != kids[1].step.completion  # seeds s and s + 1
    assert 0 < r.spent["completion_tokens"] <= 24


def test_completions_mode_ids_match_the_in_process_backend(llama_server: str) -> None:
    from omrl_search.backends.llamacpp import LlamaCppPolicy

    # flash attention off like the server's default (with it on, SmolLM2's logprobs move by up to 0.14)
    local = make_policy("smollm2:llamacpp:n_ctx=512,max_batch=1,n_threads=1,flash_attn=false")
    assert isinstance(local, LlamaCppPolicy)
    try:
        p = OpenAIPolicy(f"{llama_server}#smollm2", tokenizer=local.tokenizer)
        tok = local.tokenizer
        ids = tok.encode(tok.render(MSGS, True))
        greedy = SamplingParams(temperature=0.0, max_tokens=10)
        [[g]] = p.generate([GenRequest(MSGS, greedy, ids)])
        assert g.prompt_tokens == len(ids)  # the server read our rendered prompt back as our ids
        assert len(g.token_ids) == len(g.logprobs) == g.completion_tokens > 0
        assert tok.decode(g.token_ids) == g.text and g.text.strip()
        [[mine]] = local.generate([GenRequest(MSGS, greedy, ids)])
        # same model, greedy: same tokens (the server drops the end-of-turn token) and logprobs
        n = len(g.token_ids)
        assert g.token_ids == mine.token_ids[:n] and set(mine.token_ids[n:]) <= tok.eos_token_ids
        assert g.logprobs == pytest.approx(mine.logprobs[:n], abs=1e-3)
    finally:
        local.close()


def test_cli_search_through_llama_cpp_server(llama_server: str, tmp_path) -> None:
    from omrl_search.cli import main
    from omrl_search.result import read_results

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["search", "--env", "game24", "--limit", "2", "--policy", f"openai:{llama_server}#smollm2",
                   "--max-tokens", "8", "--max-depth", "1", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    row = buf.getvalue().splitlines()[-2].split()
    assert row[0] == "react" and row[1].endswith("/2") and row[-1] == "0"  # two tasks, no faults
    results = list(read_results(tmp_path / "results.jsonl"))
    assert [len(r.tree.nodes) for r in results] == [2, 2]
    assert all(r.tree.nodes[1].step.completion for r in results)


def test_grammar_through_llama_cpp_server(llama_server: str) -> None:
    """llama-cpp-python's server applies the ``grammar`` field: every answer is in the language."""
    pytest.importorskip("xgrammar")
    from omrl_search.constrain import Grammar

    grammar = Grammar.one_of(["look", "take key", "open door"], source="room", think=None, act="Act: ")
    p = OpenAIPolicy(f"{llama_server}#smollm2")
    reqs = [GenRequest(MSGS, SamplingParams(temperature=1.0, max_tokens=16, seed=s), grammar=grammar)
            for s in range(3)]
    for [g] in p.generate(reqs):
        assert (g.constraint, g.constraint_check) == ("actions", "ok"), g.text
        assert g.text in ("Act: look", "Act: take key", "Act: open door")
    assert p.grammar_violations == 0
