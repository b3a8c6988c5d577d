"""vLLM 0.34+ adapter: ``"dlite"`` registered through vLLM's speculator registry.

vLLM 0.34 added a public, experimental extension point (``vllm/v1/worker/gpu/spec_decode/
speculator_config.py``): ``register_speculative_method(name, SpeculatorConfig subclass)``, whose
``speculator_class`` names the Model Runner V2 speculator that ``init_speculator`` builds (with
``req_states`` when its constructor takes it). With it the plugin needs neither the
``init_speculator`` wrapper nor the ``"dlite"`` -> ``"dflash"`` mapping on V2.

:class:`DLiteSpeculatorConfig` is vLLM's DFlash config (DLite rides on the parallel-drafting
path: same draft ``ModelConfig`` set-up, aux hidden states, ``dflash`` as ``base_method``) with
what differs for a drafter without draft query rows or draft KV:

* ``speculator_class``: :class:`vllm_dlite.vllm.speculator_v2.DLiteSpeculator`;
* ``num_lookahead_tokens`` = k (DFlash asks k + 1 for its fill-in queries; DLite's verification
  needs the k draft slots only, as EAGLE's);
* ``max_num_draft_seqs``: no cap (0.33+ caps DFlash's active requests at
  ``max_num_batched_tokens // (k + 1)`` because its draft pass has k + 1 queries per request;
  DLite's draft pass has none);
* ``matches``: never by checkpoint name (``dlite`` is chosen by method, or by the DLite draft
  architecture through the plugin's config override);
* no draft watermarking (:class:`DLiteSpeculator` drops it).

This module imports vLLM's config modules only (vLLM's rule for speculator configs: they are used
in every process), and only when vLLM resolves the registered name. What it relies on is the
``"v2 registry"`` group of :mod:`vllm_dlite.vllm.compat`, checked against the 0.34 sources by
``tests/test_compat_sources.py``. The plugin registers it only where both that group and
``"v2 runner"`` (the speculator's own internals, with the 0.34 adapters named in
``compat.ADAPTERS``) hold: both hold on 0.34.0.
"""

from __future__ import annotations

from typing import Any, Optional

from vllm.v1.worker.gpu.spec_decode.dflash.config import DFlashSpeculatorConfig

METHOD = "dlite"
CONFIG_QUALNAME = f"{__name__}.DLiteSpeculatorConfig"
SPECULATOR_QUALNAME = "vllm_dlite.vllm.speculator_v2.DLiteSpeculator"


class DLiteSpeculatorConfig(DFlashSpeculatorConfig):
    speculator_class = SPECULATOR_QUALNAME
    supports_watermarking = False

    @classmethod
    def matches(cls, spec: Any) -> bool:
        return False

    @property
    def num_lookahead_tokens(self) -> int:
        return self.num_speculative_tokens

    def max_num_draft_seqs(self, max_num_batched_tokens: int) -> Optional[int]:
        return None


def register() -> None:
    """``register_speculative_method("dlite", ...)`` by qualified name (imported lazily by vLLM)."""
    from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method

    register_speculative_method(METHOD, CONFIG_QUALNAME)


__all__ = ["CONFIG_QUALNAME", "DLiteSpeculatorConfig", "METHOD", "register"]
