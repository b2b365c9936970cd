"""Helpers for pagedkv's tests and benchmarks: tiny random models and checkpoints, a server in a
thread or a process, replicas behind the router, a stand-in for the Hugging Face Hub, latency
probes, a scripted writer for tool calls, tiny GGUF files, the Triton tests' device.

A package of its own beside ``pagedkv/``: the package never imports it (``tests/test_layering.py``
checks), and the project's install makes it importable, so ``tests/`` and ``bench/`` import it by
name with no ``sys.path`` edits. Test-only dependencies (transformers, peft, ...) are imported by
the modules that use them.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST_DATA = REPO_ROOT / "tests" / "data"  # fixtures: vLLM's flag and metric lists, a long text
