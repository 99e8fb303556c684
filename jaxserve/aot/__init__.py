"""Ahead-of-time compilation for accelerators that are not attached (``jaxserve compile``).

    targets.py          the named targets and their facts (public specifications)
    devices.py          a target's compile-only devices, or what to install for its compiler
    gpu_target_config.py  a GPU target's GpuTargetConfig (what XLA:GPU compiles for)
    abstract_engine.py  the engine's runner for a target, over abstract weights and KV pages
    compiler.py         each warm-up compilation compiled for the target, with its analyses
    roofline.py         step times and tokens per second from the compiler's counts
    report.py           the per-bucket table, the totals against the memory plan, JSON

Above the runner, below the CLI: imports runner, models, checkpoints_tools and host data.
"""
