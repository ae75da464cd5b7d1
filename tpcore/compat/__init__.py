"""What users of parallelformers find under their old names: the predecessor's classes and functions
(:mod:`~tpcore.compat.parallelformers`). Nothing inside tpcore imports this package."""
