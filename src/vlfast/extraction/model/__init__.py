"""What runs the model: feature definitions and token-budget batching."""
