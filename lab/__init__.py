"""The project's lab, beside the runtime (``vllm_dlite``) and not installed with it: run from the
repository root (``python -m lab.target.train``; pytest and the benchmarks put the root on the path).

* :mod:`lab.target`: the tiny Qwen3 target recipe (tokenizer, pre-training, SFT, the long stage,
  evaluation by prompt length).
* :mod:`lab.harness`: replaying requests through vLLM engines (:mod:`lab.harness.replay`), ``vllm
  serve`` as a child process (:mod:`lab.harness.server`), checkpoint fault injection
  (:mod:`lab.harness.faults`).
* :mod:`lab.buckets`: the prompt-length buckets of every acceptance table (``benchmarks/ab.py``
  and the lab's experiments).

Floors, each importing only those before it: ``vllm_dlite`` (runtime) -> ``vllm_dlite.train``
(drafter training, the ``train`` extra) -> ``lab`` -> ``benchmarks`` / ``examples`` / ``tests``.
"""
