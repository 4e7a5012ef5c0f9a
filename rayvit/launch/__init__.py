"""The Ray layer: reaching a cluster (``connect``) and where runs keep their checkpoints (``storage``)."""
