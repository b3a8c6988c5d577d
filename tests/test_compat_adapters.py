"""compat's named adapters for the V2 speculator, on small fakes of each release's API (no vLLM,
no engine): a fake ``CudaGraphManager`` with 0.32's and with 0.34's constructor, a draft-logits
tensor (0.32) and a fake ``DraftLogitsCache`` (0.34, replicated and batch-sharded).

The same adapters against the real signatures of each release's sources, and DLiteSpeculator
against each release's base class: ``test_compat_sources.py``; DLiteSpeculator's propose writing
through them on a fake batch: ``test_vllm_integration.py::test_v2_speculator_on_cpu_with_fake_batch``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import pytest
import torch

from vllm_dlite.vllm import compat


# =========================================================================== CudaGraphManager
class Manager032:
    """0.32/0.33: one decode query length."""

    def __init__(self, vllm_config, device, cudagraph_mode, decode_query_len: int, lora_capture_cases=None,
                 varlen_decode=False, ubatch_runner=None):
        assert isinstance(decode_query_len, int)
        self.decode_query_len = decode_query_len


class Manager034:
    """0.34: query length -> most requests (what 0.34's own constructor derives from it)."""

    def __init__(self, vllm_config, device, cudagraph_mode, decode_query_lens: Mapping[int, int],
                 lora_capture_cases=None, varlen_decode=False, ubatch_runner=None, decode_request_sizes=None):
        self.decode_max_reqs = {q: min(n, 16) for q, n in sorted(decode_query_lens.items())}
        self.decode_query_len = max(self.decode_max_reqs)


class Graphs034(Manager034):  # a subclass that keeps the base constructor, as vLLM's speculators' managers
    pass


class ManagerElse:
    def __init__(self, vllm_config, device, cudagraph_mode, decode_shapes):
        pass


def test_graph_manager_keyword_per_release():
    assert compat.graph_manager_decode_query(Manager032, query_len=1, max_num_reqs=8) == {"decode_query_len": 1}
    assert compat.graph_manager_decode_query(Manager034, query_len=1, max_num_reqs=8) == {
        "decode_query_lens": {1: 8}}
    m = Manager032("cfg", "cpu", "mode", **compat.graph_manager_decode_query(Manager032, 1, 8))
    assert m.decode_query_len == 1
    for cls in (Manager034, Graphs034):
        m = cls("cfg", "cpu", "mode", **compat.graph_manager_decode_query(cls, 3, 8))
        assert m.decode_max_reqs == {3: 8} and m.decode_query_len == 3


def test_graph_manager_keyword_is_read_once_per_class(monkeypatch):
    class Fresh(Manager034):
        pass

    calls = []
    signature = compat.inspect.signature
    monkeypatch.setattr(compat.inspect, "signature", lambda f: calls.append(f) or signature(f))
    for _ in range(3):
        compat.graph_manager_decode_query(Fresh, 1, 4)
    assert len(calls) == 1


def test_graph_manager_without_either_keyword_names_the_group():
    with pytest.raises(TypeError, match="takes neither decode_query_len .* nor decode_query_lens") as err:
        compat.graph_manager_decode_query(ManagerElse, 1, 8)
    assert "'v2 runner'" in str(err.value) and "VLLM_USE_V2_MODEL_RUNNER=0" in str(err.value)


# =========================================================================== draft logits
class FakeDraftLogitsCache:
    """0.34's DraftLogitsCache as the speculator sees it: ``values [rows, K, V]`` and ``row_mapping``
    (None: replicated, row = request state; else this rank's row per request state, -1 = another
    rank's)."""

    def __init__(self, values: torch.Tensor, row_mapping: Optional[torch.Tensor] = None):
        self.values, self.row_mapping = values, row_mapping


MAX_REQS, K, V = 6, 4, 11


def _logits(b: int, k: int) -> torch.Tensor:
    return torch.arange(b * k * V, dtype=torch.float32).reshape(b, k, V) + 1


@pytest.mark.parametrize("release", ["0.32", "0.34"])
def test_draft_logits_rows_are_request_states(release):
    values = torch.zeros(MAX_REQS, K, V, dtype=torch.bfloat16)
    target = values if release == "0.32" else FakeDraftLogitsCache(values)
    states = torch.tensor([5, 0, 2], dtype=torch.int32)
    logits = _logits(3, 2)  # k = 2 < K: later positions untouched
    compat.write_draft_logits(target, states, logits)
    for b, s in enumerate(states.tolist()):
        assert torch.equal(values[s, :2], logits[b].to(torch.bfloat16))
    assert values[:, 2:].abs().sum() == 0 and values[[1, 3, 4]].abs().sum() == 0
    assert values.dtype == torch.bfloat16


def test_sharded_cache_writes_this_ranks_rows_only():
    values = torch.zeros(2, K, V)  # 2 rows on this rank
    row_mapping = torch.tensor([-1, 1, -1, -1, 0, -1], dtype=torch.int32)  # states 4 -> row 0, 1 -> row 1
    cache = FakeDraftLogitsCache(values, row_mapping)
    logits = _logits(3, K)
    compat.write_draft_logits(cache, torch.tensor([1, 3, 4]), logits)  # state 3: another rank's
    assert torch.equal(values[1], logits[0]) and torch.equal(values[0], logits[2])


def test_unknown_draft_logits_names_the_group():
    with pytest.raises(TypeError, match="neither a tensor .* nor a DraftLogitsCache") as err:
        compat.write_draft_logits([[0.0]], torch.tensor([0]), _logits(1, 1))
    assert "'v2 runner'" in str(err.value) and "compat.KNOWN_GROUPS" in str(err.value)


# =========================================================================== the record
def test_every_adapter_function_exists_and_no_todo_is_left():
    named = [a for a in compat.ADAPTERS if a.function]
    assert {a.function for a in named} >= {"graph_manager_decode_query", "write_draft_logits"}
    for a in named:
        assert callable(getattr(compat, a.function)) and a.function in compat.__all__, a
    assert not [a.name for a in compat.ADAPTERS if "TODO" in a.name or "TODO" in a.what]


def test_optional_need_is_skipped_only_where_its_module_is_absent():
    """The run-time check: an optional need whose vLLM module is absent is no problem (0.32's
    draft-logits tensor); the same need on a module that is present is checked."""
    pytest.importorskip("vllm")
    absent = compat.Need("v1.worker.gpu.no_such_module", "Thing", attrs=("x",), optional="older path")
    assert compat.check_need(absent) == []
    assert compat.check_need(compat.Need("v1.worker.gpu.no_such_module", "Thing", attrs=("x",)))
    present = compat.Need("engine.arg_utils", "EngineArgs", attrs=("no_such_attribute",), optional="older path")
    assert compat.check_need(present) == ["vllm.engine.arg_utils.EngineArgs: no attribute no_such_attribute"]
