"""OUT on disk: the format, the writer (FeatureStore), the reader (FeatureCache), integrity."""
