"""Measuring vLLM engines and servers: replay (:mod:`.replay`), ``vllm serve`` (:mod:`.server`),
fault injection (:mod:`.faults`). Engines are built by :mod:`vllm_dlite.vllm.engine`."""
