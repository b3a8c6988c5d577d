"""The prompt-length buckets every acceptance figure is reported in (the tables of
``benchmarks/ab.py``, and the lab's analyses of its runs: ``lab/experiments/copy_share.py``,
``tau_gap.py``, ``draft_sources.py``).

A bucket is ``(name, first token count, one past the last)``, k = 1024; a prompt longer than 32k
tokens is in none. No imports: the lab reads this without setting up vLLM as ``ab.py`` does. It
lives in the lab, not beside ``ab.py``, because the lab's floor is below the benchmarks'
(``lab/__init__.py``): both may import it here.
"""

PROMPT_BUCKETS = (("0-2k", 0, 2048), ("2k-8k", 2048, 8192), ("8k-32k", 8192, 32768))


def prompt_bucket(tokens: int) -> str | None:
    """The name of the bucket holding a prompt of ``tokens`` tokens (None: longer than 32k)."""
    return next((name for name, lo, hi in PROMPT_BUCKETS if lo <= tokens < hi), None)
