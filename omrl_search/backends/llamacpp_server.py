"""llama-cpp-python's OpenAI-compatible server, with llama.cpp's extra CPU buffer types off.

``python -m omrl_search.backends.llamacpp_server --model FILE.gguf --host 127.0.0.1 --port 8000``
takes the arguments of ``python -m llama_cpp.server`` and runs it after one change: models load
with ``use_extra_bufts = False``. With them on, llama.cpp picks its AMX kernels for Q4_1 weights
on CPUs with AMX (Sapphire Rapids and later, like the development VM) and the server dies with a
segfault in ``ggml_backend_amx_mul_mat`` at the first request; the in-process ``llamacpp``
backend turns them off for the same reason (its ``extra_bufts`` option). Elsewhere the plain
``python -m llama_cpp.server`` works the same.

:func:`serving` runs it as a subprocess for as long as a ``with`` block (tests, benchmarks).

Prefix reuse in this server (llama-cpp-python 0.3): one sequence, one slot. Each request reuses
the KV of the longest prefix it shares with the tokens the previous request left in the context
(always on, no option turns it off), so a next turn or a search-tree child sent right after its
parent prefills only its new tokens. ``--cache True --cache_size BYTES`` (``serving(...,
prefix_cache_mb=N)``) adds an LRU of whole-context states in RAM, saved after every completion
and restored when one shares a longer prefix with the new prompt than the context does. The
server reports no count of cached tokens in its usage, so Generations from it carry
``cached_tokens=0`` and budgets count their prompts as prefill. It has no slots to pin (llama.cpp's
own ``llama-server`` has ``cache_prompt`` and ``--slot-save-path``; this one does not).
"""
from __future__ import annotations

import contextlib
from typing import Iterator


def _without_extra_bufts() -> None:
    """Make every ``llama_model_default_params()`` the server asks for have extra bufts off."""
    import llama_cpp.llama_cpp as ll

    default = ll.llama_model_default_params

    def params():  # noqa: ANN202 - a ctypes struct
        p = default()
        if hasattr(p, "use_extra_bufts"):
            p.use_extra_bufts = False
        return p

    ll.llama_model_default_params = params


@contextlib.contextmanager
def serving(model: str, *, alias: str = "model", threads: int = 1, n_ctx: int = 2048,
            deadline_s: float = 90.0, prefix_cache_mb: float = 0,
            extra: tuple[str, ...] = ()) -> Iterator[str]:
    """Serve ``model`` (a GGUF file) on a free local port; yields the base URL (``.../v1``)
    once ``GET /v1/models`` answers, and stops the server (by its PID) on leaving. A server that
    exits or is not up within ``deadline_s`` is a RuntimeError with the end of its stderr.
    ``prefix_cache_mb`` > 0 turns on the server's RAM cache of saved states, that many MB."""
    import socket
    import subprocess
    import sys
    import tempfile
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    cache = ("--cache", "True", "--cache_type", "ram", "--cache_size", str(int(prefix_cache_mb * 2**20))) \
        if prefix_cache_mb > 0 else ()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__, "--model", model, "--host", "127.0.0.1",
             "--port", str(port), "--n_threads", str(threads), "--n_ctx", str(n_ctx),
             "--model_alias", alias, "--verbose", "False", *cache, *extra],
            stdout=subprocess.DEVNULL, stderr=log)
        try:
            end = time.monotonic() + deadline_s
            while True:
                if proc.poll() is not None or time.monotonic() > end:
                    log.seek(0)
                    tail = log.read().decode(errors="replace").strip()[-400:]
                    state = f"exited ({proc.returncode})" if proc.poll() is not None else \
                        f"not up after {deadline_s:.0f} s"
                    raise RuntimeError(f"llama.cpp server {state}: {tail}")
                try:
                    if httpx.get(f"{url}/models", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.3)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> None:
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see backends/llamacpp.py
    try:
        from llama_cpp.server.__main__ import main as serve
    except ImportError:
        raise SystemExit("this server needs llama-cpp-python[server]: "
                         "pip install 'llama-cpp-python[server]'") from None
    _without_extra_bufts()
    serve()


if __name__ == "__main__":
    main()
