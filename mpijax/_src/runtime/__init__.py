"""The runtime: init() and shutdown(), this rank's devices, the stall inspector, abort on failure."""
