"""The Ray layer: connect to a cluster, check it can hold a run, and run it on Ray Train workers."""
