"""The conversions, one module per command: each builds its plan from the source's metadata and
hands it to the run stage."""
