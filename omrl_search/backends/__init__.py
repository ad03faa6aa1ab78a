"""Policy backends; importing this package registers their spec names.

Every public module here is a backend and is imported (``hf_tokenizer`` and ``_``-prefixed
modules are helpers, imported by the backends that use them). Each backend imports its heavy
dependency (torch, llama_cpp, vllm, httpx) only when a policy is built, so ``import
omrl_search`` stays light.
"""
import importlib as _importlib
import pkgutil as _pkgutil

for _mod in sorted(m.name for m in _pkgutil.iter_modules(__path__)):
    if not _mod.startswith("_") and _mod != "hf_tokenizer":
        _importlib.import_module(f"{__name__}.{_mod}")
