"""Search strategies, one file per algorithm; importing the package registers them."""
from . import beam, best_of_n, dfsdt, got, mcts, react, tot  # noqa: F401
