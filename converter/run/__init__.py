"""Running a plan: the one conversion pipeline (``pipeline``) and the outputs it drives
(``sinks``), opening sources, destination checks, the journal and ``--resume``, the one executor
that does all tensor I/O, torchrun sharing and remote (URL) destinations."""
