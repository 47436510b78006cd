"""Inside the DataLoader: what happens in the loader's workers during a traced run (docs/loader-inside.md)."""
