"""Policy backends; importing this package registers their spec names.

Each backend module imports its heavy dependency (torch, llama_cpp) only when a policy is built,
so ``import omrl_search`` stays light.
"""
from . import scripted  # noqa: F401

for _name in ("hf", "llamacpp", "smollm2"):
    try:
        __import__(f"{__name__}.{_name}")
    except ImportError as _exc:  # a module not written yet or a broken optional install
        if _exc.name != f"{__name__}.{_name}":
            raise
