"""What users of parallelformers and plugins written for earlier tpcore find under their old names:
the predecessor's classes and functions (:mod:`~tpcore.compat.parallelformers`) and earlier module
paths (:mod:`~tpcore.compat.moved`). Nothing inside tpcore imports this package."""
