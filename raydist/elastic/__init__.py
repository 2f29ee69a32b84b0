"""Elasticity: the layout policy (live workers -> mesh), idle-worker coordination, the hang watchdog."""
