"""The base of every error pagedkv raises on purpose (pure Python: the memory core imports it).

Each subclass also keeps the built-in base it always had (``ValueError``, ``RuntimeError``, ...),
so ``except ValueError`` keeps working; ``except PagedKVError`` catches all of pagedkv's own. The
``pagedkv`` command prints any of them as one line on stderr and exits 2, never with a traceback.
"""


class PagedKVError(Exception):
    """An error pagedkv raised on purpose; its message says what went wrong and what to change."""
