"""The plugin replaces ``SpeculativeConfig.hf_config_override`` for EVERY draft-model method: it must
accept whatever vLLM passes.

vLLM 0.33 calls it as ``hf_config_override(hf_config, transformers_mtp_overrides=...)`` (through
``compose_draft_hf_overrides``: keyword when the target has no callable ``hf_overrides``,
positional when it has). The plugin's first replacement took ``hf_config`` only, so with the plugin
installed on 0.33 creating any EAGLE-3 or DFlash config raised ``TypeError``. These tests run 0.33's
own ``hf_config_override``, ``_apply_composed_hf_override`` and ``compose_draft_hf_overrides``
(extracted from the fetched 0.33 wheel's source, no 0.33 import; a stand-in with 0.33's signature
when the sources are absent) around the plugin's replacement: the old one-argument override fails
both call shapes, the current one passes, forwards ``transformers_mtp_overrides``, and still
rewrites a DLite draft config. On the installed 0.32 the one-argument call keeps working.
"""

from __future__ import annotations

import ast
import functools
import json
import textwrap
import types
from typing import Any, Callable

import pytest

from paths import DRAFTER_DIR, REPO
from vllm_dlite.vllm import plugin
from vllm_sources import cache_dir

MODELS = REPO / "models"
CALLERS = ("hf_config_override", "_apply_composed_hf_override", "compose_draft_hf_overrides")


def _stand_in_033() -> type:
    """0.33's three functions, reduced to what matters here (used when the sources are absent)."""

    class SpeculativeConfig:
        @staticmethod
        def hf_config_override(hf_config, transformers_mtp_overrides=None):
            if transformers_mtp_overrides is not None:
                hf_config.update(transformers_mtp_overrides)
            return hf_config

        @staticmethod
        def _apply_composed_hf_override(target_hf_overrides, hf_config, transformers_mtp_overrides=None):
            hf_config = SpeculativeConfig.hf_config_override(hf_config, transformers_mtp_overrides)
            return target_hf_overrides(hf_config)

        @staticmethod
        def compose_draft_hf_overrides(target_hf_overrides, transformers_mtp_overrides=None):
            if not callable(target_hf_overrides):
                return functools.partial(SpeculativeConfig.hf_config_override,
                                         transformers_mtp_overrides=transformers_mtp_overrides)
            return functools.partial(SpeculativeConfig._apply_composed_hf_override, target_hf_overrides,
                                     transformers_mtp_overrides=transformers_mtp_overrides)

    return SpeculativeConfig


def _vllm_033_speculative_config() -> tuple[type, str]:
    """A class holding 0.33's own three functions (its source, exec'd), and where they came from."""
    source = cache_dir() / "0.33.0" / "vllm" / "config" / "speculative.py"
    if not source.is_file():
        return _stand_in_033(), "a stand-in with 0.33's signature (run scripts/fetch_vllm_sources.sh for the real one)"
    text = source.read_text()
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "SpeculativeConfig")
    defs = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in CALLERS}
    assert set(defs) == set(CALLERS), sorted(defs)
    assert all(any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in defs[n].decorator_list)
               for n in CALLERS)
    body = "\n".join(textwrap.indent("@staticmethod\n" + textwrap.dedent(
        ast.get_source_segment(text, defs[n], padded=True)), "    ") for n in CALLERS)
    code = f"from __future__ import annotations\nclass SpeculativeConfig:\n{body}\n"
    namespace: dict[str, Any] = {"functools": functools, "Any": Any, "Callable": Callable}
    exec(compile(code, str(source), "exec"), namespace)  # noqa: S102 - vLLM's own code, for this test
    return namespace["SpeculativeConfig"], str(source)


def _config(directory) -> Any:
    from transformers import PretrainedConfig

    config = PretrainedConfig.from_dict(json.loads((directory / "config.json").read_text()))
    config.name_or_path = str(directory)  # as vLLM's loader sets it
    return config


def _old_one_argument_override(hf_config):
    """The plugin's replacement before the fix (its signature and its call of vLLM's original)."""
    return plugin._original_hf_config_override()(hf_config)


