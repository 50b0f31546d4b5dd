"""Where samples come from: folders, manifests, WebDataset shards, object storage (the leaf: Sample)."""
