"""Model code written against `xp` (numpy or cupy): ops, attention, MoE, transformer, MTP."""
