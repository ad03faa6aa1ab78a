"""Shared fixtures. Heavy imports stay inside the fixtures so test files that don't use them
collect without torch/transformers."""
from __future__ import annotations

import random

import pytest

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "Think: I should look at the room first. Act: look",
    "Think: the key is on the table, take it. Act: take key",
    "Act: open door with key",
    "Observation: You are in a kitchen. There is a table, a fridge and a door.",
    "You are a helpful agent. Solve the task step by step.",
    "the quick brown fox jumps over the lazy dog 0123456789 !?.,:;()[]",
]


@pytest.fixture(autouse=True)
def _trainers_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainers' ``dtype: auto`` takes bf16 on CPUs with native bf16; the tests' loss and resume
    checks are written for fp32, so they get the same numbers on every host. A test that wants the
    host-dependent choice patches ``train.runtime.bf16_native`` itself."""
    monkeypatch.setattr("train.runtime.bf16_native", lambda: False)


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random LlamaForCausalLM and a locally trained byte-level BPE tokenizer with a
    ChatML template, saved with ``save_pretrained``; returns the folder."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML

    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,  # peaky distributions: greedy has no near-ties
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    folder = tmp_path_factory.mktemp("tiny_hf_model")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def _agent_corpus():
    """Text like the training data: the engine's game24 prompts, completions and observations."""
    import omrl_search as om
    from omrl_search.agent import ReActFormat
    from omrl_search.env import make_env

    fmt, env, rng = ReActFormat(), make_env("game24"), random.Random(0)
    out = []
    for task in om.load_tasks("game24", "train", limit=40):
        obs = env.reset(task)
        out += [m["content"] for m in fmt.first_messages(env, task, obs)]
        action = env.expert_action()  # the oracle's demonstration: the reason, then the move
        out.append(f"Think: {env.explain(action, rng)}\nAct: {action}")
    return out * 3


@pytest.fixture(scope="session")
def tiny_agent_model(tmp_path_factory):
    """A tiny random Llama with a ChatML BPE tokenizer trained on game24 prompts (so sequences
    are a few hundred tokens, not a thousand characters): fast trainer tests."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(_agent_corpus(), trainer=trainers.BpeTrainer(
        vocab_size=1200, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                               pad_token="<|endoftext|>",
                                               additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        initializer_range=0.3, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_agent_model")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def _fail_missing_package_skips(report) -> None:
    """Under ``CI=true`` a skip because a package is missing becomes a failure: `make test`
    installs every extra, so such a skip means the Makefile lost an install step."""
    import os

    if os.environ.get("CI") == "true" and report.skipped and "could not import" in str(report.longrepr):
        why = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome, report.longrepr = "failed", f"CI: missing package ({why})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ARG001
    outcome = yield
    _fail_missing_package_skips(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):  # noqa: ARG001
    outcome = yield
    _fail_missing_package_skips(outcome.get_result())


# --- system packages `make install` could not install (no root, no sudo) ------------------------
#: env name -> (program it needs, the skip reason naming the install command)
_SYSTEM_NEEDS = {
    "os": ("bwrap", "bubblewrap is not installed (the os env's sandbox): sudo apt-get install -y bubblewrap"),
    "sciworld": ("java", "Java is not installed (ScienceWorld): sudo apt-get install -y default-jre-headless"),
}


def pytest_collection_modifyitems(config, items):  # noqa: ARG001
    """Skip, with the command to run, the tests of an env whose system program is missing: the
    env's own test file, and every parametrised test whose env parameter names it."""
    import shutil

    missing = {env: reason for env, (prog, reason) in _SYSTEM_NEEDS.items() if shutil.which(prog) is None}
    if not missing:
        return
    files = {"os": "test_envs_os.py", "sciworld": "test_envs_sciworld.py"}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        names = {str(v).split("-")[0] for v in params.values() if isinstance(v, str)}
        for env, reason in missing.items():
            if item.path.name == files[env] or env in names:
                item.add_marker(pytest.mark.skip(reason=reason))
