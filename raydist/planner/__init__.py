"""The layout planner: enumerate meshes, estimate per-rank memory and step time, rank by MFU.

    from raydist.planner import choose_layout
    layout, estimate = choose_layout(cfg, world_size=8, gpus_per_node=8, device="h100")

Modules: hardware (device table, calibration file), layout (Layout, Workload), memory and timing (the
cost model's two halves), cost_model (one estimate), enumerate (the search), calibrate (measure this
machine), published (Llama 3 405B and Megatron 1T), cli (`raydist plan`).
"""

from raydist.planner.enumerate import choose_layout

__all__ = ["choose_layout"]
