"""The resources of a run, sampled while it runs (watch: all of them for one run): the host's
cores, CPU and memory (host), GPU utilisation through NVML (nvml), GPU memory per step
(gpu_memory), the samplers' bounded buffer (samples), the training thread's CPU time and its
wait for a core (thread_time); and what a run ran on (machine)."""
