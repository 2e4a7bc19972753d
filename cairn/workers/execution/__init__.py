"""The device side of a step: what turns a `cairn.workers.plan.StepPlan` into kernels and logits.

- `step_work.py`: one step as plain host data (`StepWork`), what a tensor-parallel rank is sent.
- `runner.py`: `ModelRunner`, the step on one device: the plan as arrays, one upload, the
  forward, the block copies of the cache's tiers, the state slot copies.
- `decode_graphs.py`: decode steps at fixed batch sizes over fixed buffers (CUDA graphs).
- `tp_group.py`: the collective group of a tensor-parallel engine's ranks.
- `tp_runner.py`: `TensorParallelRunner` and the rank processes: rank 0 prepares each step
  once and every rank runs it on its shard.
- `step_census.py`: counting what a step would ask of a GPU (launches, syncs, bytes) through
  the real code path, on CPU.

The engine (`cairn.workers.engine`) owns the runner; the scheduler and the cache never see it.
"""
