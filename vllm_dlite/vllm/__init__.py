"""All vLLM glue of vllm-dlite (nothing else in the package imports vLLM).

* :mod:`.plugin`         ``register()``: the ``vllm.general_plugins`` entry point
                         (``dlite = vllm_dlite.vllm.plugin:register``).
* :mod:`.draft_model`    ``DFlashDLiteDraftModel``, the vLLM model class wrapping the drafter.
* :mod:`.proposer_v1`    ``DLiteProposer`` for Model Runner V1 (CPU).
* :mod:`.speculator_v2`  ``DLiteSpeculator`` for Model Runner V2 (GPU).

Importing this package does not import vLLM.
"""


def register() -> None:
    """Shortcut for :func:`vllm_dlite.vllm.plugin.register`."""
    from vllm_dlite.vllm.plugin import register as _register

    _register()


__all__ = ["register"]
