"""Public hypothesis strategies, one module per input family: the cache formats (``cache``, re-exported
here, so ``from dsv4_numerics.strategies import bf16_rows`` works), the attention stages
(``attention``), the index plumbing (``index``) and the DeepSeek-V4.1 records (``v41``)."""

from dsv4_numerics.strategies.cache import *  # noqa: F401,F403
from dsv4_numerics.strategies.cache import __all__  # noqa: F401
