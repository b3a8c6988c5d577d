"""vllm-dlite: DLite history-free speculative decoding for vLLM.

Layout (one home per concern):
  config.py   the ``dlite_config`` block of a draft checkpoint, validated
  model/      the method in plain PyTorch (no vLLM import): the drafter, checkpoint loading and
              checking, the training teacher
  ops/        draft attention and sequential head: CUDA op or PyTorch reference
  vllm/       the runtime's vLLM glue (plugin, compat, draft model, V1 proposer, V2 speculator,
              CPU fixes); the runtime imports vLLM nowhere else
  train/      drafter training (the ``train`` extra, never imported by the runtime): data
              regeneration with vLLM, the training sessions (``vllm_dlite/train/workloads/``:
              format, generator, replay), the offline acceptance estimator
              (``vllm_dlite/train/offline_eval.py``)

Beside the package, not installed with it: ``lab/`` (the tiny Qwen3 target recipe, the engine
harness, experiments), ``benchmarks/``, ``tests/``.
"""

__version__ = "0.1.0"
