"""Inside a sampled step: forward, backward and optimizer time (step_parts; their stamps and
sums: part_store; the model's calls found and timed: model_calls), and the cost of each line
of the loop's body (line_costs)."""
