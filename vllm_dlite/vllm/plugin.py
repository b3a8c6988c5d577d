"""vLLM plugin: makes ``"method": "dlite"`` a speculative-decoding method of vLLM 0.32.

Entry point (``setup.py``)::

    entry_points={"vllm.general_plugins": ["dlite = vllm_dlite.vllm.plugin:register"]}

vLLM calls :func:`register` in every process (front end, engine core, workers) before it builds
configs. It is idempotent and does five things:

1. **Version check** (:func:`check_vllm_version`): vLLM internals are hooked, so only the tested
   series (0.32.x) is accepted; anything else raises ONE ``RuntimeError`` that names the fix.
2. **Architecture**: registers ``DFlashDLiteDraftModel`` (lazy ``"module:Class"`` string) with
   ``ModelRegistry``. The name starts with ``DFlash`` because vLLM's ``EAGLEConfig`` renames every
   other architecture of a ``dflash`` draft to ``DFlash<arch>``.
3. **The "dlite" method**: wraps ``EngineArgs.create_speculative_config`` (the one place where
   both ``--speculative-config`` JSON and ``LLM(speculative_config=...)`` become a
   ``SpeculativeConfig``). :func:`prepare_speculative_config` validates the DLite checkpoint
   against the target (earliest point: before any model is loaded) and maps ``method`` to
   vLLM's parallel-drafting path ``"dflash"``; the DLite checkpoint's architecture is what later
   selects the DLite proposer, so ``{"method": "dflash", "model": <dlite dir>}`` works too.
4. **Runner hooks** (installed when the runner module is imported, so the front end does not pay
   for importing worker code):

   * Model Runner V1 (CPU, and GPUs without V2): after ``GPUModelRunner.__init__`` (which
     ``CPUModelRunner`` calls), ``self.drafter`` is replaced by
     :class:`vllm_dlite.vllm.proposer_v1.DLiteProposer` when the draft architecture is DLite.
   * Model Runner V2 (GPU default): ``vllm.v1.worker.gpu.model_runner.init_speculator`` (bound by
     name at import) is wrapped to return
     :class:`vllm_dlite.vllm.speculator_v2.DLiteSpeculator` for a DLite draft.
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

from vllm_dlite.vllm import cpu_fixes

logger = logging.getLogger("vllm.dlite")  # under "vllm": uses vLLM's log handlers

SUPPORTED_VLLM_SERIES = ("0.32",)
DLITE_METHOD = "dlite"
VLLM_METHOD = "dflash"  # vLLM's parallel-drafting path that DLite rides on
_WRAPPED = "__dlite_wrapped__"

_registered = False


# =========================================================================== version
def installed_vllm_version() -> str:
    """vLLM's version. vllm-cpu only reports it via ``vllm.__version__`` (its distribution is
    named ``vllm-cpu``, so ``importlib.metadata.version("vllm")`` fails)."""
    try:
        import vllm

        version = getattr(vllm, "__version__", None)
        if version:
            return str(version)
    except ImportError:
        pass
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist_version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def check_vllm_version(version: Optional[str] = None) -> str:
    """Raise ``RuntimeError`` (one message) unless ``version`` is a supported vLLM series."""
    version = version or installed_vllm_version()
    if not any(version == s or version.startswith(s + ".") for s in SUPPORTED_VLLM_SERIES):
        supported = ", ".join(f"{s}.x" for s in SUPPORTED_VLLM_SERIES)
        raise RuntimeError(
            f"vllm-dlite supports vLLM {supported} but vLLM {version} is installed: install "
            f"vllm=={SUPPORTED_VLLM_SERIES[-1]}.* (CPU: vllm-cpu=={SUPPORTED_VLLM_SERIES[-1]}.0), "
            "or run vLLM without the DLite plugin by setting VLLM_PLUGINS to a list that does "
            "not contain 'dlite'"
        )
    return version


# =========================================================================== register
def register() -> None:
    """The ``vllm.general_plugins`` entry point (idempotent)."""
    global _registered
    if _registered:
        return
    check_vllm_version()
    _register_architecture()
    _patch_engine_args()
    _install_runner_hooks()
    cpu_fixes.install()
    _registered = True


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
    from vllm_dlite.config import DRAFT_ARCHITECTURE

    if speculative_config is None:
        return False
    draft = getattr(speculative_config, "draft_model_config", None)
    if draft is None:
        return False
    archs = list(getattr(draft, "architectures", None) or [])
    hf = getattr(draft, "hf_config", None)
    archs += list(getattr(hf, "architectures", None) or [])
    return DRAFT_ARCHITECTURE in archs or getattr(hf, "dlite_config", None) is not None


def resolve_checkpoint_dir(model: str, revision: Optional[str] = None) -> Path:
    """A local directory for ``model`` (a path, or a Hugging Face repo id already in the local
    cache or downloadable); ``FileNotFoundError`` naming the fix otherwise."""
    path = Path(os.path.expanduser(str(model)))
    if path.exists():
        return path
    looks_like_repo = str(model).count("/") == 1 and not str(model).startswith((".", "/", "~"))
    if looks_like_repo:
        try:
            from huggingface_hub import snapshot_download

            return Path(
                snapshot_download(
                    str(model),
                    revision=revision,
                    allow_patterns=["config.json", "model.safetensors"],
                )
            )
        except Exception as exc:  # noqa: BLE001 - report the cause in the message
            raise FileNotFoundError(
                f"DLite checkpoint '{model}' is neither a local directory nor a downloadable "
                f"Hugging Face repo ({type(exc).__name__}: {exc}); pass the directory written by "
                "DLiteDrafter.save_pretrained as speculative_config['model']"
            ) from None
    raise FileNotFoundError(
        f"DLite checkpoint directory not found: {path}; pass the directory written by "
        "DLiteDrafter.save_pretrained as speculative_config['model']"
    )


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


def validate_dlite_checkpoint(
    model: str,
    target_model_config: Any = None,
    num_speculative_tokens: Optional[int] = None,
    revision: Optional[str] = None,
):
    """Check a DLite checkpoint (and its fit to the target) at config time.

    Returns ``(checkpoint_dir, DLiteConfig)``. Raises ``FileNotFoundError`` /
    ``NotADirectoryError`` / ``ValueError`` with one message naming the fix.
    """
    from vllm_dlite.config import DRAFT_ARCHITECTURE
    from vllm_dlite.model import check_weights_file, read_checkpoint_config

    directory = resolve_checkpoint_dir(model, revision)
    cfg_dict, cfg = read_checkpoint_config(directory)  # files, JSON, dlite_config block
    archs = cfg_dict.get("architectures") or []
    if DRAFT_ARCHITECTURE not in archs:
        raise ValueError(
            f"{directory}/config.json has architectures {archs}, expected "
            f"['{DRAFT_ARCHITECTURE}']: not a DLite checkpoint for vLLM (rewrite it with "
            "DLiteDrafter.save_pretrained)"
        )
    if cfg_dict.get("mask_token_id") is None:
        raise ValueError(
            f"{directory}/config.json lacks 'mask_token_id' (vLLM's parallel drafting needs it); "
            "rewrite the checkpoint with DLiteDrafter.save_pretrained"
        )
    if list(cfg_dict.get("eagle_aux_hidden_state_layer_ids") or []) != list(cfg.target_layer_ids):
        raise ValueError(
            f"{directory}/config.json: eagle_aux_hidden_state_layer_ids "
            f"{cfg_dict.get('eagle_aux_hidden_state_layer_ids')} differs from "
            f"dlite_config.target_layer_ids {cfg.target_layer_ids} (vLLM serves the former, the "
            "drafter reads the latter); set both to the same list"
        )
    if num_speculative_tokens is not None and num_speculative_tokens > cfg.block_size:
        raise ValueError(
            f"num_speculative_tokens={num_speculative_tokens} exceeds the DLite drafter's block "
            f"size K={cfg.block_size} ({directory}); use num_speculative_tokens <= "
            f"{cfg.block_size} (the drafter always drafts its trained block and vLLM keeps the "
            "first num_speculative_tokens)"
        )
    if target_model_config is not None:
        t = _target_sizes(target_model_config)
        where = f"target {t['name']!r}" if t["name"] else "the target"
        if t["hidden_size"] is not None and t["hidden_size"] != cfg.target_hidden_size:
            raise ValueError(
                f"DLite checkpoint {directory} was built for target_hidden_size="
                f"{cfg.target_hidden_size} but {where} has hidden_size={t['hidden_size']}: use a "
                "drafter trained for this target (or serve the target it was trained for)"
            )
        if t["vocab_size"] is not None and t["vocab_size"] != cfg.target_vocab_size:
            raise ValueError(
                f"DLite checkpoint {directory} was built for target_vocab_size="
                f"{cfg.target_vocab_size} but {where} has vocab_size={t['vocab_size']}: use a "
                "drafter trained for this target (same tokenizer/vocabulary)"
            )
        n = t["num_layers"]
        if n is not None:
            bad = [i for i in cfg.target_layer_ids if not 0 <= i <= n]
            if bad:
                raise ValueError(
                    f"DLite checkpoint {directory} reads target layers {bad} but {where} has "
                    f"{n} layers (valid aux ids 0..{n}): use a drafter trained for this target"
                )
            if n != cfg.target_num_layers:
                logger.warning(
                    "DLite checkpoint %s was built for a %d-layer target, %s has %d layers",
                    directory, cfg.target_num_layers, where, n,
                )
    check_weights_file(directory)  # safetensors header: complete, names, shapes, dtypes
    return directory, cfg


def prepare_speculative_config(spec: dict[str, Any], target_model_config: Any = None) -> dict:
    """Map a user speculative config with ``method: "dlite"`` to vLLM's ``dflash`` path.

    Returns ``spec`` unchanged when it is not DLite; otherwise a new dict with ``method`` =
    ``"dflash"``, ``num_speculative_tokens`` defaulting to the drafter's block size K, and the
    checkpoint validated against ``target_model_config``. A ``dflash`` config whose model is a
    DLite checkpoint is validated the same way.
    """
    spec = {str(k).replace("-", "_"): v for k, v in spec.items()}
    method = spec.get("method")
    model = spec.get("model")
    is_dlite = method == DLITE_METHOD
    if not is_dlite and method in (None, VLLM_METHOD) and model is not None:
        is_dlite = _local_checkpoint_is_dlite(model)
    if not is_dlite:
        return spec
    if model is None:
        raise ValueError(
            'speculative_config with "method": "dlite" needs "model": the DLite checkpoint '
            "directory (written by DLiteDrafter.save_pretrained)"
        )
    directory, cfg = validate_dlite_checkpoint(
        model,
        target_model_config,
        spec.get("num_speculative_tokens"),
        spec.get("revision"),
    )
    out = dict(spec)
    out["method"] = VLLM_METHOD
    out["model"] = str(directory) if Path(str(model)).exists() else model
    if out.get("num_speculative_tokens") is None:
        out["num_speculative_tokens"] = cfg.block_size
    if out.get("disable_padded_drafter_batch"):
        # parallel drafting in vLLM only supports the padded drafter batch
        raise ValueError(
            "DLite runs on vLLM's parallel-drafting path, which requires the padded drafter "
            "batch: remove disable_padded_drafter_batch from speculative_config"
        )
    logger.info(
        "DLite: speculative method 'dlite' (checkpoint %s, K=%d, %d target layers %s) runs on "
        "vLLM's parallel-drafting path ('dflash') with the DLite proposer",
        directory, out["num_speculative_tokens"], cfg.num_feature_layers, cfg.target_layer_ids,
    )
    return out


def _local_checkpoint_is_dlite(model: Any) -> bool:
    path = Path(os.path.expanduser(str(model))) / "config.json"
    try:
        return "dlite_config" in json.loads(path.read_text())
    except (OSError, ValueError):
        return False


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

            logger.info("DLite: Model Runner V2 speculator = DLiteSpeculator (no draft KV cache)")
            return DLiteSpeculator(vllm_config, device)
        return original(vllm_config, device, *args, **kwargs)

    setattr(init_speculator, _WRAPPED, True)
    return init_speculator


def _hook_v2_spec_decode(module) -> None:
    module.init_speculator = _wrap_init_speculator(module.init_speculator)


def _hook_v2_runner(module) -> None:
    # model_runner binds init_speculator by name at import time
    if hasattr(module, "init_speculator"):
        module.init_speculator = _wrap_init_speculator(module.init_speculator)


_HOOKS: dict[str, Callable] = {
    "vllm.v1.worker.gpu_model_runner": _hook_v1_runner,
    "vllm.v1.worker.gpu.spec_decode": _hook_v2_spec_decode,
    "vllm.v1.worker.gpu.model_runner": _hook_v2_runner,
}


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Applies a hook right after one of the modules in ``_HOOKS`` finishes importing."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _HOOKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _HookedLoader(spec.loader, _HOOKS[fullname])
                return spec
        return None


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader, hook):
        self._loader, self._hook = loader, hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._hook(module)

    def __getattr__(self, name):  # get_code, get_source, is_package, ...
        return getattr(self._loader, name)


def _install_runner_hooks() -> None:
    for name, hook in _HOOKS.items():
        if name in sys.modules:
            hook(sys.modules[name])
    if not any(isinstance(f, _PostImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportHook())


__all__ = [
    "DLITE_METHOD",
    "SUPPORTED_VLLM_SERIES",
    "check_vllm_version",
    "installed_vllm_version",
    "is_dlite_draft",
    "prepare_speculative_config",
    "register",
    "validate_dlite_checkpoint",
]
