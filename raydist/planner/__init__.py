"""The layout planner: enumerate meshes, estimate per-rank memory and step time, rank by MFU.

    from raydist.planner import choose_layout, auto_config
    spec, settings = choose_layout(cfg, world_size=8, gpus_per_node=8, device="h100")
    cfg = auto_config(cfg, world_size=8)[0]      # the same, applied to a new Config

Modules: hardware (device table, calibration file), layout (Layout, Workload), memory and timing (the
cost model's two halves), cost_model (one estimate), enumerate (the search), calibrate (measure this
machine), published (Llama 3 405B and Megatron 1T), cli (`raydist plan`).
"""

from raydist.planner.enumerate import auto_config, choose_layout

__all__ = ["auto_config", "choose_layout"]
