"""Model code: array code on the backend's `xp` that calls the backend's ops (attention, MoE,
transformer, weights, loader, MTP block); it never asks which device it runs on. The token graph
(CUDA: decode steps captured as graphs) calls the kernels itself."""
