"""vLLM plugin: makes ``"method": "dlite"`` a speculative-decoding method of vLLM 0.32-0.34
(:data:`SUPPORTED_VLLM_SERIES`; 0.34 has Model Runner V2 only).

Entry point (``setup.py``)::

    entry_points={"vllm.general_plugins": ["dlite = vllm_dlite.vllm.plugin:register"]}

vLLM calls :func:`register` in every process (front end, engine core, workers) before it builds
configs. It is idempotent and does five things:

1. **Version check** (:mod:`vllm_dlite.vllm.compat`, the one list of vLLM internals the plugin
   touches): on an untested vLLM it logs one warning and hooks nothing, so other vLLM runs in the
   environment are unaffected; ``"method": "dlite"`` then fails with one message naming the fix.
2. **Architecture**: registers ``DFlashDLiteDraftModel`` (lazy ``"module:Class"`` string) with
   ``ModelRegistry``. The name starts with ``DFlash`` because vLLM's ``EAGLEConfig`` renames every
   other architecture of a ``dflash`` draft to ``DFlash<arch>``.
3. **The "dlite" method**: wraps ``EngineArgs.create_speculative_config`` (the one place where
   both ``--speculative-config`` JSON and ``LLM(speculative_config=...)`` become a
   ``SpeculativeConfig``). :func:`prepare_speculative_config` validates the DLite checkpoint
   against the target (earliest point: before any model is loaded) and, on 0.32-0.33, maps
   ``method`` to vLLM's parallel-drafting path ``"dflash"``; the DLite checkpoint's architecture
   is what later selects the DLite proposer, so ``{"method": "dflash", "model": <dlite dir>}``
   works too. On 0.34 ``"dlite"`` stays a method of its own, registered in vLLM's speculator
   registry (:mod:`vllm_dlite.vllm.registry_v034`).
   ``"dlite-adaptive"`` / ``"dlite-hybrid"`` (V1-only, removed: :data:`REMOVED_METHODS`) fail
   here with one message naming ``"dlite"``.
4. **Runner hooks** (installed when the runner module is imported, so the front end does not pay
   for importing worker code):

   * Model Runner V1 (CPU, and GPUs without V2): after ``GPUModelRunner.__init__`` (which
     ``CPUModelRunner`` calls), ``self.drafter`` is replaced by
     :class:`vllm_dlite.vllm.proposer_v1.DLiteProposer` when the draft architecture is DLite.
   * Model Runner V2 (GPU default): ``vllm.v1.worker.gpu.model_runner.init_speculator`` (bound by
     name at import) is wrapped to return
     :class:`vllm_dlite.vllm.speculator_v2.DLiteSpeculator` for a DLite draft (0.32-0.33; on 0.34
     the speculator registry builds it, and nothing is wrapped).
   * the hooks that :mod:`vllm_dlite.vllm.cpu_fixes` hands over.

   Every hook names the compat group it needs and is installed only where that group holds.
5. **vLLM CPU fixes** (:mod:`vllm_dlite.vllm.cpu_fixes`): applied to CPU model runners of engines
   with a speculative config only (``docs/vllm-cpu-fixes.md``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from vllm_dlite.vllm import compat, cpu_fixes

logger = logging.getLogger("vllm.dlite")  # under "vllm": uses vLLM's log handlers

SUPPORTED_VLLM_SERIES = compat.SUPPORTED_VLLM_SERIES
DLITE_METHOD = "dlite"
VLLM_METHOD = "dflash"  # vLLM's parallel-drafting path that DLite rides on
_WRAPPED = "__dlite_wrapped__"
# V1-only methods of earlier releases (no gain measured: 0.99x / 1.01x of no speculation on held-out
# sessions); vLLM's V2 adaptive verification sizes verification per request instead
REMOVED_METHODS = ("dlite-adaptive", "dlite-hybrid")

_registered = False


# =========================================================================== register
def register() -> None:
    """The ``vllm.general_plugins`` entry point (idempotent).

    On a vLLM outside :data:`SUPPORTED_VLLM_SERIES` (or whose core internals moved) it logs ONE
    warning and hooks nothing of vLLM's internals (other vLLM runs in the environment are
    unaffected); only ``"method": "dlite"`` then fails, with :func:`compat.unsupported_message`.
    Otherwise each feature is hooked only where its :mod:`~vllm_dlite.vllm.compat` group holds on
    this vLLM (:func:`compat.holding_groups`): a release without Model Runner V1 loses the V1
    features, not the plugin."""
    global _registered
    if _registered:
        return
    groups = compat.holding_groups()
    if not compat.supported() or compat.CORE.name not in groups:
        logger.warning("%s", compat.unsupported_message())
        _guard_dlite_method()
        _registered = True
        return
    _register_architecture()
    _patch_engine_args()
    _patch_speculative_config()
    _install_runner_hooks(groups)
    if registry_in_use(groups):
        from vllm_dlite.vllm import registry_v034

        registry_v034.register()
    _registered = True


def registry_in_use(groups: Optional[frozenset[str]] = None) -> bool:
    """Whether ``"dlite"`` is a method of vLLM's speculator registry here (0.34+, with the V2
    speculator's internals in place): then it stays ``"dlite"`` instead of becoming ``"dflash"``."""
    groups = compat.holding_groups() if groups is None else groups
    return compat.V2_REGISTRY.name in groups and compat.V2_RUNNER.name in groups


