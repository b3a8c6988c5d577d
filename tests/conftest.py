"""Shared fixtures: the shipped tiny target + DLite drafter replayed through vLLM once per session.

``tok``: the shipped tiny target's tokenizer (once per session).
``models``: a tiny random target with a random and a copy drafter (``helpers_vllm.tiny_models``),
built once per session for every engine test that needs no trained weights.
``greedy``: greedy sampling of the test module's ``MAX_TOKENS`` (default 16) tokens, EOS ignored.
``shipped_requests``: 8 held-out agentic + 8 held-out code turns (prompts <= 3,072 tokens).
``runner``: the vLLM model runner under test, ``v1`` and ``v2`` (module-scoped parameter).
``shipped_replays``: those prompts through a fresh vLLM engine on that runner (fresh process; fp32,
greedy, K = 7, 48 new tokens, ``max_num_seqs`` 4) without speculation (``"none"``) and with DLite
(``"dlite"``), as ``{summary, outputs, draft_rounds, runner}`` from ``replay_in_fresh_process``;
computed once per runner per session (:func:`shipped_replays_on`). The two engines run side
by side, each in its own process (one OpenMP thread each; their start-up, mostly vLLM's
single-threaded model compilation, then overlaps on two cores; nothing compared depends on timing). Used by
``test_shipped_models.py`` and, as the TP=1 reference, by ``test_tensor_parallel.py``.
"""

from __future__ import annotations


import pytest

from lab.harness.runners import available_runners, use_runner  # noqa: E402
from paths import DRAFTER_DIR, TARGET_DIR, WORKLOADS  # noqa: E402
from vllm_dlite.vllm.compat import installed_version  # noqa: E402

if available_runners() == ("v2",):
    # vLLM 0.34 (make test-vllm034): Model Runner V2 is all there is, so this process is set up for it
    # too, before anything imports vLLM: config checks and engines then run here as in a V2 child.
    use_runner("v2")

SHIPPED_K = 7
SHIPPED_MAX_TOKENS = 48
SHIPPED_MAX_PROMPT_TOKENS = 3072
SHIPPED_REQUESTS_PER_KIND = 8


def replay_shipped(prompts: list[list[int]], method: str, tensor_parallel_size: int = 1,
                   runner: str = "v1") -> dict:
    """One fresh engine over the shipped target (``method`` = none / dlite), in its own process set
    up for ``runner``."""
    import helpers_vllm as H

    from lab.harness.replay import replay_in_fresh_process
    from vllm_dlite.vllm.engine import speculative_config

    env = dict(H.vllm_env())
    if tensor_parallel_size > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ""  # the engine builder pins one core group per rank
    opts = dict(dtype="float32", max_model_len=SHIPPED_MAX_PROMPT_TOKENS + SHIPPED_MAX_TOKENS + 16, seed=0,
                max_num_seqs=4, temperature=0.0, max_tokens=SHIPPED_MAX_TOKENS,
                tensor_parallel_size=tensor_parallel_size, env=env, runner=runner)
    spec = speculative_config(method, SHIPPED_K, DRAFTER_DIR)
    return replay_in_fresh_process(TARGET_DIR, spec, prompts, opts)


_SHIPPED_REPLAYS: dict[str, dict] = {}


def shipped_replays_on(runner: str, shipped_requests) -> dict:
    """``{"none": ..., "dlite": ...}`` replays of ``shipped_requests`` on ``runner``, once per session
    (the two engines side by side, each in its own process)."""
    if runner not in _SHIPPED_REPLAYS:
        from concurrent.futures import ThreadPoolExecutor

        prompts = [r.prompt_token_ids for r in shipped_requests]
        methods = ("none", "dlite")
        with ThreadPoolExecutor(len(methods)) as pool:
            runs = [pool.submit(replay_shipped, prompts, method, 1, runner) for method in methods]
            _SHIPPED_REPLAYS[runner] = {method: run.result() for method, run in zip(methods, runs)}
    return _SHIPPED_REPLAYS[runner]


@pytest.fixture(scope="module", params=("v1", "v2"))
def runner(request):
    """The vLLM model runner under test: ``v1`` in the test process, ``v2`` in fresh processes set up
    by :mod:`lab.harness.runners` (Model Runner V2 through Triton's interpreter on this CPU).
    ``v1`` is skipped where the installed vLLM has no V1 (0.34: ``make test-vllm034``)."""
    if request.param not in available_runners():
        pytest.skip(f"vLLM {installed_version()} has no Model Runner {request.param.upper()}")
    return request.param


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.v1``: the test runs vLLM's Model Runner V1 (or its modules) in the test
    process; skipped where the installed vLLM has none (0.34)."""
    if "v1" in available_runners():
        return
    skip = pytest.mark.skip(reason=f"vLLM {installed_version()} has no Model Runner V1")
    for item in items:
        if item.get_closest_marker("v1"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tok():
    """The shipped tiny target's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TARGET_DIR))


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    import helpers_vllm as H

    return H.tiny_models(tmp_path_factory.mktemp("dlite_tiny_models"))


@pytest.fixture(scope="module")
def greedy(request):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=getattr(request.module, "MAX_TOKENS", 16), ignore_eos=True)


def load_shipped_requests():
    """8 held-out agentic + 8 held-out code turns (prompts <= 3,072 tokens)."""
    from transformers import AutoTokenizer

    from vllm_dlite.train.offline_eval import load_requests

    tok = AutoTokenizer.from_pretrained(str(TARGET_DIR))
    return load_requests(tok, [str(WORKLOADS / "heldout_agentic.jsonl"), str(WORKLOADS / "heldout_code.jsonl")],
                         max_prompt_tokens=SHIPPED_MAX_PROMPT_TOKENS,
                         max_requests_per_kind=SHIPPED_REQUESTS_PER_KIND)


@pytest.fixture(scope="session")
def shipped_requests():
    return load_shipped_requests()


@pytest.fixture(scope="module")
def shipped_replays(shipped_requests, runner):
    """The shipped replays on the runner under test (:func:`shipped_replays_on`)."""
    pytest.importorskip("vllm")
    if not (DRAFTER_DIR / "model.safetensors").exists():
        pytest.skip("no shipped drafter (models/dlite-qwen3-tiny-stdlib)")
    return shipped_replays_on(runner, shipped_requests)
