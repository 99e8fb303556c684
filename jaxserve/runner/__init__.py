"""The runner: the only bridge between the host (scheduler) and the device (models, kernels)."""
