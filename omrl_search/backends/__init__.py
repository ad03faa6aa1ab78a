"""Policy backends bundled with the core: ``scripted``, ``hf``, ``llamacpp``, ``smollm2``,
``openai``, ``vllm``.

Each is listed in ``pyproject.toml`` as an ``omrl_search.policies`` entry point and imported only
when a policy of its name is built (docs/design.md §7); ``hf_tokenizer``, ``llamacpp_grammar``
and ``_``-prefixed modules are helpers. Each backend imports its heavy dependency (torch,
llama_cpp, vllm, httpx) only when a policy is built, so ``import omrl_search`` stays light.
"""
