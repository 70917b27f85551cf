"""Three asynchronous coalesced all-gathers in flight at once on one gloo group, as Megatron-FSDP's
parameter prefetch issues them (``optim_grads_params``), with every result checked.

Run on its own under torchrun (torch alone, torch's own gloo groups)::

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/reproductions/gloo_concurrent_all_gathers.py [ITERATIONS]

With torch 2.13.0 and 2.14.1 a rank dies of heap corruption within a few thousand iterations
(``malloc(): unaligned tcache chunk detected``, SIGSEGV or SIGABRT), or the ranks stop for good: one
of a group's two worker threads spins in gloo's ``UnboundBuffer`` destructor (``sched_yield``, one core
busy) while the main threads wait (seen once with torch 2.14.1, native stacks read with gdb). With
one gloo worker thread per group (what the CPU emulation sets) it prints ``ok`` on every rank.
test_gloo_concurrent_all_gathers.py (torch's groups) and tests/integration/test_cpu_ranks.py (the CPU
ranks' groups) run it.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

#: iterations between two progress lines when run on its own
PROGRESS_EVERY = 1000
#: element counts of the tensors each coalesced all-gather gathers (a bucket group each)
BUCKET_GROUPS = ((4096, 1024, 8192), (2048, 16384), (512, 4096, 1024))


def say(line: str) -> None:
    """One line in one write: the ranks share torchrun's output, unbuffered (``print`` writes the
    text and the newline apart, so two ranks' lines could interleave)."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


def all_gather_concurrently(group: dist.ProcessGroup, iterations: int, progress_every: int = 0) -> None:
    """All-gather every bucket group per iteration, all in flight before the first wait; with
    ``progress_every``, a ``progress rank R: N`` line after every that many iterations (so that a
    watcher tells ranks that stopped from slow ones)."""
    rank, world = group.rank(), group.size()
    shards = [[torch.full((n // world,), float(rank + 1)) for n in sizes] for sizes in BUCKET_GROUPS]
    expected = [
        [torch.arange(world, dtype=torch.float32).add(1).repeat_interleave(n // world) for n in sizes]
        for sizes in BUCKET_GROUPS
    ]
    work = torch.ones(256, 256)
    for iteration in range(1, iterations + 1):
        managers, outputs = [], []
        for sizes, inputs in zip(BUCKET_GROUPS, shards, strict=True):
            gathered = [torch.empty(n) for n in sizes]
            with dist._coalescing_manager(group, async_ops=True) as manager:
                for output, shard in zip(gathered, inputs, strict=True):
                    dist.all_gather_into_tensor(output, shard, group=group)
            managers.append(manager)
            outputs.append(gathered)
        torch.mm(work, work)  # the main thread computes meanwhile, as a forward does during a prefetch
        for manager in managers:
            manager.wait()
        for gathered, wanted in zip(outputs, expected, strict=True):
            for output, value in zip(gathered, wanted, strict=True):
                if not torch.equal(output, value):
                    raise AssertionError(f"rank {rank}: an all-gather returned wrong values")
        if progress_every and iteration % progress_every == 0:
            say(f"progress rank {rank}: {iteration}")


def main() -> None:
    iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    dist.init_process_group("gloo")
    # for a watcher that must stop the ranks: torchrun starts them in sessions of their own
    say(f"pid rank {dist.get_rank()}: {os.getpid()}")
    try:
        all_gather_concurrently(dist.new_group(), iterations, progress_every=PROGRESS_EVERY)
        say(f"ok rank {dist.get_rank()}: {iterations} iterations")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
