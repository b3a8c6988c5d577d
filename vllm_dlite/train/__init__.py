"""Drafter training (the ``train`` extra: ``pip install -e .[train]``), beside the runtime.

``python -m vllm_dlite.train`` (:mod:`.cli`) regenerates on-policy data with vLLM (:mod:`.data`
from the sessions of :mod:`.workloads`), trains the history teacher and the two stages
(:mod:`.trainer`), exports a ``dlite_v1`` checkpoint and estimates its acceptance offline
(:mod:`.offline_eval`). The EAGLE-3 / DFlash / DSpark baselines train on the
same data. The runtime (``vllm_dlite.config``, ``.model``, ``.ops``, ``.vllm``) never imports it.
"""
