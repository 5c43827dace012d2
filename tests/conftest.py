"""Test-session set-up shared by every test file.

Without a GPU the Triton kernels run in the Triton interpreter, which must be
switched on before anything imports triton (k3mono.kernels.common reads it at
import time). A GPU machine keeps compiled kernels unless the caller asks.
"""

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pyproject runs the tests in two xdist workers, one a core: torch's own
# threads on top would only contend with the other worker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


class LaunchRecorder:
    """Stands in for a kernel: records each launch's grid, runs nothing."""

    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.grids.append(grid)


@pytest.fixture
def mono_launches(monkeypatch) -> list:
    """The grids of the mono kernel's launches in this test (none of them run)."""
    recorder = LaunchRecorder()
    monkeypatch.setattr("k3mono.kernels.mono._mono_kernel", recorder)
    return recorder.grids


@pytest.fixture
def run_compiled():
    """run(script, timeout): the script in a child process with the interpreter
    off (offline Hopper builds; the interpreter, on in this one, cannot compile),
    failing unless it exits 0 and prints "ok" last. Skips where Triton has no
    NVIDIA backend."""
    pytest.importorskip("triton.backends.nvidia")

    def run(script: str, timeout: int = 600) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:] + proc.stdout[-2000:]

    return run
