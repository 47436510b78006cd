"""What fed the steps: guarded reads of the user's objects (probes: batch size, length, type,
the namespace), torch DataLoaders read as plain values (dataloaders), and a run's data
sources, passes and batch size, read off the capture once it closed (sources)."""
