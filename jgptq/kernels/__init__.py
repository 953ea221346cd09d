"""Fused accelerator kernels of the solver (Pallas); each has a pure-XLA twin that stays the CPU and fallback path."""
