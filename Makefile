# Every command runs in the project virtualenv .venv, built by scripts/setup_env.sh (idempotent).
PY := .venv/bin/python

.PHONY: setup demo test test-slow test-all test-v2-serving setup-vllm034 test-vllm034 test-vllm034-ci workloads target target-long drafter
PY034 := .venv-vllm034/bin/python
# The engine checks that run on vLLM 0.34 (V2 only; V1-only tests skip themselves, see pytest.ini's v1 marker)
VLLM034_TESTS := tests/test_runners.py tests/test_vllm_integration.py tests/test_vllm_sampling.py \
	tests/test_tensor_parallel.py tests/test_shipped_models.py tests/test_sampling_matrix.py \
	tests/test_serving_faults.py tests/test_session_replay.py tests/test_baselines.py
# CI's 0.34 subset: the shipped drafter lossless on 16 held-out turns, a random G=2 drafter lossless,
# one greedy request to a vllm serve with DLite (against a plain server)
VLLM034_CI := "tests/test_shipped_models.py::test_lossless_greedy_on_agentic_and_code_turns[v2]" \
	"tests/test_vllm_integration.py::test_greedy_lossless_random_drafter[v2-2-4]" \
	"tests/test_sampling_matrix.py::test_greedy[v2]"
setup:
	bash scripts/setup_env.sh

demo: setup                    ## no speculation vs DLite: 2 agent sessions one at a time, turn after turn, and 8 turns in one batch (vLLM V1, CPU)
	$(PY) examples/offline_generate.py

test: setup                    ## every test under ~20 s (2.5 min on this 2-core host)
	$(PY) -m pytest -q --durations=15 -m "not slow" tests

test-slow: setup               ## the engine end-to-end tests (vLLM engines and servers, Model Runner V1 and V2)
	$(PY) -m pytest -q --durations=15 -m slow tests

test-all: test test-slow       ## both (CI runs this)

test-v2-serving: setup         ## every vllm serve check on Model Runner V2 (vLLM 0.32; also part of test-slow)
	$(PY) -m pytest -q --durations=15 -m slow -k v2 tests/test_sampling_matrix.py tests/test_serving_faults.py \
	  tests/test_session_replay.py

setup-vllm034:                 ## builds .venv-vllm034: vLLM 0.34 for CPU (scripts/setup_vllm034.sh; the wheel in ../shared/wheels/)
	bash scripts/setup_vllm034.sh

test-vllm034: setup setup-vllm034  ## every engine check on vLLM 0.34's Model Runner V2 (through the V2 harness)
	$(PY034) -m pytest -q -rs --durations=25 $(VLLM034_TESTS)

test-vllm034-ci: setup setup-vllm034  ## CI's 0.34 subset
	$(PY034) -m pytest -q --durations=10 $(VLLM034_CI)

workloads: setup               ## regenerate the shipped held-out workload files
	for k in agentic:24 code:64 chat:64; do \
	  $(PY) -m vllm_dlite.train.workloads.generator --kind $${k%%:*} --split heldout -n $${k##*:} --seed 1 \
	    --out benchmarks/workloads/heldout_$${k%%:*}.jsonl; done
	$(PY) -m vllm_dlite.train.workloads.generator --kind code --context file --split heldout -n 30 --seed 1 \
	  --out benchmarks/workloads/heldout_code_long_file.jsonl
	$(PY) -m vllm_dlite.train.workloads.generator --kind code --context docstring --split heldout -n 40 --seed 1 \
	  --out benchmarks/workloads/heldout_code_docstring.jsonl

target: setup                  ## retrain the tiny target on this machine (~50 min + 50 min on 2 cores; the shipped one: scripts/gpu_session.sh)
	$(PY) -m lab.target.train --out models/qwen3-tiny-stdlib
	$(PY) -m lab.target.sft --target models/qwen3-tiny-stdlib
	$(MAKE) target-long

target-long: setup             ## the target's long-context stage alone, from the shipped weights (50 min on 2 cores; resumable)
	$(PY) -m lab.target.long --target models/qwen3-tiny-stdlib --time-budget-s 3000

drafter: setup                 ## retrain the shipped DLite drafter (configs/dlite-tiny.yaml)
	bash scripts/train_drafter_tiny.sh
