"""CPU ranks for Megatron-FSDP: the CUDA-on-CPU emulation, megatron-core's Adam as a GPU runner's
keeps state (:mod:`.fused_adam`), and the one Megatron log line the emulation causes.

A CPU rank turns them on before any conftest or test module imports megatron, and off at its end.
The emulation itself (:mod:`.cuda`) patches torch only; what is Megatron's here is the optimizer
module's Adam, the logger names and the message the emulation makes Megatron-FSDP log.
"""

from __future__ import annotations

import logging


class _EmulatedDeviceWarning(logging.Filter):
    """Drops one known log line in CPU ranks, the emulation's own doing: Megatron-FSDP is given
    ``device=cpu`` while the emulated ``torch.cuda.current_device()`` answers 0, so every wrapper
    logs "Megatron-FSDP is using device cpu instead of the current device cuda:0 ...". Any other
    record (another device, another message) passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (
            "Megatron-FSDP is using device cpu instead of the current device cuda:0"
            not in record.getMessage()
        )


EMULATED_DEVICE_WARNING = _EmulatedDeviceWarning()
#: where Megatron-FSDP's wrapper logs it: megatron-core's bundled copy, and the standalone package
MEGATRON_FSDP_LOGGERS = (
    "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
    "megatron_fsdp.megatron_fsdp",
)


class EmulationTooLate(RuntimeError):
    """megatron was imported before the emulation could start (see ``cuda_emulation.enable``)."""


def enable() -> None:
    """The emulation on (imports torch), the emulation's log line filtered out. Raises
    :class:`EmulationTooLate` where megatron was imported first."""
    from . import cuda as cuda_emulation
    from . import fused_adam

    try:
        cuda_emulation.enable()
    except cuda_emulation.EmulationOrderError as exc:
        raise EmulationTooLate(str(exc)) from None
    fused_adam.install()
    for name in MEGATRON_FSDP_LOGGERS:
        logging.getLogger(name).addFilter(EMULATED_DEVICE_WARNING)


def enable_foreign_suite(local_world_size: int, local_rank: int, pg_timeout_s: float) -> None:
    """Over the emulation (:func:`enable` first), what a suite written for GPUs needs besides
    (:mod:`.foreign`): one emulated device per local rank, NCCL groups on gloo."""
    from . import foreign as foreign_emulation

    foreign_emulation.enable(local_world_size, local_rank, pg_timeout_s)


def before_foreign_test() -> None:
    """Before each test of a foreign suite: what the foreign-suite layer checks again then (a no-op
    where it is off)."""
    from . import foreign as foreign_emulation

    foreign_emulation.before_test()


def disable() -> None:
    from . import cuda as cuda_emulation
    from . import foreign as foreign_emulation
    from . import fused_adam

    foreign_emulation.disable()  # the layer over the emulation first
    fused_adam.uninstall()
    cuda_emulation.disable()
    for name in MEGATRON_FSDP_LOGGERS:
        logging.getLogger(name).removeFilter(EMULATED_DEVICE_WARNING)