@pytest.fixture
def vllm_033(monkeypatch):
    """0.33's SpeculativeConfig functions with ``replace(override)`` installing a plugin override
    the way the plugin does (vLLM's original saved, the replacement set as a staticmethod)."""
    cls, origin = _vllm_033_speculative_config()
    monkeypatch.setattr(plugin, "_vllm_hf_config_override", cls.__dict__["hf_config_override"].__func__)

    def replace(override):
        cls.hf_config_override = staticmethod(override)
        return cls
    replace.origin = origin
    return replace


def _create(cls, directory, callable_target_overrides: bool, mtp=None):
    """What 0.33's SpeculativeConfig does when it builds the draft ModelConfig's hf_overrides."""
    target_overrides = (lambda c: c) if callable_target_overrides else None
    return cls.compose_draft_hf_overrides(target_overrides, mtp)(_config(directory))


DRAFTS = {"eagle3": MODELS / "eagle3-qwen3-tiny-stdlib", "dflash": MODELS / "dflash-qwen3-tiny-stdlib"}


@pytest.mark.parametrize("callable_target_overrides", [False, True], ids=["keyword-call", "positional-call"])
@pytest.mark.parametrize("method", sorted(DRAFTS))
def test_old_override_breaks_0_33_and_the_new_one_does_not(vllm_033, method, callable_target_overrides):
    directory = DRAFTS[method]
    if not (directory / "config.json").is_file():
        pytest.skip(f"{directory} is not shipped here")
    with pytest.raises(TypeError, match="transformers_mtp_overrides|takes 1 positional argument"):
        _create(vllm_033(_old_one_argument_override), directory, callable_target_overrides)
    want = _create(vllm_033(plugin._vllm_hf_config_override), directory, callable_target_overrides)  # vLLM alone
    hf = _create(vllm_033(plugin.dlite_hf_config_override), directory, callable_target_overrides)
    assert hf.to_dict() == want.to_dict()  # not a DLite draft: exactly vLLM's own result


def test_mtp_overrides_reach_vllm(vllm_033):
    cls = vllm_033(plugin.dlite_hf_config_override)
    hf = _create(cls, DRAFTS["eagle3"], False, mtp={"n_predict": 3, "dlite_probe": 1})
    assert hf.n_predict == 3 and hf.dlite_probe == 1, vllm_033.origin


def test_dlite_draft_config_is_still_rewritten_on_0_33(vllm_033):
    from vllm_dlite.config import DRAFT_ARCHITECTURE, DLiteConfig

    cls = vllm_033(plugin.dlite_hf_config_override)
    hf = _create(cls, DRAFTER_DIR, True)
    cfg = DLiteConfig.from_checkpoint_config(json.loads((DRAFTER_DIR / "config.json").read_text()))
    assert hf.architectures == [DRAFT_ARCHITECTURE]
    assert hf.eagle_aux_hidden_state_layer_ids == cfg.aux_layer_ids and hf.mask_token_id == cfg.mask_token_id
    from vllm_dlite.vllm.draft_model import checked_checkpoint

    assert checked_checkpoint(types.SimpleNamespace(hf_config=hf)) == (DRAFTER_DIR.resolve(), cfg)  # for the workers
    # a worker without that directory (another node, another cache) resolves the checkpoint as given
    hf.dlite_checkpoint = {**hf.dlite_checkpoint, "directory": "/nonexistent/snapshot"}
    assert checked_checkpoint(types.SimpleNamespace(hf_config=hf)) == (DRAFTER_DIR, cfg)


def test_installed_vllm_one_argument_call_still_works(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.config.speculative import SpeculativeConfig

    from vllm_dlite.config import DRAFT_ARCHITECTURE

    monkeypatch.setattr(SpeculativeConfig, "hf_config_override", SpeculativeConfig.__dict__["hf_config_override"])
    monkeypatch.setattr(plugin, "_vllm_hf_config_override", plugin._vllm_hf_config_override)
    plugin._patch_speculative_config()
    assert SpeculativeConfig.hf_config_override(_config(DRAFTER_DIR)).architectures == [DRAFT_ARCHITECTURE]
    for directory in DRAFTS.values():  # other drafts: exactly what vLLM's own override gives
        want = plugin._vllm_hf_config_override(_config(directory)).to_dict()
        assert SpeculativeConfig.hf_config_override(_config(directory)).to_dict() == want
