"""Measuring vLLM engines and servers: replay (:mod:`.replay`), ``vllm serve`` (:mod:`.server`),
fault injection (:mod:`.faults`), a function in a fresh process (:mod:`.processes`). Engines are
built by :mod:`vllm_dlite.vllm.engine`."""
