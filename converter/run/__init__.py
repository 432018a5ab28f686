"""Running a plan: opening sources, destination checks, the journal and ``--resume``, the one
executor that does all tensor I/O, torchrun sharing and remote (URL) destinations."""
