"""The CUDA-on-CPU emulation seen from processes of their own: a plain pytest session with the plugin
loaded patches nothing, and megatron's own gradient clip, unemulated, refuses CPU gradients (what
the emulation answers for). Each starts a fresh interpreter that imports torch or megatron."""

import subprocess
import sys


def test_nothing_is_patched_in_a_process_that_did_not_ask(tmp_path):
    # A plain pytest session with the plugin loaded (not a torchrun rank, no CPU mode requested).
    code = (
        "import torch, pytest, sys\n"
        "orig = torch.cuda.current_device, torch.cuda._lazy_call, torch.cuda.Stream\n"
        "rc = pytest.main(['-q', '-p', 'no:cacheprovider', sys.argv[1]])\n"
        "from pytest_megatron_fsdp.emulation import cuda as cuda_emulation\n"
        "assert not cuda_emulation.is_enabled()\n"
        "assert (torch.cuda.current_device, torch.cuda._lazy_call, torch.cuda.Stream) == orig\n"
        "from torch.overrides import _get_current_function_mode_stack\n"
        "assert not _get_current_function_mode_stack()\n"
        "print('UNPATCHED', rc)\n"
    )
    test_file = tmp_path / "test_x.py"
    test_file.write_text(
        "import torch\ndef test_x():\n    assert torch.cuda.current_device.__module__ == 'torch.cuda'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(test_file)],
        capture_output=True,
        text=True,
        timeout=120,  # inherits a plain environment (tests/conftest.py)
    )
    assert "UNPATCHED 0" in out.stdout, out.stdout + out.stderr


def test_megatrons_clip_fails_on_cpu_without_the_emulation():
    """What the emulation answers for: megatron's own clip, unemulated, refuses CPU gradients."""
    code = (
        "import torch\n"
        "from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32\n"
        "p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.ones(2)\n"
        "try:\n"
        "    clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=2.0)\n"
        "except AssertionError:\n"
        "    print('REFUSED')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
