"""Search strategies, one file per algorithm; importing the package registers them."""
from . import best_of_n, react  # noqa: F401
