"""The Ray layer: Ray Train trainers, cluster capacity checks and waiting for the autoscaler."""
