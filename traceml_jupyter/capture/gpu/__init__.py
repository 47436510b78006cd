"""The GPU while a loop runs on CUDA, never initialising CUDA itself: whether CUDA is
initialised (cuda_state), CUDA graphs' captures and replays (cuda_graphs), the GPU clock
(cuda_clock), the device a loop works on (gpu_activity), and the GPU watch (gpu_watch): the
syncs timed (syncs), copies to the GPU (h2d; what a copy call asks for: copy_calls), and the
waits nobody reports (hidden_waits)."""
