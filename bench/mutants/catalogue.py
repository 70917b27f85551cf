"""The mutants: single semantic edits of Megatron-FSDP, each the kind of regression a review could miss.

Every mutant is one exact (file, old text, new text) edit. Stack-aware: a mutant whose code does not
exist in the installed stack (a file it names is absent, or its ``needs`` text is not found: V2 on
megatron-core 0.19.2, an upstream fix a release predates) is **not applicable** there, with the reason;
where the code exists, ``old`` (or the first of its per-stack ``variants`` that fits: the text moved
between releases) must occur exactly once in each file it names, else the runner refuses the whole
catalogue, so a catalogue that no longer fits a new release says so before anything runs. Paths are
relative to the directory that holds the installed ``megatron`` and ``megatron_fsdp`` packages:

- ``MCORE + "..."``: megatron-core (the adapter, the distributed optimizer, clipping, fsdp_dtensor);
- ``TRAINING`` / ``BRIDGE``: Megatron-LM's and Megatron-Bridge's checkpoint code, the paths users save and
  load Megatron-FSDP runs through; these mutants are judged by ``tests/upstream_code``
  (``Mutant.suite``);
- ``VENDORED`` / ``STANDALONE``: the two copies of Megatron-FSDP's source. megatron-core's
  ``FullyShardedDataParallel`` runs the vendored copy, ``megatron_fsdp.fully_shard`` the standalone one;
  they are the same source tree (identical files in megatron-core 0.19.2 / megatron-fsdp 0.6.1), so a
  regression in Megatron-FSDP's source lands in both: ``both(name)`` edits both copies. Where the
  standalone package is the vendored directory itself (an editable install of a Megatron-LM checkout),
  the runner's copy keeps it so, and a file both names is edited once.

Written for megatron-core 0.19.2 / megatron-fsdp 0.6.1 and Megatron-LM main of 2026-08-22
(d98e8a64dd, with Megatron-FSDP V2: ``megatron_fsdp/experimental``, ``FullyShardedDataParallelV2``).
Each docstring says what changes, which entry point and strategies run the edited code, and the
symptom expected. ``replays`` names the upstream fix
a mutant reverts (the known-bug registry, ``pytest_megatron_fsdp/fsdp/versions.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

MCORE = "megatron/core/"
VENDORED = "megatron/core/distributed/fsdp/src/megatron_fsdp/"
STANDALONE = "megatron_fsdp/"
#: Megatron-LM's training code (in megatron-core's wheels from 0.19 on, and in a checkout)
TRAINING = "megatron/training/"
#: Megatron-Bridge (installed on the newest stack)
BRIDGE = "megatron/bridge/"
#: the line of Bridge's fsdp_dtensor load that reads the checkpoint into the state dict
_BRIDGE_READ = (
    "    planner = torch.distributed.checkpoint.default_planner.DefaultLoadPlanner("
    "allow_partial_load=allow_partial_load)\n"
)

#: the suites a mutant is judged by: the functional suite (plain pytest), or upstream's own training and
#: checkpoint code (``tests/upstream_code``: under torchrun in the foreign-suite mode, as
#: ``make upstream-code`` runs it)
FUNCTIONAL_SUITE = "tests/functional"
UPSTREAM_CODE_SUITE = "tests/upstream_code"


def both(name: str) -> tuple[str, ...]:
    """The file ``name`` in both copies of Megatron-FSDP (vendored in megatron-core, and standalone)."""
    return (VENDORED + name, STANDALONE + name)


@dataclass(frozen=True)
class Needs:
    """The code a mutant edits exists only where ``file`` contains ``text``; elsewhere the mutant is not
    applicable, for the reason ``why``."""

    file: str
    text: str
    why: str


#: Megatron-FSDP V2 (Megatron-LM PR #5865, after megatron-core 0.19): its wrapper in the adapter
V2 = Needs(
    MCORE + "distributed/fsdp/mcore_fsdp_adapter.py",
    "class FullyShardedDataParallelV2(",
    "megatron-core has no Megatron-FSDP V2 (FullyShardedDataParallelV2, Megatron-LM PR #5865)",
)


#: Megatron-FSDP V2's standalone API (``experimental``: ``fully_shard_context``, ``Placements``, its own
#: checkpoint; Megatron-LM main): megatron-core 0.19.2 ships an earlier ``experimental`` without it
V2_FULLY_SHARD = Needs(
    VENDORED + "experimental/fully_shard.py",
    "def fully_shard_context(",
    "megatron-core has no standalone Megatron-FSDP V2 API (experimental.fully_shard_context)",
)


@dataclass(frozen=True)
class Mutant:
    name: str
    category: str
    files: tuple[str, ...]
    old: str
    new: str
    doc: str
    #: the upstream fix this mutant reverts, when it replays a real regression
    replays: str | None = None
    #: why no CPU-rank test can kill it, and the GPU test that would (None: the suite must kill it)
    cpu_undetectable: str | None = None
    #: the suite that judges it (a directory of tests, ``FUNCTIONAL_SUITE`` or ``UPSTREAM_CODE_SUITE``)
    suite: str = FUNCTIONAL_SUITE
    #: the test (path under the suite's directory, pytest node id) expected to fail first: the runner runs it
    #: alone before the suite. It only orders the work: when the probe passes, the whole suite runs and
    #: judges the mutant, so a stale probe costs time, never a wrong verdict.
    probe: str | None = None
    #: where the code exists (None: wherever every file it names exists)
    needs: Needs | None = None
    #: (old, new) per stack where the text moved: tried in order after (old, new)
    variants: tuple[tuple[str, str], ...] = ()


CATEGORIES = (
    "gradient scaling/averaging",
    "gradient accumulation",
    "reduce groups and buckets",
    "parameter all-gather and prefetch",
    "shard offsets and sizes",
    "optimizer step and copy-back",
    "no_shard parameter sync",
    "gradient norm and clipping",
    "mixed precision",
    "checkpoint contents",
    "HSDP outer reduction",
    "partial collective",
    "adapter and wrappers",
    "upstream checkpointing",
)

MUTANTS: tuple[Mutant, ...] = (
    # --- gradient scaling / averaging ------------------------------------------------------------
    Mutant(
        "grad_sum_not_mean",
        "gradient scaling/averaging",
        both("megatron_fsdp.py"),
        "                gradient_scaling_factor = 1.0 / data_parallel_world_size\n                expert",
        "                gradient_scaling_factor = 1.0\n                expert",
        """The data-parallel gradient is summed, not averaged (scaling factor 1 instead of 1/dp).
        Both entry points, every strategy. Symptom: gradients and the grad norm twice DDP's; with SGD
        the losses leave DDP's at iteration 2; Adam is nearly scale-invariant and hides most of it.""",
        probe="test_strategies.py::test_strategy_matches_ddp_baseline[optim_grads_params-True]",
    ),
    Mutant(
        "premul_factor_dropped",
        "gradient scaling/averaging",
        both("param_and_grad_buffer.py"),
        "reduce_op = torch.distributed._make_nccl_premul_sum(scaling_factor)",
        "reduce_op = torch.distributed._make_nccl_premul_sum(1.0)",
        """The fused pre-multiplied sum (gradient_reduce_div_fusion, the default for fp32 gradients)
        loses its 1/dp factor. Both entry points, every strategy, fp32 gradient communication.
        Symptom: gradients summed over ranks (x dp); grad norm x dp.""",
        probe="test_strategies.py::test_strategy_matches_ddp_baseline[optim_grads_params-True]",
    ),
    Mutant(
        "unfused_scale_squared",
        "gradient scaling/averaging",
        both("param_and_grad_buffer.py"),
        "grad_data.mul_(scaling_factor)\n        reduce_op = torch.distributed.ReduceOp.SUM",
        "grad_data.mul_(scaling_factor * scaling_factor)\n        reduce_op = torch.distributed.ReduceOp.SUM",
        """The unfused path (bf16 gradient communication, where premul-sum is not used) scales by
        1/dp twice. fully_shard with a bf16 grad_comm_dtype; megatron-core bf16 runs communicate in
        fp32 by default. Symptom: gradients halved on 2 ranks; losses drift from the fp32 run.""",
        probe="test_fully_shard.py::test_fully_shard_bf16_mixed_precision_trains",
    ),
    Mutant(
        "unfused_scale_dropped",
        "gradient scaling/averaging",
        both("param_and_grad_buffer.py"),
        "grad_data.mul_(scaling_factor)\n        reduce_op = torch.distributed.ReduceOp.SUM",
        "grad_data.mul_(1.0)\n        reduce_op = torch.distributed.ReduceOp.SUM",
        """The unfused path (gradient_reduce_div_fusion=False, or bf16 gradient communication) sums
        without the 1/dp scale. megatron-core's FullyShardedDataParallel with the fusion off or with
        grad_reduce_in_fp32=False in bf16; fully_shard with a bf16 grad_comm_dtype. The default
        (fused, fp32 gradients) never runs it. Symptom: grad norm x dp; Adam hides most of it from
        the losses.""",
        probe="test_strategies.py::test_unfused_gradient_division_matches_ddp[optim_grads_params]",
    ),
    # --- gradient accumulation ---------------------------------------------------------------------
    Mutant(
        "unsharded_accum_overwrites",
        "gradient accumulation",
        both("megatron_fsdp.py"),
        "param.main_grad.add_(to_local_if_dtensor(param.grad))",
        "param.main_grad.copy_(to_local_if_dtensor(param.grad))",
        """Unsharded gradient buffers (no_shard, optim) overwrite instead of accumulating across
        micro-batches. Both entry points. Symptom: with several micro-batches per step only the last
        one's gradient counts; with one micro-batch nothing changes.""",
        probe="test_strategies.py::test_gradient_accumulation_four_microbatches[optim]",
    ),
    Mutant(
        "sharded_accum_overwrites",
        "gradient accumulation",
        both("param_and_grad_buffer.py"),
        "                    local_grad += reduced_grad\n",
        "                    local_grad.copy_(reduced_grad)\n",
        """Sharded gradient buffers (optim_grads, optim_grads_params) overwrite the reduced shard
        instead of accumulating it over micro-batches. Both entry points. Symptom: with several
        micro-batches per step only the last one's gradient counts.""",
        probe="test_strategies.py::test_gradient_accumulation_four_microbatches[optim_grads_params]",
    ),
    Mutant(
        "unsharded_reduced_every_microbatch",
        "gradient accumulation",
        both("megatron_fsdp.py"),
        "            if grad_reduce_every_bprop or is_last_microbatch or self.model_auto_sync:\n"
        "                # Launch asynchronous",
        "            if True:\n                # Launch asynchronous",
        """The post-backward hook reduces unsharded gradients (no_shard, optim) after every
        micro-batch, not only the last: the accumulated buffer is reduced (and scaled) again each
        time. Both entry points with several micro-batches per step. Symptom: early micro-batches'
        gradients scaled by 1/dp more than once (mixed with other ranks' values) before the step.
        On Megatron-LM main the condition was rewritten (PR #6357: overlap_grad_reduce and the last
        micro-batch): the per-stack variant makes the same edit there.""",
        variants=(
            (
                "            if grad_reduce_every_bprop or (\n"
                '                # "no_shard" and "optim" can have overlapped or non-overlapped\n'
                "                # gradient reduction. Non-overlapped gradient reduction happens\n"
                "                # in start_grad_sync() or synchronize_gradient_reduce().\n"
                "                # Must only happen once on the final microbatch prior to optimization,\n"
                "                # or else unsharded gradient buffers will be redundantly reduced.\n"
                "                self.ddp_config.overlap_grad_reduce\n"
                "                and (is_last_microbatch or self.model_auto_sync)\n"
                "            ):\n"
                "                # Launch asynchronous",
                "            if True:\n                # Launch asynchronous",
            ),
        ),
        probe="test_strategies.py::test_gradient_accumulation_four_microbatches[optim]",
    ),
    Mutant(
        "grad_buffer_not_zeroed",
        "gradient accumulation",
        both("megatron_fsdp.py"),
        "        self.param_and_grad_buffer.zero_grad()\n",
        "        pass\n",
        """zero_grad_buffer() no longer zeroes Megatron-FSDP's gradient buffers: gradients accumulate
        across optimizer steps. Both entry points, every strategy. Symptom: from step 2 on each
        update also applies every earlier step's gradient.""",
        probe="test_strategies.py::test_strategy_matches_ddp_baseline[optim_grads_params-True]",
    ),
    # --- reduce groups and buckets ------------------------------------------------------------------
    Mutant(
        "bucket_reduced_one_param_early",
        "reduce groups and buckets",
        both("param_and_grad_buffer.py"),
        "if len(self.bucket_grad_ready_params[bucket_id]) != len(param_group.params):",
        "if len(self.bucket_grad_ready_params[bucket_id]) + 1 < len(param_group.params):",
        """Off-by-one in the bucket-ready check: a bucket group is reduced when all but one of its
        parameters have their gradient. Both entry points, strategies that reduce in the
        post-backward hook. Symptom: one parameter per bucket reduced before its gradient arrived
        (and the bucket reduced twice); wrong gradients.""",
        probe="test_strategies.py::test_strategy_matches_ddp_baseline[optim_grads_params-True]",
    ),
    Mutant(
        "reduce_scatter_over_world",
        "reduce groups and buckets",
        both("param_and_grad_buffer.py"),
        "                            input=unreduced_grad,\n"
        "                            op=reduce_op,\n"
        "                            group=gbuf.data_parallel_group,\n",
        "                            input=unreduced_grad,\n"
        "                            op=reduce_op,\n"
        "                            group=torch.distributed.group.WORLD,\n",
        """The sharded gradients' reduce-scatter runs over the whole world instead of the bucket's
        data-parallel group. Both entry points, sharded strategies. Identical on 2 ranks with
        dp = world; with tp=2 x dp=2 or HSDP the wrong ranks are summed (or the sizes mismatch).""",
        probe="test_strategies.py::test_tensor_parallel_2",
    ),
    Mutant(
        "sync_reduce_scatter_skipped",
        "reduce groups and buckets",
        both("megatron_fsdp.py"),
        "            else:\n                self.param_and_grad_buffer.reduce_scatter_gradients()\n",
        "            else:\n                pass\n",
        """finish_grad_sync with overlap_grad_reduce=False no longer reduce-scatters unsharded
        gradients ('optim' strategy). megatron-core entry point. Symptom: each rank steps its
        optimizer shard on its own gradient: ranks diverge from DDP at iteration 2.""",
        probe="test_strategies.py::test_strategy_matches_ddp_baseline[optim-False]",
    ),
    # --- parameter all-gather and prefetch ----------------------------------------------------------
    Mutant(
        "all_gather_not_waited",
        "parameter all-gather and prefetch",
        both("param_and_grad_buffer.py"),
        "        param_gather_event.wait()\n        mark_bucket_ready_to_use()\n",
        "        mark_bucket_ready_to_use()\n",
        """A gathered bucket is marked ready without waiting for its all-gather. Both entry points,
        optim_grads_params (weights sharded). Symptom on GPUs: the forward reads a half-written
        bucket (stream race); on CPU ranks gloo's async all-gather may or may not be done.""",
        probe="test_strategies.py::test_strategy_matches_ddp_baseline[optim_grads_params-True]",
    ),
    Mutant(
        "all_gather_from_rank0_shard",
        "parameter all-gather and prefetch",
        both("param_and_grad_buffer.py"),
        "        param_gather_event = torch.distributed.all_gather_into_tensor(\n"
        "            output_tensor=bucket.data,\n"
        "            input_tensor=wbuf.get_shard_from_local_buffer(),\n",
        "        param_gather_event = torch.distributed.all_gather_into_tensor(\n"
        "            output_tensor=bucket.data,\n"
        "            input_tensor=wbuf.data[: wbuf.shard_bucket_index.size],\n",
        """The all-gather sends the first shard-sized slice of the local buffer instead of this
        rank's shard: identical for a sharded buffer (it holds the shard only), wrong for an
        unsharded one. Both entry points. Symptom: only where a weight buffer is unsharded and
        gathered anyway; likely equivalent on every path the suite runs.""",
        probe="test_strategies.py::test_strategy_matches_ddp_baseline[optim_grads-True]",
    ),
    Mutant(
        "sync_param_gather_skips_buckets",
        "parameter all-gather and prefetch",
        both("megatron_fsdp.py"),
        "            for bucket_id in range(self.all_gather_pipeline.num_buckets):\n"
        "                self.all_gather_pipeline.async_bucket_gather(bucket_id=bucket_id, bwd=False)\n",
        "            for bucket_id in range(1, self.all_gather_pipeline.num_buckets):\n"
        "                self.all_gather_pipeline.async_bucket_gather(bucket_id=bucket_id, bwd=False)\n",
        """start_param_sync without overlap (overlap_param_gather=False) gathers all buckets but the
        first (off-by-one range). megatron-core entry point, sharded strategies without overlap.
        Symptom: the first bucket's waits find it EMPTY (ValueError) or it keeps stale weights.""",
        probe="test_strategies.py::test_strategy_matches_ddp_baseline[optim_grads-False]",
    ),
    # --- shard offsets and sizes -------------------------------------------------------------------
    Mutant(
        "shard_order_reversed",
        "shard offsets and sizes",
        both("param_and_grad_buffer.py"),
        "    bucket_data_index = shard_size * data_parallel_rank\n",
        "    bucket_data_index = shard_size * (data_parallel_world_size - 1 - data_parallel_rank)\n",
        """Each rank's shard of a bucket is taken from the mirrored position (rank r owns shard
        dp-1-r) while collectives still place rank r's data at r. Both entry points, every
        strategy. Symptom: gathered weights and reduced gradients land in the wrong place.""",
        probe="test_strategies.py::test_strategy_matches_ddp_baseline[optim_grads_params-True]",
    ),
    Mutant(
        "shard_slice_end_off_by_one",
        "shard offsets and sizes",
        both("param_and_grad_buffer.py"),
        "        end = min(item_global_end, shard_bucket_end) - item_global_start\n",
        "        end = min(item_global_end, shard_bucket_end - 1) - item_global_start\n",
        """The slice of a parameter inside a shard ends one element early when the shard ends
        inside the parameter. Both entry points, sharded strategies. Symptom: one element per
        shard boundary is never stored / updated (or a size mismatch on copy).""",
        probe="test_strategies.py::test_strategy_matches_ddp_baseline[optim_grads_params-True]",
    ),
    Mutant(
        "bucket_not_padded_to_dp",
        "shard offsets and sizes",
        both("param_and_grad_buffer.py"),
        "            return _pad(data_index, data_parallel_world_size * chunk_size_factor)\n",
        "            return _pad(data_index, chunk_size_factor)\n",
        """Buckets are no longer padded to a multiple of the data-parallel size: shard_size rounds
        down and the tail of each bucket belongs to no rank. Both entry points, sharded strategies.
        Symptom: size mismatches in the collectives, or tail elements never trained.""",
        probe="test_strategies.py::test_hsdp_two_optimizer_instances_train_and_round_trip[optim]",
    ),
    Mutant(
        "virtual_shard_offset_sign",
        "shard offsets and sizes",
        both("param_and_grad_buffer.py"),
        "            - shard_bucket_index.global_data_index\n"
        "            + shard_bucket_index.local_data_index\n",
        "            - shard_bucket_index.global_data_index\n"
        "            - shard_bucket_index.local_data_index\n",
        """The local index of a parameter in a virtual shard (an unsharded buffer seen through a
        sharded optimizer, 'optim' and the main weights of optim_grads) subtracts the shard's local
        offset instead of adding it. Both entry points. Symptom: a rank's optimizer gets another
        slice's gradient/weights. Measured: on 2 ranks rank 1's offset becomes -(bucket size) and Python's
        negative slicing lands on the right elements (the whole 2-rank suite passed); 4 data-parallel
        ranks expose it.""",
        probe="test_four_data_parallel_ranks.py::test_fully_shard_on_four_ranks_matches_torch_ddp[optim]",
    ),
    # --- optimizer step and copy-back --------------------------------------------------------------
    Mutant(
        "copy_back_skipped",
        "optimizer step and copy-back",
        (MCORE + "optimizer/distrib_optimizer.py",),
        "                model_chunk.param_and_grad_buffer.copy_main_weights_to_model_weights()\n",
        "                pass\n",
        """The distributed optimizer no longer copies Megatron-FSDP's updated main weights into the
        model's compute weights. megatron-core entry point, every strategy. Symptom: the model
        never changes: losses do not decrease, the state dict's main weights and model disagree.""",
        probe="test_strategies.py::test_strategy_matches_ddp_baseline[optim_grads_params-True]",
    ),
    Mutant(
        "copy_back_into_main",
        "optimizer step and copy-back",
        both("param_and_grad_buffer.py"),
        "                    model_param.data.copy_(main_weight.view(model_param.shape))\n",
        "                    main_weight.view(model_param.shape).copy_(model_param.data)\n",
        """copy_main_weights_to_model_weights copies in the wrong direction (model -> main): every
        step's update is overwritten by the old compute weights. Both entry points. Symptom: the
        model never learns.""",
        probe="test_strategies.py::test_strategy_matches_ddp_baseline[optim_grads_params-True]",
    ),
    Mutant(
        "optimizer_gets_full_grad",
        "optimizer step and copy-back",
        both("param_and_grad_buffer.py"),
        'self.bucketing_policy.data_parallel_sharding_strategy != "no_shard"\n            )',
        'self.bucketing_policy.data_parallel_sharding_strategy == "optim_grads_params"\n            )',
        """update_main_grads treats 'optim' and 'optim_grads' as unsharded optimizer state and hands
        the optimizer the whole gradient. Both entry points, optim / optim_grads. Symptom: shape
        mismatch between the sharded main weight and its gradient (or a wrong slice).""",
        probe="test_strategies.py::test_strategy_matches_ddp_baseline[optim_grads-True]",
    ),
    # --- no_shard parameter sync ---------------------------------------------------------------------
    Mutant(
        "no_shard_param_sync_fetches_bucket",
        "no_shard parameter sync",
        both("megatron_fsdp.py"),
        '        if self.data_parallel_sharding_strategy == "no_shard":\n            return\n\n'
        "        if not force_sync and self.ddp_config.overlap_param_gather:\n",
        "        if not force_sync and self.ddp_config.overlap_param_gather:\n",
        """Revert of the 0.18 fix: start_param_sync no longer returns early for no_shard, so without
        parameter-gather overlap it all-gathers weight buckets no_shard does not have. Both entry
        points, no_shard with overlap_param_gather=False. Symptom (0.16/0.17): AttributeError
        'NoneType' object has no attribute 'fetch_bucket'.""",
        replays="no_shard_param_sync: Megatron-LM PR #3754 (fixed in megatron-core 0.18)",
        probe="test_strategies.py::test_no_shard[False]",
    ),
    Mutant(
        "no_shard_allreduce_skipped",
        "no_shard parameter sync",
        both("param_and_grad_buffer.py"),
        "                        torch.distributed.all_reduce(\n"
        "                            unreduced_grad, op=reduce_op, group=gbuf.data_parallel_group\n"
        "                        )\n",
        "                        pass\n",
        """no_shard's overlapped all-reduce of the gradient bucket is dropped: each replica steps on
        its own gradient, and the replicas' weights drift apart. Both entry points, no_shard with
        overlap_grad_reduce=True. Symptom: losses differ from DDP; replicas hold different
        weights.""",
        probe="test_strategies.py::test_no_shard[True]",
    ),
    # --- gradient norm and clipping ------------------------------------------------------------------
    Mutant(
        "grad_norm_not_summed_over_ranks",
        "gradient norm and clipping",
        (MCORE + "optimizer/clip_grads.py",),
        "        torch.distributed.all_reduce(\n"
        "            total_norm, op=torch.distributed.ReduceOp.SUM, group=grad_stats_parallel_group\n"
        "        )\n"
        "        if multi_tensor_scale_tensor_impl is not None:\n",
        "        if multi_tensor_scale_tensor_impl is not None:\n",
        """The grad norm's sum of squares is no longer reduced over the gradient-statistics group
        (for the distributed optimizer: its data-parallel ranks, each holding a shard of the
        gradients): each rank reports, and clips with, the norm of its own shard. megatron-core
        entry point, every Megatron-FSDP strategy (DDP's group there is model-parallel only).
        Symptom: grad norm below DDP's and different per rank; clipping with the wrong coefficient.
        (The block above it, summing over a DTensor gradient's group, is dead on this path: the
        distributed optimizer hands plain local shards to the norm.)""",
        probe="test_strategies.py::test_strategy_matches_ddp_baseline[optim_grads_params-True]",
    ),
    Mutant(
        "clip_coeff_off",
        "gradient norm and clipping",
        (MCORE + "optimizer/clip_grads.py",),
        "    clip_coeff = max_norm / (total_norm + 1.0e-6)\n",
        "    clip_coeff = max_norm / (total_norm + 1.0e-6) * 2\n",
        """The clipping coefficient is twice what it should be. Every wrapper with clip_grad > 0.
        Symptom: clipped gradients larger than max_norm; clipped updates differ from the
        hand-computed clip.""",
        probe="test_schedule.py::test_megatrons_gradient_clipping_applies_on_every_platform",
    ),
    Mutant(
        "no_shard_grad_norm_over_dp",
        "gradient norm and clipping",
        (MCORE + "optimizer/__init__.py",),
        "            mp_group\n            if ddp_config.data_parallel_sharding_strategy == 'no_shard'\n",
        "            intra_dist_opt_group\n"
        "            if ddp_config.data_parallel_sharding_strategy == 'no_shard'\n",
        """no_shard's gradient statistics are reduced over the data-parallel ranks again, although its
        gradients are replicated there after the all-reduce: the grad norm is sqrt(dp) times DDP's
        (megatron-core's optimizer for Megatron-FSDP, no_shard only). Symptom: no_shard's grad norm
        leaves DDP's at every iteration (sqrt(2) on 2 ranks); clipping would act on the wrong norm.""",
        replays="no_shard_grad_norm_over_counted: megatron-core 0.16.1 reduced no_shard's grad norm over "
        "the data-parallel group (fixed by 0.19.2, which reduces it over the model-parallel group only)",
        probe="test_strategies.py::test_no_shard",
    ),
    # --- mixed precision -----------------------------------------------------------------------------
    Mutant(
        "main_weights_in_compute_dtype",
        "mixed precision",
        both("param_and_grad_buffer.py"),
        "                    dtype=self.mp_policy.main_params_dtype,\n",
        "                    dtype=group.params[0].dtype,\n",
        """Main weights are allocated in the compute dtype (bf16 for a bf16 model) instead of
        main_params_dtype (fp32). Both entry points, bf16 models. Symptom: the optimizer steps bf16
        weights; small updates round away.""",
        probe="test_fully_shard.py::test_fully_shard_bf16_mixed_precision_trains",
    ),
    Mutant(
        "grad_comm_dtype_ignored",
        "mixed precision",
        both("param_and_grad_buffer.py"),
        "self.mp_policy.grad_comm_dtype if p._gbuf.is_data_distributed else None",
        "None",
        """The communication bucket a sharded parameter's gradient is written into is allocated in the
        gradient buffer's dtype instead of grad_comm_dtype (the reduce-scatter then reuses that
        bucket). Both entry points with a grad_comm_dtype that differs from main_grads_dtype
        (fully_shard's bf16 policy: fp32 gradients, bf16 communication). Symptom: fp32 collectives:
        more precise, twice the bytes; the losses barely move, only the collective's dtype shows it.
        (The same conditional at the reduce-scatter's own fetch_bucket is dead: the bucket exists.)""",
        probe="test_fully_shard.py::test_fully_shard_bf16_mixed_precision_trains",
    ),
    # --- checkpoint contents -------------------------------------------------------------------------
    Mutant(
        "optimizer_state_not_loaded",
        "checkpoint contents",
        (MCORE + "optimizer/distrib_optimizer.py",),
        "            self.optimizer.load_state_dict(state_dict)\n            return\n",
        "            return\n",
        """Loading a Megatron-FSDP checkpoint no longer loads the optimizer state (the distributed
        optimizer returns early). megatron-core entry point. Symptom: Adam moments and step counts
        are the fresh run's; a resumed run departs from the uninterrupted one.""",
        probe="test_strategies.py::test_hsdp_two_optimizer_instances_train_and_round_trip[no_shard]",
    ),
    Mutant(
        "uneven_chunk_offset_off_by_one_rank",
        "checkpoint contents",
        both("uneven_dtensor.py"),
        "        offset = sum(s[shard_dim] for s in global_shapes[:rank])\n",
        "        offset = sum(s[shard_dim] for s in global_shapes[: max(rank - 1, 0)])\n",
        """Uneven-DTensor chunk metadata: rank r's offset sums the shapes of ranks before r-1, so
        ranks 0 and 1 both claim offset 0. Both entry points' fsdp_dtensor checkpoints. Symptom: the
        saved chunks overlap; the tail of each tensor is lost; a loaded model differs.""",
        probe="test_strategies.py::test_strategy_matches_ddp_baseline[optim_grads_params-True]",
    ),
    Mutant(
        "swiglu_halves_swapped",
        "checkpoint contents",
        (MCORE + "transformer/fsdp_dtensor_checkpoint.py",),
        "        w_slice = slice(0, data_size // 2)\n        v_slice = slice(data_size // 2, data_size)\n",
        "        v_slice = slice(0, data_size // 2)\n        w_slice = slice(data_size // 2, data_size)\n",
        """handle_swiglu_in_state_dict splits linear_fc1 into _w and _v the wrong way round. Megatron-LM
        layout (fsdp_dtensor) with a SwiGLU model. Symptom: a save/load with the same handler round
        trips, but the file's _w holds the gate's other half: a checkpoint read by another tool (or
        an older one) is wrong.""",
        probe="test_checkpoint_contents.py::test_swiglu_halves_on_disk_are_the_gate_and_the_linear_half",
    ),
    Mutant(
        "dtensor_rows_of_a_3d_parameter",
        "checkpoint contents",
        both("param_and_grad_buffer.py"),
        "    if len(orig_param.shape) > 1:\n        local_shape = (-1, *orig_param.shape[1:])\n",
        "    if len(orig_param.shape) > 1:\n        local_shape = (-1, orig_param.shape[-1])\n",
        """make_fsdp_dtensor views a rank's shard as rows of the parameter's last dimension only: the
        same for every 2-D weight, wrong for a convolution's (channels x 1 x kernel, as hybrid models
        have). Both entry points' state dicts and fsdp_dtensor checkpoints. Symptom: a 3-D weight's
        DTensor has 2-D shards; its save or load fails, or loads another shape.""",
        probe="test_three_dimensional_parameters.py::test_a_convolution_weight_round_trips_through_a_checkpoint",
    ),
    Mutant(
        "rng_states_not_restored",
        "checkpoint contents",
        (MCORE + "tensor_parallel/random.py",),
        "        self._is_initialized = True\n        self.states_ = states\n",
        "        self._is_initialized = True\n",
        """The CUDA RNG tracker's set_states ignores the states given (a checkpoint's). Every wrapper
        that restores RNG from a checkpoint. Symptom: dropout and other forked-RNG draws after a
        resume differ from the uninterrupted run's.""",
        probe="test_checkpoint.py::test_a_pre_digest_checkpoint_from_the_floor_stack_loads_exactly",
    ),
    # --- HSDP outer reduction -----------------------------------------------------------------------
    Mutant(
        "hsdp_outer_allreduce_skipped",
        "HSDP outer reduction",
        both("param_and_grad_buffer.py"),
        "                            torch.distributed.all_reduce(\n"
        "                                unreduced_grad, group=outer_fsdp_group, op=reduce_op\n"
        "                            )\n",
        "                            pass\n",
        """HSDP with outer no_shard: the gradient is no longer all-reduced across the replicas
        (DP-outer). Both entry points, HSDP. Symptom: each replica steps on its half of the data;
        replicas drift apart; losses leave DDP's.""",
        probe="test_strategies.py::test_hsdp_two_optimizer_instances_train_and_round_trip[no_shard]",
    ),
    Mutant(
        "grad_divisor_from_shard_group",
        "HSDP outer reduction",
        both("megatron_fsdp.py"),
        "                data_parallel_world_size = self.dist_index.get_dp_group().size()\n",
        "                data_parallel_world_size = self.dist_index.get_fsdp_group().size()\n",
        """The gradient average divides by the size of the sharding group instead of the whole
        data-parallel group (shard x outer): over-scaled gradients whenever the groups differ, the
        family of Megatron-LM issue #6660. Both entry points, HSDP. Symptom: gradients x outer size
        (2 on 4 ranks); SGD losses leave DDP's.""",
        probe="test_fully_shard.py::test_fully_shard_hsdp_on_four_ranks_matches_torch_ddp",
    ),
    # --- a collective only some ranks enter ----------------------------------------------------------
    Mutant(
        "grad_norm_reduced_on_rank0_only",
        "partial collective",
        (MCORE + "optimizer/clip_grads.py",),
        "        torch.distributed.all_reduce(\n"
        "            total_norm, op=torch.distributed.ReduceOp.SUM, group=grad_stats_parallel_group\n"
        "        )\n"
        "        if multi_tensor_scale_tensor_impl is not None:\n",
        "        if torch.distributed.get_rank() == 0:\n"
        "            torch.distributed.all_reduce(\n"
        "                total_norm, op=torch.distributed.ReduceOp.SUM, group=grad_stats_parallel_group\n"
        "            )\n"
        "        if multi_tensor_scale_tensor_impl is not None:\n",
        """Only rank 0 enters the all-reduce of the grad norm over the gradient-statistics group; rank 1
        goes on to its next collective. megatron-core entry point, every Megatron-FSDP strategy (the
        group spans the data-parallel ranks). Symptom: mismatched collectives: a hang or a garbled
        reduction; either must end as a bounded failure (the plugin's per-test timeout), not a hang.""",
        probe="test_strategies.py::test_strategy_matches_ddp_baseline[optim_grads_params-True]",
    ),
    # --- adapter / wrappers: replays -----------------------------------------------------------------
    Mutant(
        "optim_overlap_adds_onto_unreduced",
        "gradient accumulation",
        both("param_and_grad_buffer.py"),
        'if ddp_config.data_parallel_sharding_strategy in ["no_shard", "optim"]:',
        'if ddp_config.data_parallel_sharding_strategy in ["no_shard"]:',
        """Revert of the 0.17 change: 'optim' with overlap_grad_reduce adds the reduce-scattered shard
        onto the rank's still-unreduced local gradient (local_grad += reduced_grad) instead of
        copying it. Both entry points, 'optim'. Symptom: each rank's shard counts its own gradient
        twice; losses leave DDP's at iteration 2.""",
        replays="optim_overlap_double_count: Megatron-LM PR #3067 (fixed in megatron-core 0.17)",
        probe="test_fully_shard.py::test_fully_shard_bf16_mixed_precision_trains[optim]",
    ),
    Mutant(
        "tp_without_te_isinstance_none",
        "adapter and wrappers",
        (MCORE + "distributed/fsdp/mcore_fsdp_adapter.py",),
        "        module_type = type(module).__name__\n\n        # Handle fused modules",
        "        module_type = type(module).__name__\n"
        "        from megatron.core.extensions.transformer_engine import TELinear\n\n"
        "        if parallel_state.get_tensor_model_parallel_world_size() > 1 and isinstance(\n"
        "            module, (TELinear,)\n"
        "        ):\n"
        '            module_type = "TELinear"\n\n'
        "        # Handle fused modules",
        """Revert of the 0.18 fix in spirit: the adapter classifies tensor-parallel modules with
        isinstance(m, (TELinear,)), which is a TypeError when Transformer Engine is absent (TELinear
        is None). megatron-core entry point, tp > 1 without TE. Symptom: TypeError at wrap time.""",
        replays="tensor_parallel_without_te: Megatron-LM PR #3191 (fixed in megatron-core 0.18)",
        probe="test_strategies.py::test_tensor_parallel_2",
    ),
    Mutant(
        "fsdp2_finish_grad_sync_signature",
        "adapter and wrappers",
        (MCORE + "distributed/torch_fully_sharded_data_parallel.py",),
        "    def finish_grad_sync(self, force_all_reduce=False):\n",
        "    def finish_grad_sync(self):\n",
        """Revert of the 0.19 fix: TorchFullyShardedDataParallel.finish_grad_sync takes no
        force_all_reduce, which finalize_model_grads passes. megatron-core's FSDP2 wrapper.
        Symptom: TypeError after the first backward.""",
        replays="fsdp2_finish_grad_sync: Megatron-LM PR #4953 (fixed in megatron-core 0.19)",
        probe="test_strategies.py::test_torch_fsdp2_trains",
    ),
    # --- Megatron-FSDP V2 (megatron_fsdp/experimental, FullyShardedDataParallelV2; Megatron-LM main) ---
    # megatron-core builds V2 with ddp.megatron_fsdp_version=2 (tests/functional/test_megatron_fsdp_v2.py):
    # every module is a fully_shard unit whose parameters live in DBuffers (main weight, main grad,
    # compute weight); on a stack without V2 these mutants are not applicable.
    Mutant(
        "v2_grad_summed_not_averaged",
        "gradient scaling/averaging",
        both("experimental/parameter_group.py"),
        '                placements=[Partial("avg")] * self.mesh.ndim,\n',
        '                placements=[Partial("sum")] * self.mesh.ndim,\n',
        """V2's reduce-scatter input buffer is Partial("sum") instead of Partial("avg"): each backward's
        gradient is summed over the data-parallel ranks, not averaged. megatron-core V2
        (FsdpParameterGroup.allocate_partial_grad_buffer, every module's post-backward). Symptom:
        gradients and the grad norm dp times DDP's; Adam hides most of it from the losses, not all.""",
        needs=V2,
        probe="test_megatron_fsdp_v2.py::test_v2_strategy_matches_ddp_baseline[optim_grads_params]",
    ),
    Mutant(
        "v2_accum_overwrites",
        "gradient accumulation",
        both("experimental/parameter_group.py"),
        "                self.main_grad.local_buffer.add_(reduced_grad.local_buffer)\n",
        "                self.main_grad.local_buffer.copy_(reduced_grad.local_buffer)\n",
        """V2's reduce_partial_gradients overwrites the sharded gradient the earlier micro-batches of
        the step left (sharded .grad still set) instead of adding onto it. megatron-core V2 with
        several micro-batches per step. Symptom: only the last micro-batch's gradient counts; with
        one micro-batch nothing changes.""",
        needs=V2,
        probe="test_megatron_fsdp_v2.py::test_v2_gradient_accumulation_four_microbatches",
    ),
    Mutant(
        "v2_accum_reduces_into_main_grad",
        "gradient accumulation",
        both("experimental/parameter_group.py"),
        "        has_sharded_grads = self._has_sharded_grads()\n",
        "        has_sharded_grads = False\n",
        """V2 no longer notices that the sharded gradients of earlier micro-batches are installed: every
        backward reduce-scatters straight into main_grad (out=), as on the first micro-batch of a
        step. megatron-core V2, several micro-batches per step. Symptom: each micro-batch's reduced
        gradient replaces the running sum (only the last counts).""",
        needs=V2,
        probe="test_megatron_fsdp_v2.py::test_v2_gradient_accumulation_four_microbatches",
    ),
    Mutant(
        "v2_shard_offset_mirrored",
        "shard offsets and sizes",
        both("experimental/layout.py"),
        "            offset += mesh.get_local_rank(axis) * shard_size\n",
        "            offset += (axis_size - 1 - mesh.get_local_rank(axis)) * shard_size\n",
        """GlobalLayout.get_local_range gives rank r the mirrored shard (dp-1-r) of every DBuffer, while
        the all-gather and reduce-scatter still place rank r's data at r. megatron-core V2, every
        buffer. Symptom: the gathered compute weights are permuted shard-wise (the forward runs on
        a scrambled model), the reduced gradient lands on another rank's weights.""",
        needs=V2,
        probe="test_megatron_fsdp_v2.py::test_v2_strategy_matches_ddp_baseline[optim_grads_params]",
    ),
    Mutant(
        "v2_owned_range_from_tensor_start",
        "shard offsets and sizes",
        both("experimental/dbuffer.py"),
        "            tensor_relative_offset=overlap_start - tensor_start,\n",
        "            tensor_relative_offset=0,\n",
        """DBuffer._get_owned_range says every rank's part of a tensor starts at the tensor's first
        element: distribute_tensors copies the first rows of each parameter into every rank's shard
        of it. megatron-core V2, at wrap time (the initial main weights). Symptom: a rank whose shard
        starts inside a parameter trains a copy of that parameter's head; losses leave DDP's from
        iteration 1.""",
        needs=V2,
        probe="test_megatron_fsdp_v2.py::test_v2_strategy_matches_ddp_baseline[optim_grads_params]",
    ),
    Mutant(
        "v2_not_resharded_after_backward",
        "parameter all-gather and prefetch",
        both("experimental/module.py"),
        "        self._reshard_parameter_groups()\n        self._reduce_gradient_groups()\n",
        "        self._reduce_gradient_groups()\n",
        """V2's post_backward no longer reshards: the module keeps its unsharded parameters and its
        'already gathered' event, so the next forward skips the all-gather. megatron-core V2, every
        module with trainable parameters. Symptom: from iteration 2 the forward runs on the weights
        gathered before the optimizer step (stale); losses leave DDP's; the full weights stay in
        memory (on GPUs: the memory V2 exists to save).""",
        needs=V2,
        probe="test_megatron_fsdp_v2.py::test_v2_strategy_matches_ddp_baseline[optim_grads_params]",
    ),
    Mutant(
        "v2_dtensor_global_shape_is_local",
        "checkpoint contents",
        both("experimental/dbuffer.py"),
        "            shape=tensor_shape,\n",
        "            shape=local_tensor.shape,\n",
        """DBuffer.get_dtensor builds each sharded parameter (and its gradient) as a DTensor whose
        global shape is the rank's local shard shape. megatron-core V2: the DTensors the optimizer
        steps, DCP's state dict, the uneven-DTensor chunk metadata. Symptom: a state dict that
        describes no whole tensor: a DCP save/load fails or loads wrong values.""",
        needs=V2,
        probe="test_megatron_fsdp_v2.py::test_v2_dcp_round_trip_is_exact[fp32]",
    ),
    Mutant(
        "v2_main_weights_in_compute_dtype",
        "mixed precision",
        both("experimental/parameter_group.py"),
        "        main_weight_dtype = mixed_precision_policy.main_params_dtype or torch.float32\n",
        "        main_weight_dtype = first_parameter.dtype\n",
        """V2's main weights (what the optimizer steps) are allocated in the parameters' dtype (bf16 for
        a bf16 model) instead of main_params_dtype (fp32, megatron-core's default). megatron-core V2
        with bf16. Symptom: the optimizer steps bf16 weights, small updates round away; a bf16 run
        and its fp32 main weights no longer exist separately.""",
        needs=V2,
        probe="test_megatron_fsdp_v2.py::test_v2_dcp_round_trip_is_exact[bf16]",
    ),
    # --- replays of upstream fixes (Megatron-LM history of megatron/core/distributed/fsdp) ---------
    Mutant(
        "v2_compute_weights_not_refreshed_after_step",
        "optimizer step and copy-back",
        (MCORE + "optimizer/fully_sharded_optimizer.py",),
        '        """Refresh MFSDP V2 compute weights after updating optimizer weights."""\n'
        "        sync_model_weights_from_main_weights(self.get_parameters())\n",
        '        """No-op: MFSDP v2 currently syncs compute weights in its forward pre-hook."""\n',
        """Revert of PR #6336: FullyShardedOptimizer._copy_main_params_to_model_params is a no-op again,
        so the compute weights are not refreshed from the stepped main weights (the forward
        pre-hook it relied on no longer syncs). megatron-core V2 whenever compute and main weights
        are separate buffers (bf16 model, fp32 main weights; with fp32 they are one buffer).
        Symptom: the bf16 model computes on its initial weights for ever.""",
        replays="Megatron-LM PR #6336 (1d402ad6e2): refresh V2 compute weights after optimizer step",
        needs=V2,
        probe="test_megatron_fsdp_v2.py::test_v2_dcp_round_trip_is_exact[bf16]",
    ),
    Mutant(
        "root_forward_bypasses_hooks",
        "adapter and wrappers",
        both("megatron_fsdp.py"),
        "            output = self.module(*inputs, **kwargs)\n",
        "            output = self.module.forward(*inputs, **kwargs)\n",
        """Revert of PR #5808: MegatronFSDP.forward calls the wrapped module's forward() directly, so
        the hooks registered on the root module (its pre-forward unshard and post-forward reshard,
        when the root is an FSDP unit: fsdp_unit_modules naming the model's own type) never run. Both
        entry points; equivalent where the root is no unit (GPT with TransformerLayer units, the
        two-block MLP with Block units). Symptom: the root unit's parameters are used sharded
        (shape errors) or stale.""",
        replays="Megatron-LM PR #5808 (4bf7fca050): fix MegatronFSDP root module hook dispatch",
        probe="test_fully_shard.py::test_fully_shard_whole_model_as_one_unit_matches_torch_ddp",
    ),
    Mutant(
        "model_auto_sync_overwritten_with_none",
        "gradient accumulation",
        both("megatron_fsdp.py"),
        "        self.set_model_auto_sync(sync_model_each_microbatch)\n",
        "        self.model_auto_sync = self.set_model_auto_sync(sync_model_each_microbatch)\n",
        """Revert of Megatron-LM MR !4062: the wrapper assigns set_model_auto_sync's return value (None)
        to model_auto_sync, so sync_model_each_microbatch=True (fully_shard's default) is lost:
        no_shard/optim gradients are never reduced in the post-backward hook and sharded weights are
        not gathered for the next step. fully_shard entry point. Symptom: unsharded strategies step
        on unreduced gradients (ranks diverge from DDP).""",
        replays="Megatron-LM commit 03045f2d88 (ADLR MR !4062): fix mis-set of model_auto_sync",
        probe="test_fully_shard.py::test_fully_shard_strategy_matches_torch_ddp",
    ),
    Mutant(
        "state_dict_hook_on_root_only",
        "checkpoint contents",
        both("megatron_fsdp.py"),
        "        for name, module in self.named_modules():\n"
        "            module.register_state_dict_pre_hook(\n"
        "                lambda *args, **kwargs: self._replace_param_with_distributed_if_needed()\n"
        "            )\n",
        "        self._state_dict_pre_hook = self.module.register_state_dict_pre_hook(\n"
        "            lambda *args, **kwargs: self._replace_param_with_distributed_if_needed()\n"
        "        )\n",
        """Revert of PR #2138: the pre-state_dict hook that swaps the distributed (DTensor) parameters
        back in is registered on the wrapped module only, not on every submodule, so a state dict
        taken from a submodule (or through a path that skips the root's hook) sees the raw
        parameters. Both entry points' checkpoint save. Symptom: a save that fails, or a checkpoint
        holding raw bucket views instead of DTensor shards. Measured on main: the fp32 round trips pass;
        the bf16 save (Float16Module between the wrapper and GPTModel) fails preparing the save.""",
        replays="Megatron-LM PR #2138 (d82a6d8256): fix Megatron-FSDP checkpoint save failure",
        probe="test_checkpoint.py::test_megatron_lm_key_layout_for_the_bridge_reference_preset",
    ),
    Mutant(
        "unsharded_reduce_without_overlap_in_hook",
        "gradient accumulation",
        both("megatron_fsdp.py"),
        "            if grad_reduce_every_bprop or (\n"
        '                # "no_shard" and "optim" can have overlapped or non-overlapped\n'
        "                # gradient reduction. Non-overlapped gradient reduction happens\n"
        "                # in start_grad_sync() or synchronize_gradient_reduce().\n"
        "                # Must only happen once on the final microbatch prior to optimization,\n"
        "                # or else unsharded gradient buffers will be redundantly reduced.\n"
        "                self.ddp_config.overlap_grad_reduce\n"
        "                and (is_last_microbatch or self.model_auto_sync)\n"
        "            ):\n"
        "                # Launch asynchronous",
        "            if grad_reduce_every_bprop or is_last_microbatch or self.model_auto_sync:\n"
        "                # Launch asynchronous",
        """Revert of PR #6357's reduction condition (its first hunk, the per-parameter post-backward
        hook): no_shard/optim reduce their unsharded gradients in the hook on the last micro-batch
        even without overlap_grad_reduce, and finish_grad_sync reduces them again. megatron-core,
        no_shard/optim with overlap_grad_reduce=False. Symptom: gradients reduced (and scaled) twice:
        the known bug optim_sync_double_reduce of megatron-core 0.19 coming back.""",
        replays="Megatron-LM PR #6357 (342faa43cd): fix gradient sharding / reduction schedule with ZeRO-1/2",
        needs=Needs(
            VENDORED + "megatron_fsdp.py",
            "                self.ddp_config.overlap_grad_reduce\n"
            "                and (is_last_microbatch or self.model_auto_sync)\n",
            "the fix (Megatron-LM PR #6357) is not in this stack: its megatron-core reduces in the hook "
            "without overlap_grad_reduce (the known bug optim_sync_double_reduce)",
        ),
        probe="test_strategies.py::test_strategy_matches_ddp_baseline[optim-False]",
    ),
    Mutant(
        "fully_shard_optimizer_init_step_not_inert",
        "optimizer step and copy-back",
        both("fully_shard.py"),
        "    optimizer_group_settings = []\n"
        "    for group in optimizer.param_groups:\n"
        "        optimizer_group_settings.append(\n"
        '            (group, {key: group[key] for key in ("lr", "weight_decay") if key in group})\n'
        "        )\n"
        '        if "lr" in group:\n'
        "            # Capturable optimizers may require lr to remain a device tensor.\n"
        '            group["lr"] = (\n'
        '                torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0\n'
        "            )\n"
        '        if "weight_decay" in group:\n'
        '            group["weight_decay"] = 0.0\n'
        "    # Allocate the state, then restore the caller's optimizer settings.\n"
        "    optimizer.step()\n"
        "    for group, settings in optimizer_group_settings:\n"
        "        group.update(settings)\n",
        "    optimizer.step()\n",
        """Revert of PR #5976 (its lr/weight-decay part): fully_shard_optimizer's synthetic step, which
        only materializes the optimizer state for DCP, runs with the caller's lr and weight decay:
        weight decay (coupled or decoupled) already moves the weights before the first real step.
        fully_shard entry point. Symptom: after one step the weights differ from torch DDP's
        (the 'optimizer under-update' of the PR's title).""",
        replays="Megatron-LM PR #5976 (ce8a8a736f): fix Megatron FSDP optimizer under-update",
        needs=Needs(
            STANDALONE + "fully_shard.py",
            "    # A zero gradient alone does not make optimizer.step() inert.",
            "the fix (Megatron-LM PR #5976) is not in this stack",
        ),
        probe="test_fully_shard.py::test_fully_shard_adam_matches_torch_ddp",
    ),
    Mutant(
        "fully_shard_optimizer_step_count_not_reset",
        "optimizer step and copy-back",
        both("fully_shard.py"),
        "    for state in optimizer.state.values():\n"
        '        if "step" not in state:\n'
        "            continue\n"
        '        if isinstance(state["step"], torch.Tensor):\n'
        '            state["step"].zero_()\n'
        "        else:\n"
        '            state["step"] = 0\n',
        "",
        """Revert of PR #5976 (its step-counter part): after fully_shard_optimizer's synthetic step the
        per-parameter step counters (Adam's state['step']) are left at 1, so the first real update
        uses step 2's bias correction. fully_shard entry point with Adam. Symptom: the first updates
        are too small (under-update); losses leave torch DDP's from iteration 2.""",
        replays="Megatron-LM PR #5976 (ce8a8a736f): fix Megatron FSDP optimizer under-update",
        needs=Needs(
            STANDALONE + "fully_shard.py",
            "    # A zero gradient alone does not make optimizer.step() inert.",
            "the fix (Megatron-LM PR #5976) is not in this stack",
        ),
        probe="test_fully_shard.py::test_fully_shard_adam_matches_torch_ddp",
    ),
    # --- paths users run beyond the GPT: frozen parameters, root parameters, MoE, V2's own API --------
    Mutant(
        "frozen_params_made_trainable",
        "adapter and wrappers",
        both("param_and_grad_buffer.py"),
        '                            "requires_grad",\n',
        "",
        """The sharded DTensor parameters that replace the module's (and that the optimizer steps) no
        longer copy requires_grad from the originals: frozen parameters show up as trainable after
        wrapping (a PEFT filter on requires_grad then hands them to the optimizer). Both entry
        points, any strategy, only for a model with frozen parameters (the GPT has none). Symptom:
        the wrapped model's frozen parameters say requires_grad=True. (A first version edited
        _reset_parameters, which only meta-device initialisation runs: its probe passed.)""",
        probe="test_frozen_parameters.py::test_fully_shard_frozen_parameters_match_torch_ddp[optim]",
    ),
    Mutant(
        "moe_expert_grads_summed",
        "gradient scaling/averaging",
        both("megatron_fsdp.py"),
        "                expert_gradient_scaling_factor = 1.0 / data_parallel_world_size\n",
        "                expert_gradient_scaling_factor = 1.0\n",
        """The MoE experts' gradients are summed over the data-parallel ranks instead of averaged (the
        dense layers' stay averaged). Megatron-FSDP V1 on a model with experts (params named
        '.experts.'): the HybridModel's MoE layer. Symptom: expert gradients dp times too large,
        grad norm above DDP's, losses leave DDP's (Adam hides most of the scale).""",
        probe="test_hybrid_layer_kinds.py::test_hybrid_every_layer_kind_matches_ddp[v1-optim_grads_params]",
    ),
    Mutant(
        "v2_root_parameters_unmanaged",
        "adapter and wrappers",
        both("experimental/module.py"),
        '    visit(root_module, "")\n',
        "    for child_name, child_module in root_module.named_children():\n"
        "        if not isinstance(child_module, FsdpModule):\n"
        "            visit(child_module, child_name)\n",
        """V2's fully_shard collects the parameters of the module's non-FSDP children but no longer the
        module's own direct parameters: a root that owns a parameter (a bias applied before its
        sharded children) leaves it a plain, unsharded, unreduced tensor. V2's standalone API; the
        GPT's root has no direct parameter. Symptom: that parameter's gradient is this rank's only,
        losses leave torch DDP's; it is no DTensor.""",
        needs=V2_FULLY_SHARD,
        probe="test_v2_fully_shard.py::test_v2_fully_shard_matches_torch_ddp[optim_grads_params]",
    ),
    Mutant(
        "v2_frozen_and_trained_grouped_together",
        "adapter and wrappers",
        both("experimental/module.py"),
        "        key = (parameter.dtype, parameter.requires_grad)\n",
        "        key = (parameter.dtype, True)\n",
        """V2 groups a unit's parameters by dtype only, so a frozen layer and a trained one of the same
        unit share one parameter group (one flat buffer, one requires_grad). V2's standalone API on a
        model with a frozen layer beside a trained one in a unit. Symptom: V2 refuses the module
        (mixed requires_grad in a group) or trains the frozen layer.""",
        needs=V2_FULLY_SHARD,
        probe="test_frozen_parameters.py::test_v2_fully_shard_frozen_parameters_match_torch_ddp",
    ),
    Mutant(
        "v2_checkpoint_load_keeps_stale_compute_weights",
        "checkpoint contents",
        both("experimental/checkpoint.py"),
        "    sync_model_weights: bool = True,\n",
        "    sync_model_weights: bool = False,\n",
        """V2's own load_checkpoint no longer refreshes the compute weights from the loaded main
        weights by default: a bf16 model keeps computing with the loading run's own weights until
        its next optimizer step. V2's standalone save_checkpoint/load_checkpoint. Symptom: the
        resumed run's first losses are the loading run's, not the saved run's. (A first version
        dropped set_optimizer_state_dict: equivalent, DCP loads the optimizer state into the live
        state tensors in place, so the resumed losses were exact.)""",
        needs=V2_FULLY_SHARD,
        probe="test_v2_fully_shard.py::test_v2_fully_shard_checkpoint_resumes_exactly[bf16-v2_saves_v2_loads]",
    ),
    # --- upstream checkpointing: Megatron-LM's and Megatron-Bridge's fsdp_dtensor save and load -----------
    Mutant(
        "mlm_rng_not_saved",
        "upstream checkpointing",
        (TRAINING + "checkpointing.py",),
        "    rng_state = get_rng_state(\n",
        "    rng_state = {} if True else get_rng_state(\n",
        """Megatron-LM's save_checkpoint saves no RNG state. Symptom: a resume cannot find the RNG
        entries (a strict load refuses) or restores none.""",
        suite=UPSTREAM_CODE_SUITE,
        probe="test_megatron_lm_checkpointing.py::test_resume_through_megatron_lms_checkpointing_is_exact",
    ),
    Mutant(
        "mlm_args_not_saved",
        "upstream checkpointing",
        (TRAINING + "checkpointing.py",),
        "    state_dict['args'] = args\n",
        "    pass\n",
        """Megatron-LM's save_checkpoint leaves out the run's arguments, which its own loader reads
        first. Symptom: every resume fails (DCP: Missing key args).""",
        suite=UPSTREAM_CODE_SUITE,
        probe="test_megatron_lm_checkpointing.py::test_resume_through_megatron_lms_checkpointing_is_exact",
    ),
    Mutant(
        "mlm_model_load_state_dict_skipped",
        "upstream checkpointing",
        (TRAINING + "checkpointing.py",),
        "            load_model_state_dict(ddp_model[0], state_dict['model'], strict)\n",
        "            pass\n",
        """Megatron-LM's load_checkpoint reads the weights (DCP fills the DTensors in place) but skips
        the model's load_state_dict, whose post-load hook makes them the weights the forward pass
        uses (Megatron-Bridge #3397's class). Symptom: the first step after a load computes with the
        loading run's own weights.""",
        suite=UPSTREAM_CODE_SUITE,
        probe="test_megatron_lm_checkpointing.py::test_a_fine_tune_load_gives_the_saved_weights_from_the_first_step",
    ),
    Mutant(
        "mlm_scheduler_not_loaded",
        "upstream checkpointing",
        (TRAINING + "checkpointing.py",),
        "                    opt_param_scheduler.load_state_dict(state_dict['opt_param_scheduler'])\n",
        "                    pass\n",
        """Megatron-LM's load_checkpoint leaves the learning-rate scheduler where the loading run had it.
        Symptom: the resumed run's scheduler (its step count) is not the saved one.""",
        suite=UPSTREAM_CODE_SUITE,
        probe="test_megatron_lm_checkpointing.py::test_resume_through_megatron_lms_checkpointing_is_exact",
    ),
    Mutant(
        "mlm_python_rng_not_restored",
        "upstream checkpointing",
        (TRAINING + "checkpointing.py",),
        "                random.setstate(rng_state['random_rng_state'])\n",
        "                pass\n",
        """Megatron-LM's load_checkpoint restores torch's and NumPy's RNG but not Python's. Symptom: the
        resumed run's Python RNG is the loading run's own.""",
        suite=UPSTREAM_CODE_SUITE,
        probe="test_megatron_lm_checkpointing.py::test_resume_through_megatron_lms_checkpointing_is_exact",
    ),
    Mutant(
        "mlm_partial_load_always",
        "upstream checkpointing",
        (TRAINING + "checkpointing.py",),
        "        allow_partial_load = not getattr(args, 'strict_fsdp_dtensor_load', False)\n",
        "        allow_partial_load = True\n",
        """Megatron-LM's loader ignores strict_fsdp_dtensor_load (default on): a checkpoint lacking model
        weights loads, those weights left at their initial values (Megatron-LM PR #6271's class).""",
        suite=UPSTREAM_CODE_SUITE,
        probe="test_megatron_lm_checkpointing.py::test_a_checkpoint_lacking_model_weights_is_refused",
    ),
    Mutant(
        "mlm_iteration_not_returned",
        "upstream checkpointing",
        (TRAINING + "checkpointing.py",),
        "    return iteration, num_floating_point_operations_so_far\n",
        "    return 0, num_floating_point_operations_so_far\n",
        """Megatron-LM's load_checkpoint returns iteration 0 after a resume. Symptom: training restarts
        its iteration count (and schedule) from 0.""",
        suite=UPSTREAM_CODE_SUITE,
        probe="test_megatron_lm_checkpointing.py::test_resume_through_megatron_lms_checkpointing_is_exact",
    ),
    Mutant(
        "bridge_rng_not_saved",
        "upstream checkpointing",
        (BRIDGE + "training/checkpointing.py",),
        "    if ckpt_cfg.save_rng or (is_loading and rng_state is not None):\n",
        "    if is_loading and rng_state is not None:\n",
        """Megatron-Bridge saves no RNG state (save_rng ignored). Symptom: a resumed run starts its next
        iteration from its own RNG tracker states.""",
        suite=UPSTREAM_CODE_SUITE,
        probe="test_bridge_pretrain.py::test_the_rng_state_saved_and_loaded_is_the_next_iterations",
    ),
    Mutant(
        "bridge_optimizer_not_read",
        "upstream checkpointing",
        (BRIDGE + "training/checkpointing.py",),
        _BRIDGE_READ,
        "    state_dict.pop('optimizer', None)\n" + _BRIDGE_READ,
        """Megatron-Bridge's fsdp_dtensor load reads no optimizer state. Symptom: a resumed run's Adam
        moments are the loading run's; its losses leave the uninterrupted run's.""",
        suite=UPSTREAM_CODE_SUITE,
        probe="test_bridge_pretrain.py::test_resume_through_bridges_checkpoint_is_exact",
    ),
    Mutant(
        "bridge_model_not_read",
        "upstream checkpointing",
        (BRIDGE + "training/checkpointing.py",),
        _BRIDGE_READ,
        "    state_dict.pop('model', None)\n" + _BRIDGE_READ,
        """Megatron-Bridge's fsdp_dtensor load reads no model weights. Symptom: a resumed or fine-tuned
        run trains on from its own initial weights.""",
        suite=UPSTREAM_CODE_SUITE,
        probe="test_bridge_pretrain.py::test_a_fine_tune_load_gives_the_saved_weights_from_the_first_step",
    ),
    Mutant(
        "bridge_megatron_lm_step_lost",
        "upstream checkpointing",
        (BRIDGE + "training/checkpointing.py",),
        '    legacy_train_state.step = state_dict.get("iteration", 0)\n',
        "    legacy_train_state.step = 0\n",
        """Megatron-Bridge loads a checkpoint Megatron-LM's save_checkpoint wrote (no train_state.pt) at
        step 0: the train state it builds from the checkpoint's entries loses the iteration. Symptom:
        a resumed run trains its iterations again from the start, on the loaded weights.""",
        suite=UPSTREAM_CODE_SUITE,
        probe="test_bridge_pretrain.py::test_megatron_lms_checkpoint_loads_into_bridges_run",
    ),
    Mutant(
        "bridge_strict_load_ignored",
        "upstream checkpointing",
        (BRIDGE + "training/checkpointing.py",),
        '    allow_partial_load = not getattr(ckpt_cfg, "strict_fsdp_dtensor_load", False)\n',
        "    allow_partial_load = True\n",
        """Megatron-Bridge ignores strict_fsdp_dtensor_load=True: a checkpoint lacking model weights
        loads, those weights left at their initial values.""",
        suite=UPSTREAM_CODE_SUITE,
        probe="test_bridge_pretrain.py::test_a_checkpoint_lacking_model_weights_is_refused_with_a_strict_load",
    ),
)