def _guard_dlite_method() -> None:
    """Untested vLLM: ``"method": "dlite"`` raises the version message; nothing else changes."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def create_speculative_config(self, *args, **kwargs):
        spec = self.speculative_config or {}
        methods = (DLITE_METHOD, *REMOVED_METHODS)
        if spec.get("method") in methods or getattr(self, "spec_method", None) in methods:
            raise RuntimeError(compat.unsupported_message())
        return original(self, *args, **kwargs)

    setattr(create_speculative_config, _WRAPPED, True)
    EngineArgs.create_speculative_config = create_speculative_config


def _register_architecture() -> None:
    from vllm import ModelRegistry

    from vllm_dlite.config import DRAFT_ARCHITECTURE

    if DRAFT_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(
            DRAFT_ARCHITECTURE, "vllm_dlite.vllm.draft_model:DFlashDLiteDraftModel"
        )


def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        # Fold the top-level aliases (--spec-method/--spec-model/--spec-tokens) into the dict
        # first, as vLLM does, so that "dlite" given either way is seen here.
        for flag, key, attr in (
            ("--spec-method", "method", "spec_method"),
            ("--spec-model", "model", "spec_model"),
            ("--spec-tokens", "num_speculative_tokens", "spec_tokens"),
        ):
            value = getattr(self, attr, None)
            if value is None:
                continue
            if self.speculative_config is None:
                self.speculative_config = {}
            if key in self.speculative_config:
                raise ValueError(
                    f"{flag} and --speculative-config['{key}'] are mutually exclusive"
                )
            self.speculative_config[key] = value
            setattr(self, attr, None)
        if self.speculative_config is not None:
            self.speculative_config = prepare_speculative_config(
                self.speculative_config, target_model_config
            )
        return original(self, target_model_config, target_parallel_config)

    setattr(create_speculative_config, _WRAPPED, True)
    EngineArgs.create_speculative_config = create_speculative_config

    # --spec-method has argparse choices (the SpeculativeConfig methods): add "dlite"
    add_cli_args = EngineArgs.__dict__["add_cli_args"].__func__
    if not getattr(add_cli_args, _WRAPPED, False):

        @functools.wraps(add_cli_args)
        def add_cli_args_with_dlite(parser, *args, **kwargs):
            parser = add_cli_args(parser, *args, **kwargs)
            for action in getattr(parser, "_actions", []):
                if action.dest == "spec_method" and action.choices is not None:
                    choices = list(action.choices)
                    if DLITE_METHOD not in choices:
                        action.choices = [DLITE_METHOD, *choices]
            return parser

        setattr(add_cli_args_with_dlite, _WRAPPED, True)
        EngineArgs.add_cli_args = staticmethod(add_cli_args_with_dlite)


# =========================================================================== config time
def is_dlite_draft(speculative_config: Any) -> bool:
    """Whether a ``SpeculativeConfig`` drafts with a DLite checkpoint."""
    from vllm_dlite.config import DRAFT_ARCHITECTURE, is_dlite_config

    if speculative_config is None:
        return False
    draft = getattr(speculative_config, "draft_model_config", None)
    if draft is None:
        return False
    archs = list(getattr(draft, "architectures", None) or [])
    hf = getattr(draft, "hf_config", None)
    archs += list(getattr(hf, "architectures", None) or [])
    return DRAFT_ARCHITECTURE in archs or is_dlite_config(hf)


def _target_sizes(target_model_config: Any) -> dict[str, Any]:
    """hidden size / vocab / layer count of the target, from a vLLM ModelConfig or a dict."""
    if isinstance(target_model_config, dict):
        t = target_model_config
        return {
            "hidden_size": t.get("hidden_size"),
            "vocab_size": t.get("vocab_size"),
            "num_layers": t.get("num_hidden_layers"),
            "name": t.get("_name_or_path", ""),
        }
    text = getattr(target_model_config, "hf_text_config", None) or target_model_config.hf_config
    return {
        "hidden_size": getattr(text, "hidden_size", None),
        "vocab_size": target_model_config.get_vocab_size(),
        "num_layers": target_model_config.get_total_num_hidden_layers(),
        "name": str(getattr(target_model_config, "model", "")),
    }


# checkpoint (as given, and its directory) -> (directory, validated config, as given, revision),
# parsed at config time in this process: the draft hf_config override reads it from here instead
# of parsing config.json again
_CHECKED: dict[str, tuple[Path, Any, str, Optional[str]]] = {}


def validate_dlite_checkpoint(
    model: str,
    target_model_config: Any = None,
    num_speculative_tokens: Optional[int] = None,
    revision: Optional[str] = None,
    raw: Optional[dict[str, Any]] = None,
):
    """Check a DLite checkpoint (``dlite_v1``) and its fit to the target at config time: the one
    place its config.json is parsed (``raw``: already read by the caller).

    Returns ``(checkpoint_dir, DLiteConfig)``. Raises ``FileNotFoundError`` /
    ``NotADirectoryError`` / ``ValueError`` with one message naming the fix; logs one warning when
    a key config.json leaves out takes the authors' default against the target's value. Reads
    config.json and the safetensors headers only.
    """
    from vllm_dlite.config import DLiteConfig, target_default_warning
    from vllm_dlite.model import CheckpointError, check_checkpoint, read_checkpoint_config, resolve_checkpoint_dir

    directory = resolve_checkpoint_dir(model, revision).resolve()
    if raw is None:
        parsed = read_checkpoint_config(directory)
    else:
        try:
            parsed = (raw, DLiteConfig.from_checkpoint_config(raw))
        except ValueError as exc:
            raise CheckpointError(f"{directory / 'config.json'}: {exc}") from None
    cfg = check_checkpoint(directory, parsed)  # every tensor's name/shape/dtype against config.json
    K = cfg.num_draft_tokens
    if num_speculative_tokens is not None and not 1 <= num_speculative_tokens <= K:
        raise ValueError(
            f"num_speculative_tokens={num_speculative_tokens} does not fit the DLite drafter "
            f"{directory}, which drafts K={K} tokens per round (block_size {cfg.block_size} counts "
            f"the anchor): use 1 <= num_speculative_tokens <= {K}"
        )
    if target_model_config is not None:
        t = _target_sizes(target_model_config)
        try:
            cfg.check_target(hidden_size=t["hidden_size"], vocab_size=t["vocab_size"],
                             num_layers=t["num_layers"],
                             where=f"target {t['name']!r}" if t["name"] else "the target")
        except ValueError as exc:
            raise ValueError(f"DLite checkpoint {directory}: {exc}") from None
        target = target_model_config if isinstance(target_model_config, dict) else (
            getattr(target_model_config, "hf_text_config", None) or getattr(target_model_config, "hf_config", None))
        message = target_default_warning(parsed[0], target, where=f"the DLite drafter {directory}")
        if message:
            logger.warning("%s", message)
    _CHECKED[str(directory)] = _CHECKED[str(model)] = (directory, cfg, str(model), revision)
    return directory, cfg


def dlite_hf_config_override(hf_config: Any, *args: Any, **kwargs: Any) -> Any:
    """vLLM's ``SpeculativeConfig.hf_config_override`` plus, for a dlite_v1 draft config, what
    vLLM needs to serve it on its parallel-drafting path: ``architectures`` = the DLite draft
    model, ``eagle_aux_hidden_state_layer_ids`` = the aux ids to capture (target layer j -> j+1),
    top-level ``mask_token_id``, and the checkpoint's directory and the config validated at config
    time (``draft_model.CHECKPOINT_ATTR``), which the workers read
    (:func:`vllm_dlite.vllm.draft_model.checked_checkpoint`) instead of parsing config.json again. The user's checkpoint files are not touched.

    Every other argument goes to vLLM's own override unchanged: 0.32 takes ``hf_config`` only,
    0.33 and later also ``transformers_mtp_overrides`` (positional or keyword), and this function
    replaces vLLM's for every draft-model method (EAGLE-3, DFlash, ...), not only DLite."""
    from vllm_dlite.config import DRAFT_ARCHITECTURE, is_dlite_config
    from vllm_dlite.vllm.draft_model import CHECKPOINT_ATTR

    hf_config = _original_hf_config_override()(hf_config, *args, **kwargs)
    if is_dlite_config(hf_config):
        model = str(getattr(hf_config, "name_or_path", "") or "")
        if not model:
            raise ValueError("a DLite draft config without its checkpoint path (name_or_path): pass the "
                             "checkpoint directory or repo id as speculative_config['model']")
        if model not in _CHECKED:  # a SpeculativeConfig built without the engine-args step: validate here
            validate_dlite_checkpoint(model)
        directory, cfg, given, revision = _CHECKED[model]
        setattr(hf_config, CHECKPOINT_ATTR, {"directory": str(directory), "model": given, "revision": revision,
                                             "config": cfg.to_dict()})
        hf_config.architectures = [DRAFT_ARCHITECTURE]
        hf_config.eagle_aux_hidden_state_layer_ids = cfg.aux_layer_ids
        hf_config.mask_token_id = cfg.mask_token_id
    return hf_config


