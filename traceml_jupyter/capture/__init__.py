"""Capture: what runs while a traced cell runs. At the top, the capture itself: Capture and its
lifetime (recording), its per-step hooks (step_hooks) and when they stamp (stamping). Below, its
parts by job, each importing only the parts under it (tests/unit/test_layout.py): the user's code
reached into (instrument/), the steps as recorded (steps/), what fed them (data/), the GPU
(gpu/), the run's resources (resources/), and what a sampled step measures inside (inside/)."""
