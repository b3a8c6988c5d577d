"""The tiny target in vLLM on CPU: greedy tokens identical to HF transformers (fp32, vLLM's default
compiled model), and served through the OpenAI-compatible server with tools (``--enforce-eager``:
compilation would add ~25-45 s to the start-up and changes nothing that test checks). The server
starts in the background when the first test of the module runs, so its start-up overlaps the
in-process engine of the greedy test."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from paths import TARGET_DIR, WORKLOADS
from vllm_utils import vllm_server_process
from vllm_dlite.train.workloads.replay import load_replay

N_TOKENS = 64


SERVER_FLAGS = ("--dtype", "float32", "--max-model-len", "4096", "--enforce-eager",
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module", autouse=True)
def server_start(request):
    """The OpenAI server's start (a future of its ``VLLMServer``), begun in the background when the
    module's first test runs if the server test is selected; stopped after the module."""
    from concurrent.futures import ThreadPoolExecutor

    if "test_openai_server_chat_with_tools" not in {i.name for i in request.session.items
                                                    if i.module is request.module}:
        yield None
        return
    server = vllm_server_process(TARGET_DIR, *SERVER_FLAGS)
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(server.start)
        try:
            yield started
        finally:
            started.exception()  # a start still under way ends before the server is stopped
            server.stop()


@pytest.fixture(scope="module")
def prompts(tok):
    """Several real prompts: held-out chat, code, and agentic turns (short and ~2k tokens)."""
    chat = load_replay(str(WORKLOADS / "heldout_chat.jsonl"), tok)[:2]
    code = load_replay(str(WORKLOADS / "heldout_code.jsonl"), tok)[:2]
    agentic = load_replay(str(WORKLOADS / "heldout_agentic.jsonl"), tok, max_prompt_tokens=2500)
    picks = chat + code + [agentic[0], agentic[3]]
    return [r.prompt_token_ids for r in picks] + [tok.encode("def parse_args(argv):\n", add_special_tokens=False)]


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model(torch.tensor([ids]), use_cache=True)
    past, new = out.past_key_values, []
    for _ in range(n):
        nxt = int(out.logits[0, -1].argmax())
        new.append(nxt)
        out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return new


@pytest.mark.slow
def test_greedy_identical_hf_and_vllm(prompts):
    from vllm import LLM, SamplingParams

    model = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    expected = [hf_greedy(model, p, N_TOKENS) for p in prompts]
    del model

    llm = LLM(model=str(TARGET_DIR), dtype="float32", max_model_len=4096, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    for i, (e, g) in enumerate(zip(expected, got)):
        assert g == e, f"prompt {i}: first difference at token {next(j for j in range(N_TOKENS) if g[j] != e[j])}"


@pytest.mark.slow
def test_openai_server_chat_with_tools(server_start):
    from openai import OpenAI

    from vllm_dlite.train.workloads.generator import AGENT_TOOLS

    base = server_start.result().base_url  # raises the server's start-up error
    client = OpenAI(base_url=base + "/v1", api_key="none")
    resp = client.chat.completions.create(
        model=str(TARGET_DIR), temperature=0, max_tokens=64, tools=AGENT_TOOLS,
        messages=[{"role": "system", "content": "You are a coding agent."},
                  {"role": "user", "content": "List the files in `json` and read `json/decoder.py`."}])
    choice = resp.choices[0]
    assert resp.usage.completion_tokens > 0
    assert choice.message.content or choice.message.tool_calls
    for call in choice.message.tool_calls or []:
        assert call.function.name in {t["function"]["name"] for t in AGENT_TOOLS}
        json.loads(call.function.arguments)
