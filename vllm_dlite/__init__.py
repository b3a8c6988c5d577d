"""vllm-dlite: DLite history-free speculative decoding for vLLM.

Layout (one home per concern):
  config.py   the ``dlite_config`` block of a draft checkpoint, validated
  model/      the method in plain PyTorch (no vLLM import)
  ops/        draft attention and sequential head: CUDA op or PyTorch reference
  vllm/       all vLLM glue (plugin, draft model, proposers); nothing else imports vLLM
  train/      drafter training pipeline
  eval/       offline acceptance estimator
  workloads/  agentic/code/chat session generator and replay helper
  target/     the tiny Qwen3 target recipe (tokenizer, corpus, training)
"""

__version__ = "0.1.0"
