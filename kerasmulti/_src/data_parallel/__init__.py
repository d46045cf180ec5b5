"""The data-parallel model: splitting batches, running replicas, merging, and their parts."""
