"""torch.compile's own record of what it compiled while the cell ran (dynamo.py)."""
