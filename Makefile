# Every command runs in the project virtualenv .venv, built by scripts/setup_env.sh (idempotent).
PY := .venv/bin/python

.PHONY: setup demo test test-slow test-all workloads target target-long drafter
setup:
	bash scripts/setup_env.sh

demo: setup                    ## no speculation vs DLite on 8 held-out agent turns (vLLM V1, CPU; 2 min after set-up)
	$(PY) examples/offline_generate.py

test: setup                    ## every test under ~20 s (2.5 min on this 2-core host)
	$(PY) -m pytest -q --durations=15 -m "not slow" tests

test-slow: setup               ## the engine end-to-end tests (vLLM engines and servers, Model Runner V1 and V2)
	$(PY) -m pytest -q --durations=15 -m slow tests

test-all: test test-slow       ## both (CI runs this)

workloads: setup               ## regenerate the shipped held-out workload files
	for k in agentic:24 code:64 chat:64; do \
	  $(PY) -m vllm_dlite.train.workloads.generator --kind $${k%%:*} --split heldout -n $${k##*:} --seed 1 \
	    --out benchmarks/workloads/heldout_$${k%%:*}.jsonl; done
	$(PY) -m vllm_dlite.train.workloads.generator --kind code --context file --split heldout -n 30 --seed 1 \
	  --out benchmarks/workloads/heldout_code_long_file.jsonl

target: setup                  ## retrain the tiny target on this machine (~50 min + 50 min on 2 cores; the shipped one: scripts/gpu_session.sh)
	$(PY) -m lab.target.train --out models/qwen3-tiny-stdlib
	$(PY) -m lab.target.sft --target models/qwen3-tiny-stdlib
	$(MAKE) target-long

target-long: setup             ## the target's long-context stage alone, from the shipped weights (50 min on 2 cores; resumable)
	$(PY) -m lab.target.long --target models/qwen3-tiny-stdlib --time-budget-s 3000

drafter: setup                 ## retrain the shipped DLite drafter (configs/dlite-tiny.yaml)
	bash scripts/train_drafter_tiny.sh
