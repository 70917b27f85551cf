"""The plugin's entry module is light: loading it, and choosing the platform on a machine without
GPU device nodes, import no torch (each checked in a fresh interpreter)."""

import subprocess
import sys


def test_loading_the_plugin_imports_neither_torch_nor_megatron():
    code = (
        "import sys, pytest_megatron_fsdp.plugin, pytest_megatron_fsdp\n"
        # what test modules import at collection time, which the plain-mode parent also does
        "from pytest_megatron_fsdp import TrainResult, assert_last_loss_finite, assert_loss_decreased\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'numpy')]\n"
        "print(heavy)\n"
        "assert not heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_auto_platform_without_gpu_device_nodes_needs_no_torch_import():
    # The plain-mode parent decides the platform; on a machine with no GPU device node that costs
    # no torch import. (A GPU machine takes the torch path, also checked.)
    code = (
        "import glob, sys\n"
        "from pytest_megatron_fsdp.wire.platform import _GPU_DEVICE_NODES, select_platform\n"
        "nodes = any(glob.glob(p) for p in _GPU_DEVICE_NODES)\n"
        "choice = select_platform('auto', 2)\n"
        "assert ('torch' in sys.modules) == nodes  # torch is asked only where a GPU may be\n"
        "if not nodes:\n"
        "    assert (choice.platform, choice.reason) == ('cpu', 'auto: no CUDA device'), choice\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
