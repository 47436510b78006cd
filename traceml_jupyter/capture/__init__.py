"""Capture: what runs while a traced cell runs. The loop located and rewritten (locate, rewrite,
cell_functions, line_costs), the names the rewritten code calls (hooks), the training's events
turned into steps (recording, step_model) and kept in bounded columns (recorder), the GPU clock
and watches (cuda_clock, h2d, syncs, gpu_watch, nvml), and guarded reads of the user's objects."""
