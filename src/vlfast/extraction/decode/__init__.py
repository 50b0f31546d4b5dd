"""Sample -> pixels: image and video decoding, truncation checks, the decode worker pool."""