_vllm_hf_config_override: Optional[Callable] = None


def _original_hf_config_override() -> Callable:
    if _vllm_hf_config_override is None:
        _patch_speculative_config()
    return _vllm_hf_config_override  # type: ignore[return-value]


def _patch_speculative_config() -> None:
    """Route vLLM's draft-config normalisation through :func:`dlite_hf_config_override` (a
    module-level function, so the draft ``ModelConfig`` still pickles to spawned processes)."""
    global _vllm_hf_config_override
    from vllm.config.speculative import SpeculativeConfig

    current = SpeculativeConfig.__dict__["hf_config_override"].__func__
    if current is not dlite_hf_config_override:
        _vllm_hf_config_override = current
        dlite_hf_config_override.__wrapped__ = current  # vLLM's own (inspect.unwrap: compat's checks)
        SpeculativeConfig.hf_config_override = staticmethod(dlite_hf_config_override)


def prepare_speculative_config(spec: dict[str, Any], target_model_config: Any = None) -> dict:
    """Map a user speculative config with ``method: "dlite"`` to vLLM's ``dflash`` path.

    Returns ``spec`` unchanged when it is not DLite; otherwise a new dict with ``method`` =
    ``"dflash"``, ``num_speculative_tokens`` defaulting to the drafter's block size K, and the
    checkpoint validated against ``target_model_config``. A ``dflash`` config whose model is a
    DLite checkpoint is validated the same way.
    """
    from vllm_dlite.config import is_dlite_config

    spec = {str(k).replace("-", "_"): v for k, v in spec.items()}
    method = spec.get("method")
    model = spec.get("model")
    raw = None  # config.json of a "dflash" model, read once to see whether it is DLite's
    if method in REMOVED_METHODS:
        raise ValueError(
            f'"method": "{method}" was removed from vllm-dlite (it ran on Model Runner V1 only and '
            'gained nothing measurable): use "method": "dlite"; on Model Runner V2, '
            '"enable_adaptive_verification": true sizes each request\'s verification from the draft '
            "head's confidence"
        )
    is_dlite = method == DLITE_METHOD
    if not is_dlite and method in (None, VLLM_METHOD) and model is not None:
        raw = _local_config(model)
        is_dlite = is_dlite_config(raw)
    if not is_dlite:
        return spec
    if model is None:
        raise ValueError(
            'speculative_config with "method": "dlite" needs "model": the DLite checkpoint '
            "directory (written by vllm_dlite.model.save_pretrained)"
        )
    directory, cfg = validate_dlite_checkpoint(
        model,
        target_model_config,
        spec.get("num_speculative_tokens"),
        spec.get("revision"),
        raw,
    )
    out = dict(spec)
    # 0.34+: the registered "dlite" (registry_v034); before: vLLM's parallel-drafting path
    out["method"] = DLITE_METHOD if registry_in_use() else VLLM_METHOD
    out["model"] = str(directory) if Path(os.path.expanduser(str(model))).exists() else model
    if out.get("num_speculative_tokens") is None:
        out["num_speculative_tokens"] = cfg.num_draft_tokens
    # vLLM drops the last matched prefix-cache block for drafters that read the target's hidden
    # states (EAGLE's draft KV needs it recomputed). DLite keeps no KV and drafts from the last
    # prompt row, which vLLM always recomputes: keep the whole hit, as without speculation.
    out.setdefault("disable_eagle_block_drop", True)
    if out.get("disable_padded_drafter_batch"):
        # parallel drafting in vLLM only supports the padded drafter batch
        raise ValueError(
            "DLite runs on vLLM's parallel-drafting path, which requires the padded drafter "
            "batch: remove disable_padded_drafter_batch from speculative_config"
        )
    logger.info(
        "DLite: speculative method '%s' (dlite_v1 checkpoint %s, k=%d of K=%d, G=%d, target "
        "layers %s) runs on vLLM's parallel-drafting path ('dflash') with the DLite proposer",
        method, directory, out["num_speculative_tokens"], cfg.num_draft_tokens, cfg.anchor_group_size,
        cfg.target_layer_ids,
    )
    return out


