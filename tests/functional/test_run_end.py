"""What a Megatron-FSDP run leaves when it ends: no collective in flight.

megatron-core's ``DistributedOptimizer.step()`` calls the wrapper's ``start_param_sync()``, which
starts the all-gathers of the next forward's buckets; the last step of a run therefore leaves them
in flight, never waited. On GPUs that keeps memory: ProcessGroupNCCL holds an async collective's
tensors (the all-gather's input is a view of the whole sharded weight buffer) until ``wait()``, or,
when nobody waits, until the next collective on that process group, which is the next test's. That
is what kept 62 MiB of the weight buffer after the first Megatron-FSDP test of each process on an
H200 (reported by the harness's after-test CUDA check; found later on CPU ranks and in torch's
source, not yet re-run on a GPU). Closing a run now waits for them: on CPU ranks (gloo) this test
shows they are waited; on GPUs the after-test check shows whether the memory is free.
"""

from __future__ import annotations

import pytest

from pytest_megatron_fsdp.fsdp.release import pending_all_gathers


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_closing_a_run_waits_for_the_all_gathers_its_last_step_started(
    megatron_fsdp_run, run_config, strategy
):
    run_config.ddp.data_parallel_sharding_strategy = strategy
    run_config.ddp.overlap_param_gather = True
    run = megatron_fsdp_run(run_config)
    run.train(2)
    model = run.model
    in_flight = pending_all_gathers(model)
    # Should Megatron-FSDP stop leaving them (a fix upstream), this fails: then revisit the waiting
    # in close() and this module's docstring.
    assert in_flight > 0, f"{strategy}: the last optimizer step left no all-gather in flight"
    run.close()
    assert pending_all_gathers(model) == 0, f"{strategy}: {in_flight} all-gathers were in flight"
    del model