def _local_config(model: Any) -> Optional[dict[str, Any]]:
    """config.json of a local checkpoint directory (None: not one, or unreadable)."""
    path = Path(os.path.expanduser(str(model))) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# =========================================================================== runner hooks
def _hook_v1_runner(module) -> None:
    """Model Runner V1: swap ``self.drafter`` for the DLite proposer after ``__init__``."""
    cls = module.GPUModelRunner
    original = cls.__init__
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        if getattr(self, "drafter", None) is not None and is_dlite_draft(
            getattr(self, "speculative_config", None)
        ):
            from vllm_dlite.vllm.proposer_v1 import DLiteProposer

            self.drafter = DLiteProposer(vllm_config, self.device, self)
            self.use_aux_hidden_state_outputs = True
            logger.info("DLite: Model Runner V1 drafter = DLiteProposer (no draft KV cache)")

    setattr(__init__, _WRAPPED, True)
    cls.__init__ = __init__


def _wrap_init_speculator(original: Callable) -> Callable:
    if getattr(original, _WRAPPED, False):
        return original

    @functools.wraps(original)
    def init_speculator(vllm_config, device, *args, **kwargs):
        if is_dlite_draft(vllm_config.speculative_config):
            from vllm_dlite.vllm.speculator_v2 import DLiteSpeculator

            req_states = kwargs.get("req_states", args[0] if args else None)  # the token history (G > 2)
            logger.info("DLite: Model Runner V2 speculator = DLiteSpeculator (no draft KV cache)")
            return DLiteSpeculator(vllm_config, device, req_states)
        return original(vllm_config, device, *args, **kwargs)

    setattr(init_speculator, _WRAPPED, True)
    return init_speculator


def _hook_v2_spec_decode(module) -> None:
    if not registry_in_use(_HOLDING):  # 0.34+: vLLM's registry builds DLiteSpeculator itself
        module.init_speculator = _wrap_init_speculator(module.init_speculator)


def _hook_v2_runner(module) -> None:
    # model_runner binds init_speculator by name at import time
    if hasattr(module, "init_speculator") and not registry_in_use(_HOLDING):
        module.init_speculator = _wrap_init_speculator(module.init_speculator)


# vLLM module -> [(the compat group the hook needs, hook)]: applied right after the module is
# imported (or at once if it already is), where the group holds
_HOOKS: dict[str, list[tuple[str, Callable]]] = {
    "vllm.v1.worker.gpu_model_runner": [(compat.V1_RUNNER.name, _hook_v1_runner)],
    "vllm.v1.worker.gpu.spec_decode": [(compat.V2_RUNNER.name, _hook_v2_spec_decode)],
    "vllm.v1.worker.gpu.model_runner": [(compat.V2_RUNNER.name, _hook_v2_runner)],
}
_HOLDING: frozenset[str] = frozenset()  # the compat groups that hold (set when the hooks are installed)


def _add_hook(module_name: str, group: str, hook: Callable) -> None:
    entries = _HOOKS.setdefault(module_name, [])
    if (group, hook) not in entries:
        entries.append((group, hook))


def _active_hooks(module_name: str) -> list[Callable]:
    return [hook for group, hook in _HOOKS.get(module_name, ()) if group in _HOLDING]


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Applies the hooks right after one of the modules in ``_HOOKS`` finishes importing."""

    def find_spec(self, fullname, path=None, target=None):
        hooks = _active_hooks(fullname)
        if not hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _HookedLoader(spec.loader, hooks)
                return spec
        return None


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader, hooks):
        self._loader, self._hooks = loader, hooks

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for hook in self._hooks:
            hook(module)

    def __getattr__(self, name):  # get_code, get_source, is_package, ...
        return getattr(self._loader, name)


def _install_runner_hooks(groups: Optional[frozenset[str]] = None) -> None:
    """The plugin's hooks and the CPU fixes': each where its compat group holds."""
    global _HOLDING
    _HOLDING = compat.holding_groups() if groups is None else frozenset(groups)
    for name, hook in cpu_fixes.runner_hooks().items():
        _add_hook(name, compat.CPU_FIXES.name, hook)
    for name in list(_HOOKS):
        if name in sys.modules:
            for hook in _active_hooks(name):
                hook(sys.modules[name])
    if not any(isinstance(f, _PostImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportHook())


__all__ = [
    "DLITE_METHOD",
    "SUPPORTED_VLLM_SERIES",
    "is_dlite_draft",
    "prepare_speculative_config",
    "register",
    "validate_dlite_checkpoint",
]
